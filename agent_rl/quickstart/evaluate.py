"""Evaluation at a pinned policy: the same fixed tasks, sampled the same way, for every checkpoint.

`evaluate` loads one set of weights on every engine behind the router (labelled with a weight
version, so every generated token says which policy made it), then runs `samples` episodes on
each of the first `tasks` tasks of the env's `eval` split through the ordinary serve path (the
scheduler, episode runners and store: evaluation episodes are stored and can be inspected in the
viewer) under a run of their own, which no trainer consumes. Episodes are sampled at the rollout
temperature, so the score is the policy's expected reward: the quantity RL optimises.

`compare` is a one-sided paired test over tasks (per-task mean reward, Wilcoxon signed-rank),
the margin the quickstart's claim "RL improved on SFT" has to clear.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent_rl.config import Config
from agent_rl.store import Store

EVAL_SPLIT = "eval"
EVAL_SEED = 1234


@dataclass
class Evaluation:
    label: str
    """What was evaluated: "base", "sft", "rl"."""
    run: str
    """The store run holding its episodes."""
    weights: str
    version: int | None
    """The RL run's policy version the engines served (0 is the SFT warm start); None: the
    model before SFT."""
    task_rewards: list[float] = field(default_factory=list)
    """Mean reward per task, in task order."""
    episodes: int = 0
    failed: int = 0
    tool_use: float = 0.0
    """Fraction of episodes that went past their first turn (called a tool)."""

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


async def evaluate(
    cfg: Config,
    router_url: str,
    *,
    label: str,
    weights: Path,
    version: int | None,
    tasks: int,
    samples: int,
    token: str | None,
) -> Evaluation:
    """Serve `weights` (as weight version `version`) and score it on the fixed evaluation tasks."""
    from agent_rl.engine.client import EngineClient
    from agent_rl.serve import serve

    async with EngineClient(router_url, token=token) as engines:
        await engines.update_weights_from_disk(weights, weight_version=str(version or 0))
    run = await _fresh_run_name(cfg, f"{cfg.run.name}-eval-{label}")
    eval_cfg = cfg.model_copy(
        update={
            "run": cfg.run.model_copy(update={"name": run}),
            "rollout": cfg.rollout.model_copy(update={
                "split": EVAL_SPLIT, "seed": EVAL_SEED, "group_size": samples,
                "filter_zero_variance": False, "router_url": router_url,
                # evaluation episodes are never trained: nothing to wait for
                "max_queued_groups": 0,
            }),
            # The eval run has no policy versions of its own: never wait on staleness.
            "trainer": cfg.trainer.model_copy(update={"max_staleness": 1_000_000}),
        }
    )
    await serve(eval_cfg, max_episodes=tasks * samples)
    return await _score(cfg, run, label=label, weights=weights, version=version)


async def _fresh_run_name(cfg: Config, base: str) -> str:
    """`base`, or `base-2`, `-3`... if an interrupted earlier attempt already used it."""
    async with await Store.open(cfg.store) as store:
        names = {r["name"] for r in await store.list_runs()}
    name, n = base, 1
    while name in names:
        n += 1
        name = f"{base}-{n}"
    return name


async def _score(
    cfg: Config, run: str, *, label: str, weights: Path, version: int | None
) -> Evaluation:
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
        tool_use=tool_episodes / len(episodes) if episodes else 0.0,
    )  # fmt: skip
