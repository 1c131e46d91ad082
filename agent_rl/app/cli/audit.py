"""`agent-rl audit [--run R] [--json]`: where a run's compute went, read from the store.

The audit itself is `agent_rl.store.audit`; this prints it as text (or one JSON object).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import anyio
import typer

from agent_rl.app.cli.common import console, state

if TYPE_CHECKING:
    from agent_rl.store.audit import ComputeAudit


def audit(
    ctx: typer.Context,
    run: Annotated[Optional[str], typer.Option(help="Run name (default: run.name).")] = None,
    decode_table: Annotated[Optional[Path], typer.Option(
        help="bench/decode.py's --out file (default: rollout.decode_table) to compare the "
             "run's decode throughput with.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The audit as one JSON object.")] = False,
) -> None:
    """Where the run's time and tokens went: shares of the wall clock (rollout, trainer stepping,
    waiting, weight sync, their overlap), engine use and throughput, episode time, the long
    tail, waste, and a one-line verdict with advice."""
    cfg = state(ctx).config()
    table = decode_table or cfg.rollout.decode_table
    result = anyio.run(_audit, cfg.store, run or cfg.run.name, table)
    if as_json:
        print(json.dumps(result.as_dict()))
        return
    console.print(render(result), highlight=False, markup=False, soft_wrap=True)


async def _audit(store_cfg, run: str, table: Path | None) -> ComputeAudit:  # type: ignore[no-untyped-def]
    from agent_rl.store import Store
    from agent_rl.store.audit import audit_run

    async with await Store.open(store_cfg) as store:
        return await audit_run(store, await store.run_id(run), table)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:6.1%}"


def _n(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}g}"


def render(a: ComputeAudit) -> str:
    """The audit as the text `agent-rl audit` prints."""
    from agent_rl.store.audit import ROLLOUT_STATES, TRAINER_STATES

    s, tp, et, tail, w = a.shares, a.throughput, a.episode_time, a.tail, a.waste
    kind = a.run.get("kind") or "train"
    head = f"run {a.run['name']} ({kind}"
    if kind == "eval":
        head += f" of run id {a.run.get('evaluates_run_id')} at policy version {a.run.get('evaluates_version')}"
    lines = [head + f"): {s.wall_s:.0f} s of wall clock", "",
             "time shares (trainer state x rollout; the cells add up to 100%)",
             f"  {'':10}{'rollout busy':>14}{'rollout idle':>14}{'total':>10}"]
    for t in TRAINER_STATES:
        row = [s.cells[f"{t}/{r}"] for r in ROLLOUT_STATES]
        lines.append(f"  {t:10}{_pct(row[0]):>14}{_pct(row[1]):>14}{_pct(sum(row)):>10}")
    cols = [sum(s.cells[f"{t}/{r}"] for t in TRAINER_STATES) for r in ROLLOUT_STATES]
    lines.append(f"  {'total':10}{_pct(cols[0]):>14}{_pct(cols[1]):>14}{_pct(sum(cols)):>10}")
    lines += ["", "engines"]
    for e in tp.engines:
        lines.append(
            f"  {e.engine}: decode busy {e.decode_busy:.0%} of {e.samples} samples, "
            f"{_n(e.mean_running)} requests running while busy, KV cache "
            f"{_pct(e.mean_token_usage).strip()} mean / {_pct(e.max_token_usage).strip()} max"
            # SGLang's own figure, when its stats logging computes one
            + ("" if e.mean_gen_tokens_per_s is None
               else f", SGLang {_n(e.mean_gen_tokens_per_s)} tok/s")
        )
    if not tp.engines:
        lines.append("  no engine samples (serve records them every rollout.engine_sample_s)")
    ref = tp.reference
    lines += [
        "", "throughput",
        f"  generated {tp.generated_tokens} tokens, {_n(tp.generated_per_s)} tok/s of rollout; "
        f"{tp.prompt_tokens} prompt tokens sent, {_n(tp.prompt_per_s)} tok/s; prefilled "
        f"(cache misses) {_n(tp.prefilled_per_s)} tok/s",
        f"  per engine while decoding: {_n(tp.decode_tok_s_per_engine)} tok/s at "
        f"{_n(tp.mean_concurrency)} running requests, {_n(tp.mean_completion_tokens)}-token "
        "completions" + (f"; bench/decode.py measured {_n(ref['tok_s'])} tok/s at "
                         f"{ref['length']} tokens x {ref['concurrency']} = "
                         f"{_pct(ref['ratio']).strip()}" if ref else
                         "; no decode table to compare with (bench/decode.py --out FILE)"),
        "", f"episode time ({et.episodes} ended, {et.wall_s:.0f} episode-seconds)",
        "  " + " · ".join(f"{name} {et.share(part):.1%}" for name, part in (
            ("generation", "generation_s"), ("tools", "tool_s"), ("queued", "queued_s"),
            ("other", "other_s"))),
        "", "long tail (p50 / p90 / p99 / max)",
    ]
    for name, p in (("duration s", tail.duration_s), ("turns", tail.turns), ("tokens", tail.tokens)):
        lines.append(f"  {name:11}" + " / ".join(_n(p[k]) for k in ("p50", "p90", "p99", "max")))
    lines.append(f"  the slowest 10% of episodes produced {_pct(tail.slowest_10pct_token_share).strip()}"
                 " of the generated tokens")
    reasons = lambda d: ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"  # noqa: E731
    lines += [
        "", f"waste (generated tokens: {w.generated_tokens})",
        f"  trained {w.trained_tokens}; filtered {sum(w.filtered.values())} ({reasons(w.filtered)}); "
        f"failed {sum(w.failed.values())} ({reasons(w.failed)}); never trained {w.never_trained}; "
        f"left out of trained episodes as stale {w.stale_masked}",
        "", f"verdict: {a.verdict}", f"advice: {a.advice}",
    ]
    return "\n".join(lines)
