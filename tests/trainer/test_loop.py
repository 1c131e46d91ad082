"""The asynchronous loop end to end: real SGLang (tiny-moe, routed experts) serves episodes into a
real SQLite store; the real Megatron trainer consumes them, commits policy versions, exports and
syncs weights to the engine; parity of its logprobs with the rollout's; routing replay (R3)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from agent_rl.config import Config, TrainerConfig
from agent_rl.sglang.client import EngineClient
from agent_rl.store import Store
from tests.trainer._served import served_config, served_db  # noqa: F401 (fixture)
from trainer.data import load_batch
from trainer.evals import Evaluations
from trainer.learner import learner
from trainer.loop import TrainLoop


def trainer_config(db: Path, tmp: Path, server_url: str, model: Path, **trainer: Any) -> Config:
    cfg = served_config(db, server_url, model)
    values: dict[str, Any] = dict(
        groups_per_step=2, micro_batch_size=4, optim={"lr": 3e-5},
        weight_sync={"router_url": server_url},
        checkpoint_dir=tmp / "ckpt", export_dir=tmp / "exports", tensorboard_dir=tmp / "tb",
        data_poll_s=0.2,
    )
    values.update(trainer)
    return cfg.model_copy(update={"trainer": TrainerConfig(**values)})


@pytest.fixture
def store_copy(served_db: Path, tmp_path: Path) -> Path:
    """A private copy of the served store (tests mark episodes trained)."""
    target = tmp_path / "store.db"
    shutil.copy(served_db, target)
    return target


@pytest.fixture
def restore_engine(sglang_moe_server: Any, tiny_moe_model: Path) -> Iterator[None]:
    yield

    async def back() -> None:
        async with EngineClient(sglang_moe_server.url) as c:
            await c.update_weights_from_disk(tiny_moe_model, weight_version="default")

    asyncio.run(back())


def _ask(cfg: Config, fn: Any) -> Any:
    async def go() -> Any:
        async with await Store.open(cfg.store) as store:
            return await fn(store, await store.run_id(cfg.run.name))

    return asyncio.run(go())


def test_train_consumes_served_episodes_and_syncs(
    store_copy: Path, tmp_path: Path, sglang_moe_server: Any, tiny_moe_model: Path,
    restore_engine: None,
) -> None:
    cfg = trainer_config(store_copy, tmp_path, sglang_moe_server.url, tiny_moe_model,
                         checkpoint_every=2)
    lines: list[str] = []
    with learner(tiny_moe_model, cfg.trainer) as e:
        stats = TrainLoop(cfg, e, log=lines.append).run(max_steps=2)
    print("\n".join(lines))
    assert stats.steps == 2 and stats.version == 2 and stats.lost_leases == 0
    versions = [v for v in _ask(cfg, lambda s, r: s.policy_versions(r)) if v["version"] > 0]
    assert [v["version"] for v in versions] == [1, 2]  # version 0: the starting weights
    for v in versions:
        m = v["metrics"]
        for key in ("loss", "grad_norm", "entropy", "policy_kl", "clip_fraction",
                    "train_rollout_logprob_abs_diff", "idle_fraction", "tokens_per_s",
                    "staleness_histogram", "routing_mismatch_fraction"):
            assert key in m, key
        assert m["episodes"] == 4
    assert any(v["metrics"]["grad_norm"] > 0 for v in versions)  # rewards vary within groups
    assert versions[1]["checkpoint"] and Path(versions[1]["checkpoint"]).is_dir()
    ledger = _ask(cfg, lambda s, r: s.ledger(r))
    assert ledger.balances()
    episodes = _ask(cfg, lambda s, r: s.list_episodes(run_id=r))
    assert sorted(e.trained_step for e in episodes) == [1] * 4 + [2] * 4
    # The trainer kept its logprobs of the first micro-batch for inspection.
    first = min(e.id for e in episodes)
    kept = _ask(cfg, lambda s, r: s.trainer_logprobs(first))
    assert kept is not None and kept.shape[0] > 0

    async def served_version() -> str:
        async with EngineClient(sglang_moe_server.url) as c:
            return (await c.model_info())["weight_version"]

    assert asyncio.run(served_version()) == "2"
    assert (tmp_path / "exports" / "v000002" / "config.json").is_file()
    # Each step's time, for the compute audit: wait, step, export, sync, in that order.
    spans = _ask(cfg, lambda s, r: s.run_timeline(r)).spans
    assert [sp.kind for sp in spans] == ["wait", "step", "export", "sync"] * 2
    assert all(a.finished_at <= b.started_at + 1e-6 for a, b in zip(spans, spans[1:]))
    assert all(sp.finished_at >= sp.started_at for sp in spans)
    assert any((tmp_path / "tb").iterdir())  # TensorBoard event file


def _batch(cfg: Config) -> Any:
    async def go() -> Any:
        async with await Store.open(cfg.store) as store:
            run = await store.run_id(cfg.run.name)
            claim = await store.claim(run, "test", 4)
            await store.release(claim)
            return await load_batch(store, claim, 1)

    return asyncio.run(go())


def test_trainer_logprobs_match_rollout_logprobs(
    served_db: Path, tmp_path: Path, sglang_moe_server: Any, tiny_moe_model: Path
) -> None:
    cfg = trainer_config(served_db, tmp_path, sglang_moe_server.url, tiny_moe_model)
    data = _batch(cfg)
    batch = data.batch
    with learner(tiny_moe_model, cfg.trainer) as e:
        ours = e.logprobs(batch)["logprobs"]
    mask = batch.loss_mask
    diff = float(((ours - batch.rollout_logprobs).abs() * mask).sum() / mask.sum())
    print(f"trainer vs rollout logprobs over {int(mask.sum())} model tokens of "
          f"{len(data.episode_ids)} served episodes: mean abs diff {diff:.2e}")
    assert diff <= 1e-4


def test_routing_replay_uses_rollout_experts(
    served_db: Path, tmp_path: Path, sglang_moe_server: Any, tiny_moe_model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    cfg = trainer_config(served_db, tmp_path, sglang_moe_server.url, tiny_moe_model,
                         optim={"lr": 1e-2})
    data = _batch(cfg)
    used: list[torch.Tensor] = []
    original = RouterReplay.get_replay_topk

    def noting(self, scores, topk, *args, **kwargs):  # type: ignore[no-untyped-def]
        probs, idx = original(self, scores, topk, *args, **kwargs)
        used.append(idx.detach().clone())
        return probs, idx

    batch = data.batch
    with learner(tiny_moe_model, cfg.trainer) as e:
        e.rl_step(batch)  # a large step: the trainer's own routing now drifts from the rollout's
        e.rl_step(batch)
        monkeypatch.setattr(RouterReplay, "get_replay_topk", noting)
        e.cfg = e.cfg.model_copy(update={"routing_replay": True, "micro_batch_size": 64})
        e.logprobs(batch)
        replayed = [u.clone() for u in used]
        monkeypatch.setattr(RouterReplay, "get_replay_topk", original)
        e.cfg = e.cfg.model_copy(update={"routing_replay": False,
                                         "optim": e.cfg.optim.model_copy(update={"lr": 0.0})})
        assert e.routing_replay is not None
        positions = torch.arange(batch.length).unsqueeze(0).expand(batch.size, -1)
        assert batch.routed_experts is not None and batch.routed_valid is not None
        with torch.no_grad(), e.routing_replay.forward_context(batch.routed_experts, False) as mismatch:
            e.model(batch.tokens, positions, None)
    # Replay on: every MoE layer used exactly the rollout's experts on every recorded token.
    valid = batch.routed_valid.transpose(0, 1).reshape(-1)
    layers = batch.routed_experts.shape[2]
    assert len(replayed) == layers
    for layer, idx in enumerate(replayed):
        recorded = batch.routed_experts[:, :, layer].transpose(0, 1).reshape(-1, idx.shape[-1])
        same = (idx.sort(-1).values == recorded.sort(-1).values).all(-1)[valid]
        assert bool(same.all()), f"layer {layer}: {float(same.float().mean()):.4f} equal"
    print(f"R3: replay on, 100% of {int(valid.sum())} recorded tokens used the rollout's experts; "
          f"replay off, free routing differs on {mismatch.fraction:.4f} of them")
    assert mismatch.fraction > 0


@pytest.mark.cpu_exclusive  # its evaluator runs under SCHED_IDLE
def test_eval_every_evaluates_pinned_versions_beside_training(
    store_copy: Path, tmp_path: Path, sglang_moe_server: Any, tiny_moe_model: Path,
    restore_engine: None,
) -> None:
    """`trainer.eval.every = 1`: after v1 the trainer has its evaluator (`agent-rl eval
    --from-stdin`, started when it opened) evaluate v1 in a process of its own (its own engine,
    on v1's export, at `eval.nice` and SCHED_IDLE) and goes on training; v2 comes while it runs
    and is skipped, with a line saying so. The evaluation run
    records v1 as the version it scored, and every token it sampled says v1."""
    cfg = trainer_config(store_copy, tmp_path, sglang_moe_server.url, tiny_moe_model,
                         eval={"every": 1, "tasks": 2, "samples": 2, "env": "calculator"})
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"log_dir": tmp_path / "logs"})})
    lines: list[str] = []
    niceness: list[tuple[int, int, int]] = []
    with learner(tiny_moe_model, cfg.trainer) as e:
        loop = TrainLoop(cfg, e, log=lines.append)
        started = loop.evaluations.after_publish

        def noting_its_priority(version: int) -> None:
            started(version)
            if loop.evaluations.proc is not None and loop.evaluations.version == version:
                pid = loop.evaluations.proc.pid
                group = Path(f"/proc/{pid}/autogroup")  # its session's group (agent_rl/kernel/priority.py)
                niceness.append((os.getpriority(os.PRIO_PROCESS, pid), os.sched_getscheduler(pid),
                                 int(group.read_text().split()[-1]) if group.exists() else 19))

        loop.evaluations.after_publish = noting_its_priority  # type: ignore[method-assign]
        stats = loop.run(max_steps=2)
    print("\n".join(lines))
    assert stats.steps == 2 and loop.evaluations.started == [1]
    # Spare CPU only: niced and under SCHED_IDLE (trainer.eval.cpu_idle), its session group too.
    nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + cfg.trainer.eval.nice)
    assert niceness == [(nice, os.SCHED_IDLE, 19)]
    assert any("evaluating v1 in the background" in ln for ln in lines)
    assert any("evaluation of v2 skipped: v1's is still running" in ln for ln in lines)
    assert any("evaluation of v1 done" in ln for ln in lines), (
        lines, (tmp_path / "logs" / "evals.log").read_text()[-3000:])
    (evaluation,) = _ask(cfg, lambda s, r: s.evaluations(r))
    assert evaluation["version"] == 1 and evaluation["episodes"] == 4 and evaluation["failed"] == 0

    async def tokens() -> set[int]:
        async with await Store.open(cfg.store) as store:
            run = await store.run_id(evaluation["name"])
            seen: set[int] = set()
            for ep in await store.list_episodes(run_id=run):
                t = await store.episode_tokens(ep.id)
                seen |= set(t.versions[t.loss_mask == 1].tolist())
            return seen

    assert asyncio.run(tokens()) == {1}
    assert not (tmp_path / "exports" / "eval" / "v000001").exists()  # its weights, cleaned up
    # The trainer took its second step while the evaluation ran (it never waited for it).
    spans = _ask(cfg, lambda s, r: s.run_timeline(r)).spans
    eval_span = next(sp for sp in spans if sp.kind == "eval")
    second_step = [sp for sp in spans if sp.kind == "step"][1]
    assert second_step.finished_at < eval_span.finished_at


def test_one_evaluator_serves_every_evaluation_and_a_dead_one_is_replaced(
    store_copy: Path, tmp_path: Path, sglang_moe_server: Any, tiny_moe_model: Path,
    restore_engine: None,
) -> None:
    """The trainer's evaluator is one process for version after version (here on
    `eval.router_url`'s engine). SIGKILLed during an evaluation, that evaluation is reported
    failed with how it ended and its weights are removed; the next version due starts a new
    evaluator, which evaluates it. (Versions are published to `Evaluations` directly, with
    exports copied by hand: the trainer loop adds nothing to this.) Niced but not under
    SCHED_IDLE (`cpu_idle = false`), so it needs no idle core: the test above holds the
    evaluator's priority, and runs alone for it (cpu_exclusive)."""
    cfg = trainer_config(store_copy, tmp_path, sglang_moe_server.url, tiny_moe_model,
                         eval={"every": 1, "tasks": 2, "samples": 2, "env": "calculator",
                               "router_url": sglang_moe_server.url, "cpu_idle": False})
    logs = tmp_path / "logs"
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"log_dir": logs})})
    for version in (1, 2, 3):
        shutil.copytree(tiny_moe_model, tmp_path / "exports" / f"v{version:06d}")
    lines: list[str] = []
    evaluations = Evaluations(cfg, lines.append)

    def finish() -> None:
        deadline = time.monotonic() + 300
        while evaluations.version is not None and time.monotonic() < deadline:
            evaluations.poll()
            time.sleep(0.2)
        assert evaluations.version is None, (lines, (tmp_path / "logs" / "evals.log").read_text())

    evaluations.open()
    try:
        assert evaluations.proc is not None
        first = evaluations.proc.pid
        evaluations.after_publish(1)
        finish()
        evaluations.after_publish(2)
        assert evaluations.proc.pid == first and evaluations.version == 2
        os.kill(first, signal.SIGKILL)
        finish()
        assert evaluations.proc is None
        evaluations.after_publish(3)
        assert evaluations.proc is not None and evaluations.proc.pid != first
        finish()
    finally:
        evaluations.close()
    print("\n".join(lines))
    assert [(r["version"], r["ok"]) for r in evaluations.results] == [(1, True), (3, True)]
    assert "evaluation of v2 failed: the evaluator was killed by SIGKILL" in "\n".join(lines)
    assert list((tmp_path / "exports" / "eval").iterdir()) == []  # every version's weights gone
    scored = {e["version"]: e for e in _ask(cfg, lambda s, r: s.evaluations(r))}
    assert scored[1]["episodes"] == scored[3]["episodes"] == 4
    assert evaluations.proc is None  # closed: the evaluator exited
