"""Evaluation at a pinned policy version: `agent-rl eval`, `trainer.eval.every`, the quickstart.

`evaluate` scores the weights of one policy version of a training run: the engines serve them
under that version's label (so every stored token says which policy made it), and `samples`
episodes run on each of the first `tasks` tasks of the env's split through the ordinary serve
path (scheduler, episode runners, store) into a run of its own, of kind `eval`, that records
which run and version it evaluated and that no trainer consumes. Every request is sampled with
a seed derived from the evaluation seed, the task, the sample and the turn
(`rollout.seeded_sampling`), so a rerun of the same version with the same seed gives the same
tokens and the same per-task rewards. Episodes are sampled at the rollout temperature, so the
score is the policy's expected reward: the quantity RL optimises.

Engines: with a router URL, every engine behind it loads the weights (the quickstart's way,
between its stages); without one, the evaluation starts an engine of its own on them, so a
running `serve` and `train` carry on undisturbed (`trainer.eval.every`).

`evaluate_each` is the long-lived form `trainer.eval.every` runs (`agent-rl eval --from-stdin`):
one process, and without a router URL one engine, for every evaluation of a training run, each
version's weights loaded onto that engine in turn. Starting `agent-rl eval` costs seconds of CPU
(importing it: transformers' tokenizer classes import torch) and its engine more; paid once per
evaluation, that was most of what an evaluation took from a host that also trains.

`compare` is a one-sided paired test over tasks (per-task mean reward, Wilcoxon signed-rank).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from agent_rl.config import Config
from agent_rl.kernel.encoding import version_label
from agent_rl.kernel.errors import ConfigError
from agent_rl.store import Span, Store

DEFAULT_SEED = 1234


@dataclass
class Evaluation:
    label: str
    """What was evaluated (e.g. "base", "sft", "rl", or "v12")."""
    run: str
    """The store run holding its episodes."""
    weights: str
    version: int | None
    """The training run's policy version the engines served (0: the starting weights); None:
    weights that are no policy version of the run (the quickstart's model before SFT)."""
    task_rewards: list[float] = field(default_factory=list)
    """Mean reward per task, in task order."""
    episodes: int = 0
    failed: int = 0
    tool_use: float = 0.0
    """Fraction of episodes that went past their first turn (called a tool)."""
    seed: int = DEFAULT_SEED

    @property
    def mean(self) -> float:
        return sum(self.task_rewards) / len(self.task_rewards) if self.task_rewards else float("nan")

    @property
    def stderr(self) -> float:
        n = len(self.task_rewards)
        if n < 2:
            return float("nan")
        m = self.mean
        return math.sqrt(sum((r - m) ** 2 for r in self.task_rewards) / (n - 1) / n)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Evaluation:
        return cls(**d)


def compare(before: Evaluation, after: Evaluation) -> dict[str, float]:
    """One-sided Wilcoxon signed-rank test that `after` beats `before` task by task."""
    from scipy.stats import wilcoxon

    if len(before.task_rewards) != len(after.task_rewards):
        raise ValueError("evaluations over different task sets cannot be paired")
    diffs = [a - b for a, b in zip(after.task_rewards, before.task_rewards)]
    if not any(diffs):
        return {"gain": 0.0, "p_value": 1.0, "tasks": float(len(diffs))}
    p = float(wilcoxon(diffs, alternative="greater", zero_method="wilcox").pvalue)
    return {"gain": after.mean - before.mean, "p_value": p, "tasks": float(len(diffs))}


def export_path(cfg: Config, version: int) -> Path:
    """Where the trainer exports policy `version` (`trainer.export_dir/vNNNNNN`)."""
    return Path(cfg.trainer.export_dir) / f"v{version:06d}"


async def resolve_version(cfg: Config, of_run: str, version: int | str) -> tuple[int, int]:
    """(training run id, policy version) for `version` (an int or "latest")."""
    async with await Store.open(cfg.store, create=True) as store:
        run_id = await store.ensure_run(of_run)
        if version == "latest":
            return run_id, await store.latest_version(run_id)
        return run_id, int(version)


def weights_of(cfg: Config, version: int) -> Path:
    """The weights of policy `version`: its export, or for version 0 without one the model
    training started from (`trainer.model`, else `engine.model`)."""
    path = export_path(cfg, version)
    if (path / "config.json").is_file():
        return path
    start = cfg.trainer.model or cfg.engine.model
    if version == 0 and start is not None:
        return Path(start)
    raise ConfigError(f"no weights for policy version {version}: {path} has no export (the "
                      "trainer keeps its two newest; pass --weights DIR)")


async def evaluate(
    cfg: Config,
    *,
    version: int | None,
    weights: Path,
    tasks: int,
    samples: int,
    of_run: str | None = None,
    env: str | None = None,
    split: str = "eval",
    seed: int = DEFAULT_SEED,
    router_url: str | None = None,
    token: str | None = None,
    name: str | None = None,
    label: str | None = None,
) -> Evaluation:
    """Score `weights`, served as policy `version` of run `of_run` (default `run.name`), on
    `tasks` tasks x `samples` samples of `env`'s `split` into an evaluation run of its own
    (`name`, default `<run>-eval-v<version>`, made unique); see the module docstring."""
    from agent_rl.sglang.client import EngineClient
    from agent_rl.app.serve import serve

    of_run = of_run or cfg.run.name
    label = label or (f"v{version}" if version is not None else "model")
    started = time.time()
    async with await Store.open(cfg.store, create=True) as store:
        train_id = await store.ensure_run(of_run)
        base = name or f"{of_run}-eval-{label}"
        names = {r["name"] for r in await store.list_runs()}
        run, n = base, 1
        while run in names:  # an interrupted or earlier evaluation used it
            n += 1
            run = f"{base}-{n}"
        eval_cfg = _eval_config(cfg, run, env, split, seed, tasks, samples, weights, router_url)
        await store.ensure_run(run, eval_cfg.model_dump(mode="json"), kind="eval",
                               evaluates_run_id=train_id, evaluates_version=version)
    label_version = version_label(version if version is not None else 0)
    engine = None
    try:
        if router_url is None:
            from agent_rl.engine.launcher import EngineServer

            engine = EngineServer.from_config(cfg.engine, model=weights, port=0)
            await engine.astart()
            url, token = engine.url, None
        else:
            url = router_url
        # `url` is the router or, without one, the evaluation's own engine.
        async with EngineClient(url, token=token) as router_or_engine:
            await router_or_engine.update_weights_from_disk(weights, weight_version=label_version)
        eval_cfg = eval_cfg.model_copy(update={
            "rollout": eval_cfg.rollout.model_copy(update={"router_url": url})})
        await serve(eval_cfg, max_episodes=tasks * samples)
    finally:
        if engine is not None:
            engine.stop()
    result = await score(cfg, run, label=label, weights=weights, version=version, seed=seed)
    async with await Store.open(cfg.store) as store:
        await store.record_timings(train_id, [Span("eval", started, time.time(), run)])
    _tensorboard(cfg, result)
    return result


def evaluate_each(
    cfg: Config,
    requests: Iterable[str],
    reply: Callable[[dict[str, Any]], None],
    *,
    router_url: str | None = None,
    token: str | None = None,
    **options: Any,
) -> None:
    """Evaluate each request, one JSON object per line (`{"version": V, "weights": DIR}`),
    until `requests` ends; `reply` gets each one's result (`{"ok": true, "version": V, ...}`,
    the `Evaluation` with its mean and stderr) or error (`{"ok": false, "version": V, "error":
    ...}`). `options` are `evaluate`'s (tasks, samples, of_run, env, split, seed). Without a
    router URL the first request starts an engine that serves every later one (started again
    if it died); a request that fails leaves the next ones to run."""
    import anyio

    from agent_rl.engine.launcher import EngineServer

    log = logging.getLogger("agent_rl.app.evaluation")
    engine: EngineServer | None = None
    try:
        for line in requests:
            if not line.strip():
                continue
            try:
                version, weights = _request(line)
            except ValueError as e:
                reply({"ok": False, "version": None, "error": f"bad request {line.strip()!r}: {e}"})
                continue
            log.warning("evaluating v%s (%s)", version, weights)
            try:
                url, key = router_url, token
                if url is None:
                    if engine is not None and engine.returncode is not None:
                        log.warning("the evaluation engine exited (%s): starting another",
                                    engine.last_error())
                        engine.stop()
                        engine = None
                    if engine is None:
                        engine = EngineServer.from_config(cfg.engine, model=weights, port=0)
                        engine.start()
                    url, key = engine.url, None
                result = anyio.run(partial(evaluate, cfg, version=version, weights=weights,
                                           router_url=url, token=key, **options))
            except Exception as e:  # one failed evaluation; the next request still runs
                log.exception("evaluation of v%s failed", version)
                reply({"ok": False, "version": version, "error": f"{type(e).__name__}: {e}"})
                continue
            reply(dict(result.as_dict(), ok=True, mean=result.mean, stderr=result.stderr))
    finally:
        if engine is not None:
            engine.stop()


def _request(line: str) -> tuple[int | None, Path]:
    """(version, weights) of one `evaluate_each` request; ValueError saying what is wrong."""
    request = json.loads(line)  # a JSONDecodeError is a ValueError
    if not isinstance(request, dict):
        raise ValueError('not a JSON object {"version": V, "weights": DIR}')
    for key in ("version", "weights"):
        if key not in request:
            raise ValueError(f"it has no {key!r}")
    version = request["version"]
    if version is not None and not isinstance(version, int):
        raise ValueError(f"version must be an integer or null, not {version!r}")
    return version, Path(request["weights"])


def _eval_config(cfg: Config, run: str, env: str | None, split: str, seed: int, tasks: int,
                 samples: int, weights: Path, router_url: str | None) -> Config:
    rollout = cfg.rollout.model_copy(update={
        "env": env or cfg.rollout.env, "split": split, "seed": seed, "group_size": samples,
        "filter_zero_variance": False, "router_url": router_url, "seeded_sampling": True,
        # evaluation episodes are never trained: nothing to wait for
        "max_queued_groups": 0,
        "max_concurrent_episodes": max(cfg.rollout.max_concurrent_episodes, samples),
    })
    return cfg.model_copy(update={
        "run": cfg.run.model_copy(update={"name": run}),
        "rollout": rollout,
        "engine": cfg.engine.model_copy(update={"model": weights}),
        # An evaluation run has no policy versions of its own: never wait on staleness.
        "trainer": cfg.trainer.model_copy(update={"max_staleness": 1_000_000}),
    })


async def score(cfg: Config, run: str, *, label: str, weights: Path, version: int | None,
                seed: int = DEFAULT_SEED) -> Evaluation:
    """An evaluation run's result, read from the store."""
    async with await Store.open(cfg.store) as store:
        run_id = await store.run_id(run)
        episodes = await store.list_episodes(run_id=run_id, limit=1_000_000)
    by_task: dict[int, list[float]] = {}
    failed = tool_episodes = 0
    for e in episodes:
        if e.status == "failed":
            failed += 1
        # A failed episode scores 0: the policy did not earn a reward.
        by_task.setdefault(e.task_id, []).append(e.reward or 0.0)
        tool_episodes += e.num_turns > 1
    return Evaluation(
        label=label, run=run, weights=str(weights), version=version,
        task_rewards=[sum(r) / len(r) for _, r in sorted(by_task.items())],
        episodes=len(episodes), failed=failed,
        tool_use=tool_episodes / len(episodes) if episodes else 0.0, seed=seed,
    )  # fmt: skip


def _tensorboard(cfg: Config, e: Evaluation) -> None:
    """The evaluation's mean reward and standard error, at its policy version as the step."""
    if cfg.trainer.tensorboard_dir is None or e.version is None:
        return
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(cfg.trainer.tensorboard_dir))
    try:
        writer.add_scalar("eval/reward_mean", e.mean, e.version)
        if not math.isnan(e.stderr):
            writer.add_scalar("eval/reward_stderr", e.stderr, e.version)
        writer.add_scalar("eval/failed", e.failed, e.version)
    finally:
        writer.close()
