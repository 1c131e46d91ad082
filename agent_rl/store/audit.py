"""Where a run's compute went: the audit `agent-rl audit`, `/api/v1/audit` and the viewer show.

Everything here is read from the store (`TimelineStore.run_timeline`): episodes, turns and tool
calls as the runner wrote them, the trainer's timings, and serve's samples of each engine's
`/v1/loads`. Nothing is estimated from configuration.

- **Shares of the wall clock** (first episode admitted or first trainer span, to the last
  event). Each instant is in exactly one cell of trainer state x rollout state, so the cells add
  up to 1: the trainer is `stepping` (optimizer step), else `syncing` weights (export, then the
  engines' load), else `waiting` for data, else `other` (loading a batch, committing,
  checkpointing, or no trainer running); rollout is `busy` while at least one episode runs.
  The activities' own shares (and their overlaps) are sums of cells.
- **Engines**: per engine, the share of its sampled time it was decoding (a sample with running
  requests), its mean running requests and KV-cache use; generated and prompt tokens per second
  over the run, from the turns.
- **Episodes**: their time split into generation, tools, queued (admitted, not started) and
  other (env reset, sandbox start, store writes), which add up to the episodes' wall time.
- **Long tail**: duration, turns and tokens p50/p90/p99/max, and the share of generated tokens
  the slowest 10% of episodes produced.
- **Waste**: generated tokens of episodes filtered (by reason), failed (by cause) or never
  trained, and tokens of trained episodes left out as stale.
- **Verdict**: one line with its number, and the advice that follows from it. When generated
  tokens that were never trained on (filtered, failed, never claimed) are at least
  `WASTE_VERDICT_SHARE` of the run's and filtered ones are the largest part, the verdict names
  that waste first (zero-variance groups: task selection, larger groups, the env's reward),
  with the time-based verdict after it. The run's decode
  throughput is compared with bench/decode.py's table (`--out` file) at the cell nearest the
  run's completion length and concurrency, when one is given.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent_rl.store.timeline import RunTimeline

TRAINER_STATES = ("stepping", "syncing", "waiting", "other")
ROLLOUT_STATES = ("busy", "idle")
SERIES_POINTS = 120
WASTE_VERDICT_SHARE = 0.25
"""Share of generated tokens filtered (of one kind) from which the verdict names the waste."""
WASTE_ADVICE = {
    "zero_variance": (
        "groups whose rewards were all equal (no GRPO signal)",
        "pause tasks whose recent groups were all equal (rollout.task_selection = "
        '"skip_all_equal"), use larger groups (rollout.group_size) so a hard task\'s group '
        "holds a success, or give the env a reward that separates attempts",
    ),
    "stale": (
        "groups filtered as stale",
        "queue fewer groups ahead of the trainer (rollout.max_queued_groups) or allow more "
        "staleness (trainer.max_staleness)",
    ),
    "stale_sibling": (
        "siblings older than the staleness bound (counted in their baselines, not trained)",
        "queue fewer groups ahead of the trainer (rollout.max_queued_groups), allow more "
        "staleness (trainer.max_staleness) or cap the long episodes (rollout.max_turns)",
    ),
}
"""Points of each time series (binned), enough for a plot, small for JSON."""


@dataclass
class DecodeTable:
    """bench/decode.py's measured sustained decode, tok/s by path, completion length and
    concurrency: `tok_s[path][length][concurrency]` (keys are strings, as in its JSON)."""

    tok_s: dict[str, dict[str, dict[str, float]]]

    @classmethod
    def load(cls, path: Path) -> DecodeTable:
        data = json.loads(Path(path).read_text())
        return cls(tok_s=data["tok_s"])

    def nearest(self, length: float, concurrency: float, path: str = "engine") -> tuple[float, int, int] | None:
        """(tok/s, length, concurrency) of the measured cell nearest (in log scale) to these."""
        table = self.tok_s.get(path) or {}
        best = None
        for lk, row in table.items():
            for ck, v in row.items():
                d = (math.log2(int(lk) / max(length, 1)) ** 2
                     + math.log2(int(ck) / max(concurrency, 1)) ** 2)
                if best is None or d < best[0]:
                    best = (d, float(v), int(lk), int(ck))
        return None if best is None else best[1:]


@dataclass
class Shares:
    wall_s: float
    cells: dict[str, float]
    """`trainer_state/rollout_state` -> share of the wall clock; they add up to 1."""
    rollout_busy: float
    trainer_stepping: float
    trainer_syncing: float
    trainer_waiting: float
    trainer_other: float
    stepping_while_rollout: float
    syncing_while_rollout: float
    waiting_while_rollout: float


@dataclass
class EngineUse:
    engine: str
    samples: int
    decode_busy: float
    """Share of its sampled time with requests running."""
    mean_running: float | None
    """Mean running requests while busy."""
    mean_token_usage: float | None
    max_token_usage: float | None
    mean_gen_tokens_per_s: float | None
    """SGLang's own figure, while busy."""
    prefilled_tokens: float | None = None
    """Prompt tokens the engine prefilled (prefix-cache misses) over its samples."""


@dataclass
class Throughput:
    generated_tokens: int
    prompt_tokens: int
    """Context tokens sent with each turn (prefix-cache hits included)."""
    generated_per_s: float | None
    """Over the time rollout was busy."""
    prompt_per_s: float | None
    prefilled_per_s: float | None
    """Prompt tokens the engines prefilled (cache misses, SGLang's counter) per second of
    rollout; None without samples that carry the counter."""
    decode_tok_s_per_engine: float | None
    """Generated tokens per second of engine decode time (sampled busy time)."""
    mean_completion_tokens: float | None
    mean_concurrency: float | None
    """Mean running requests per engine while decoding (samples)."""
    reference: dict[str, Any] | None = None
    """bench/decode.py's cell for this length and concurrency: tok_s, length, concurrency,
    and `ratio` = decode_tok_s_per_engine / tok_s."""
    engines: list[EngineUse] = field(default_factory=list)


@dataclass
class EpisodeTime:
    episodes: int
    wall_s: float
    generation_s: float
    tool_s: float
    queued_s: float
    other_s: float

    def share(self, part: str) -> float:
        return getattr(self, part) / self.wall_s if self.wall_s else 0.0


@dataclass
class Tail:
    episodes: int
    duration_s: dict[str, float | None]
    turns: dict[str, float | None]
    tokens: dict[str, float | None]
    slowest_10pct_token_share: float | None


@dataclass
class Waste:
    generated_tokens: int
    trained_tokens: int
    filtered: dict[str, int]
    failed: dict[str, int]
    never_trained: int
    """Generated tokens of episodes completed (or still running) but not trained."""
    stale_masked: int
    """Tokens of trained episodes left out of the loss as stale (the steps' `stale_tokens`)."""
    wasted: int = 0
    """filtered + failed + never trained: generated and not trained on."""


@dataclass
class ComputeAudit:
    run: dict[str, Any]
    shares: Shares
    throughput: Throughput
    episode_time: EpisodeTime
    tail: Tail
    waste: Waste
    verdict: str
    advice: str
    series: dict[str, list[list[float]]] = field(default_factory=dict)
    """Time series for plots, [seconds since start, value]: generated and prompt tok/s,
    each engine's running requests and KV-cache use."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    v = sorted(values)

    def q(p: float) -> float:  # linear interpolation, as numpy's default
        k = (len(v) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return v[lo] + (v[hi] - v[lo]) * (k - lo)

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": v[-1]}


def _sweep(start: float, end: float, rollout: list[tuple[float, float]],
           trainer: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    """Seconds of [start, end] in each `trainer_state/rollout_state` cell."""
    events: list[tuple[float, str, int]] = []
    for a, b in rollout:
        events += [(max(a, start), "rollout", 1), (min(b, end), "rollout", -1)]
    for kind, spans in trainer.items():
        for a, b in spans:
            events += [(max(a, start), kind, 1), (min(b, end), kind, -1)]
    events = [e for e in events if start <= e[0] <= end]
    events.sort(key=lambda e: (e[0], e[2]))
    active: Counter[str] = Counter()
    cells = {f"{t}/{r}": 0.0 for t in TRAINER_STATES for r in ROLLOUT_STATES}
    t = start
    for at, kind, delta in [*events, (end, "", 0)]:
        if at > t:
            state = next((s for s in ("stepping", "syncing", "waiting") if active[s] > 0), "other")
            cells[f"{state}/{'busy' if active['rollout'] > 0 else 'idle'}"] += at - t
            t = at
        if kind:
            active[kind] += delta
    return cells


def _shares(tl: RunTimeline, start: float, end: float) -> Shares:
    rollout = [(e.started_at, e.finished_at if e.finished_at is not None else end)
               for e in tl.episodes if e.started_at is not None]
    kinds = {"step": "stepping", "export": "syncing", "sync": "syncing", "wait": "waiting"}
    trainer: dict[str, list[tuple[float, float]]] = {}
    for s in tl.spans:
        if s.kind in kinds:
            trainer.setdefault(kinds[s.kind], []).append((s.started_at, s.finished_at))
    wall = end - start
    seconds = _sweep(start, end, rollout, trainer)
    cells = {k: (v / wall if wall > 0 else 0.0) for k, v in seconds.items()}

    def of(trainer_state: str | None = None, rollout_state: str | None = None) -> float:
        return sum(v for k, v in cells.items()
                   if (trainer_state is None or k.startswith(trainer_state + "/"))
                   and (rollout_state is None or k.endswith("/" + rollout_state)))

    return Shares(
        wall_s=wall, cells=cells, rollout_busy=of(rollout_state="busy"),
        trainer_stepping=of("stepping"), trainer_syncing=of("syncing"),
        trainer_waiting=of("waiting"), trainer_other=of("other"),
        stepping_while_rollout=cells["stepping/busy"], syncing_while_rollout=cells["syncing/busy"],
        waiting_while_rollout=cells["waiting/busy"],
    )  # fmt: skip


def _engines(tl: RunTimeline, end: float) -> tuple[list[EngineUse], float]:
    """Per engine use, and the engines' summed decode-busy seconds. A sample stands for the
    time until the engine's next sample (the last one: the median sampling interval)."""
    by_engine: dict[str, list[Any]] = {}
    for s in tl.samples:
        by_engine.setdefault(s.engine, []).append(s)
    out, busy_total = [], 0.0
    for engine, samples in sorted(by_engine.items()):
        gaps = [b.sampled_at - a.sampled_at for a, b in zip(samples, samples[1:])]
        typical = sorted(gaps)[len(gaps) // 2] if gaps else 1.0
        weights = [*gaps, min(typical, max(end - samples[-1].sampled_at, 0.0))]
        if not sum(weights):
            weights[-1] = typical  # one sample, at the end
        total = sum(weights)
        busy = [(s, w) for s, w in zip(samples, weights) if s.running > 0]
        busy_s = sum(w for _, w in busy)
        busy_total += busy_s
        usage = [s.token_usage for s in samples if s.token_usage is not None]
        # 0 while busy means SGLang is not computing it (its stats logging is off), not idle.
        gen = [s.gen_tokens_per_s for s, _ in busy if s.gen_tokens_per_s]
        counters = [s.prefill_tokens_total for s in samples if s.prefill_tokens_total is not None]
        out.append(EngineUse(
            engine=engine, samples=len(samples), decode_busy=busy_s / total if total else 0.0,
            mean_running=(sum(s.running * w for s, w in busy) / busy_s) if busy_s else None,
            mean_token_usage=sum(usage) / len(usage) if usage else None,
            max_token_usage=max(usage) if usage else None,
            mean_gen_tokens_per_s=sum(gen) / len(gen) if gen else None,
            prefilled_tokens=_counted(counters) if len(counters) > 1 else None,
        ))  # fmt: skip
    return out, busy_total


def _counted(counter: list[float]) -> float:
    """What a cumulative counter counted over its samples (a drop is an engine restart)."""
    return sum(b - a if b >= a else b for a, b in zip(counter, counter[1:]))


def _throughput(tl: RunTimeline, shares: Shares, end: float, table: DecodeTable | None) -> Throughput:
    engines, busy_s = _engines(tl, end)
    generated = sum(t.completion_tokens for t in tl.turns)
    prompt = sum(t.context_tokens for t in tl.turns)
    rollout_s = shares.rollout_busy * shares.wall_s
    running = [(e.mean_running, e.decode_busy * e.samples) for e in engines if e.mean_running]
    weight = sum(w for _, w in running)
    concurrency = sum(m * w for m, w in running) / weight if weight else None
    length = generated / len(tl.turns) if tl.turns else None
    prefilled = [e.prefilled_tokens for e in engines if e.prefilled_tokens is not None]
    per_engine = generated / busy_s if busy_s > 0 else None
    out = Throughput(
        generated_tokens=generated, prompt_tokens=prompt,
        generated_per_s=generated / rollout_s if rollout_s > 0 else None,
        prompt_per_s=prompt / rollout_s if rollout_s > 0 else None,
        prefilled_per_s=(sum(prefilled) / rollout_s if prefilled and rollout_s > 0 else None),
        decode_tok_s_per_engine=per_engine, mean_completion_tokens=length,
        mean_concurrency=concurrency, engines=engines,
    )  # fmt: skip
    if table is not None and length and concurrency and per_engine:
        cell = table.nearest(length, concurrency)
        if cell is not None:
            tok_s, lk, ck = cell
            out.reference = {"tok_s": tok_s, "length": lk, "concurrency": ck,
                             "ratio": per_engine / tok_s if tok_s else None}
    return out


def _episode_time(tl: RunTimeline) -> EpisodeTime:
    done = [e for e in tl.episodes if e.started_at is not None and e.finished_at is not None]
    gen = tool = queued = other = 0.0
    for e in done:
        wall = max(e.finished_at - e.created_at, 0.0)  # type: ignore[operator]
        q = min(max(e.started_at - e.created_at, 0.0), wall)  # type: ignore[operator]
        t = min(max(e.tool_s, 0.0), wall - q)
        g = min(max(e.turn_s - e.tool_s, 0.0), wall - q - t)
        queued, tool, gen = queued + q, tool + t, gen + g
        other += wall - q - t - g
    return EpisodeTime(len(done), gen + tool + queued + other, gen, tool, queued, other)


def _tail(tl: RunTimeline) -> Tail:
    done = [e for e in tl.episodes if e.started_at is not None and e.finished_at is not None]
    durations = [e.finished_at - e.started_at for e in done]  # type: ignore[operator]
    share = None
    total = sum(e.num_model_tokens for e in done)
    if done and total:
        slowest = sorted(done, key=lambda e: e.finished_at - e.started_at, reverse=True)  # type: ignore[operator]
        k = max(1, math.ceil(len(done) / 10))
        share = sum(e.num_model_tokens for e in slowest[:k]) / total
    return Tail(
        episodes=len(done), duration_s=_percentiles(durations),
        turns=_percentiles([float(e.num_turns) for e in done]),
        tokens=_percentiles([float(e.num_tokens) for e in done]),
        slowest_10pct_token_share=share,
    )  # fmt: skip


def _waste(tl: RunTimeline) -> Waste:
    filtered: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    trained = never = 0
    for e in tl.episodes:
        n = e.num_model_tokens
        if e.status == "trained":
            trained += n
        elif e.status == "filtered":
            filtered[e.ended_why or "other"] += n
        elif e.status == "failed":
            failed[e.ended_why or "unknown"] += n
        else:
            never += n
    stale = sum(int(s.get("stale_tokens") or 0) for s in tl.steps)
    return Waste(
        generated_tokens=sum(e.num_model_tokens for e in tl.episodes), trained_tokens=trained,
        filtered=dict(filtered), failed=dict(failed), never_trained=never, stale_masked=stale,
        wasted=sum(filtered.values()) + sum(failed.values()) + never,
    )  # fmt: skip


def _series(tl: RunTimeline, start: float, end: float) -> dict[str, list[list[float]]]:
    wall = end - start
    if wall <= 0:
        return {}
    width = max(wall / SERIES_POINTS, 1.0)
    n = max(1, math.ceil(wall / width))
    gen, prompt = [0.0] * n, [0.0] * n
    for t in tl.turns:
        i = min(max(int((t.finished_at - start) / width), 0), n - 1)
        gen[i] += t.completion_tokens
        prompt[i] += t.context_tokens
    out = {
        "generated tok/s": [[(i + 0.5) * width, v / width] for i, v in enumerate(gen)],
        "prompt tok/s": [[(i + 0.5) * width, v / width] for i, v in enumerate(prompt)],
    }
    for engine in sorted({s.engine for s in tl.samples}):
        mine = [s for s in tl.samples if s.engine == engine]
        step = max(1, len(mine) // SERIES_POINTS)
        picked = mine[::step]
        out[f"running requests · {engine}"] = [[s.sampled_at - start, float(s.running)] for s in picked]
        counter = [s for s in mine if s.prefill_tokens_total is not None][::step]
        if len(counter) > 1:
            out[f"prefilled tok/s · {engine}"] = [
                [b.sampled_at - start, _counted([a.prefill_tokens_total, b.prefill_tokens_total])
                 / max(b.sampled_at - a.sampled_at, 1e-9)] for a, b in zip(counter, counter[1:])
            ]  # type: ignore[list-item]
        usage = [[s.sampled_at - start, s.token_usage] for s in picked if s.token_usage is not None]
        if usage:
            out[f"KV-cache use · {engine}"] = usage
    return out


def _verdict(run: dict[str, Any], s: Shares, tp: Throughput, tail: Tail, et: EpisodeTime,
             trained: bool) -> tuple[str, str]:
    ref = tp.reference
    speed = (f"; engines decoded at {ref['ratio']:.0%} of the throughput measured for "
             f"{ref['length']} tokens at concurrency {ref['concurrency']}"
             if ref and ref.get("ratio") is not None else "")
    if run.get("kind") == "eval":
        return (f"evaluation run: rollout busy {s.rollout_busy:.0%} of its {s.wall_s:.0f} s{speed}",
                "no trainer consumes an evaluation; its tokens are for scoring, not waste")
    if not trained:
        return (f"rollout only: no trainer step recorded; rollout busy {s.rollout_busy:.0%} of "
                f"{s.wall_s:.0f} s{speed}", "start `agent-rl train` for the same run")
    trainer_s = s.trainer_stepping + s.trainer_syncing + s.trainer_waiting
    idle = s.trainer_waiting / trainer_s if trainer_s else 0.0
    if s.trainer_syncing >= 0.2 and s.trainer_syncing >= s.trainer_waiting:
        return (f"sync-bound: weight sync took {s.trainer_syncing:.0%} of the run",
                "sync less often (trainer.export_every) or load weights faster (a collective "
                "update instead of files)")
    if idle >= 0.25:
        verdict = f"rollout-bound: the trainer waited {s.trainer_waiting:.0%} of the run{speed}"
        gain = _batch_headroom(tp)
        busy = [e.decode_busy for e in tp.engines]
        engine_busy = sum(busy) / len(busy) if busy else None
        if et.wall_s and et.share("tool_s") >= 0.5:
            advice = (f"tools take {et.share('tool_s'):.0%} of episode time: run more episodes "
                      "at once (rollout.max_concurrent_episodes) so decode overlaps them")
        elif engine_busy is not None and engine_busy < 0.5:
            advice = (f"the engines decoded only {engine_busy:.0%} of the time: rollout is held "
                      f"back before them (episodes spent {et.share('other_s'):.0%} of their time "
                      "outside generation and tools: env, runner, store), so run more episodes "
                      "at once (rollout.max_concurrent_episodes) or more serve processes, not "
                      "more engines")
        elif gain is not None and gain >= 1.5:
            advice = (f"larger groups in flight: the engines run {tp.mean_concurrency:.0f} "
                      f"requests at once, and the decode table gives {gain:.1f}x more tok/s at "
                      "higher concurrency (rollout.max_concurrent_episodes, "
                      "rollout.max_queued_groups)")
        elif (tail.slowest_10pct_token_share or 0) >= 0.3:
            advice = (f"shorter budgets: the slowest 10% of episodes produced "
                      f"{tail.slowest_10pct_token_share:.0%} of the tokens (rollout.max_new_tokens, "
                      "rollout.max_turns)")
        else:
            advice = "more engines: they are busy at their measured throughput"
        return verdict, advice
    if 1 - s.rollout_busy >= 0.25:
        return (f"trainer-bound: rollout idled {1 - s.rollout_busy:.0%} of the run while the "
                "trainer stepped",
                "a faster trainer (more GPUs, larger micro-batches), or let rollout run further "
                "ahead (trainer.max_staleness, rollout.max_queued_groups)")
    return (f"balanced: the trainer waited {s.trainer_waiting:.0%} and rollout idled "
            f"{1 - s.rollout_busy:.0%} of the run{speed}",
            "scale engines and trainer together")


def _waste_verdict(w: Waste) -> tuple[str, str] | None:
    """The verdict and advice naming filtered tokens, when they are the largest waste and at
    least `WASTE_VERDICT_SHARE` of the generated tokens; else None."""
    if not w.generated_tokens or not w.filtered:
        return None
    kind, tokens = max(w.filtered.items(), key=lambda kv: kv[1])
    others = [*w.failed.values(), w.never_trained, w.stale_masked]
    share = tokens / w.generated_tokens
    if share < WASTE_VERDICT_SHARE or tokens < max(others):
        return None
    what, advice = WASTE_ADVICE.get(kind, (f"episodes filtered ({kind})",
                                           "see why they were filtered (agent-rl episodes)"))
    return (f"waste-bound: {share:.0%} of the generated tokens were in {what}, filtered "
            f"({kind}) and never trained: the largest waste", advice)


def _batch_headroom(tp: Throughput) -> float | None:
    """How much more decode throughput the table gives at its highest concurrency than at the
    run's, for the run's length (None without a table or samples)."""
    ref = tp.reference
    if not ref or not ref.get("tok_s"):
        return None
    return ref.get("best_tok_s", ref["tok_s"]) / ref["tok_s"]


def compute_audit(tl: RunTimeline, table: DecodeTable | None = None) -> ComputeAudit:
    """The audit of one run's timeline (see the module docstring)."""
    # The run's own activity: evaluations recorded on it (`eval` spans) run their own episodes
    # in runs of their own, and the time around them (e.g. SFT before RL) is not this run's.
    spans = [s for s in tl.spans if s.kind != "eval"]
    times = [e.created_at for e in tl.episodes] + [s.started_at for s in spans]
    ends = ([e.finished_at for e in tl.episodes if e.finished_at is not None]
            + [e.started_at for e in tl.episodes if e.started_at is not None]
            + [s.finished_at for s in spans])
    start = min(times) if times else 0.0
    end = max([start, *ends])
    tl.samples = [s for s in tl.samples if start <= s.sampled_at <= end]
    shares = _shares(tl, start, end)
    tp = _throughput(tl, shares, end, table)
    if tp.reference is not None and table is not None:
        row = table.tok_s.get("engine", {}).get(str(tp.reference["length"]), {})
        tp.reference["best_tok_s"] = max(row.values()) if row else None
    et, tail, waste = _episode_time(tl), _tail(tl), _waste(tl)
    verdict, advice = _verdict(tl.run, shares, tp, tail, et, trained=bool(tl.steps))
    named = _waste_verdict(waste) if tl.steps and tl.run.get("kind") != "eval" else None
    if named is not None:
        verdict, advice = f"{named[0]}; besides, {verdict}", named[1]
    return ComputeAudit(run=tl.run, shares=shares, throughput=tp, episode_time=et, tail=tail,
                        waste=waste, verdict=verdict, advice=advice,
                        series=_series(tl, start, end))


async def audit_run(store: Any, run_id: int, decode_table: Path | None = None) -> ComputeAudit:
    """Read run `run_id`'s timeline from `store` and audit it, against `decode_table` (a
    bench/decode.py `--out` file) when given."""
    table = DecodeTable.load(decode_table) if decode_table is not None else None
    return compute_audit(await store.run_timeline(run_id), table)
