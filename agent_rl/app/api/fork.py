"""Fork: regenerate an episode from turn k with the current policy, as a new linked episode.

The fork is a real episode run by the episode runner (`agent_rl.rollout.runner`), on the
parent's task and seed, in a fresh environment (and sandbox). Its first k generations are not
sampled: the runner answers them (its `prefix`) with the parent's recorded completions, the exact token ids
with their logprobs, policy versions and routed experts, so the runner steps the environment
through the same states and persists the same spans it persisted for the parent. From turn k
on it generates through the engine with the policy served now.

The fork is admitted as a group of one with `parent_episode_id` set, in one transaction, and
its group is then filtered with a reason: forks are for inspection, never trained.
"""

from __future__ import annotations

import os
import time
from typing import Any

import anyio
from pydantic import ValidationError

from agent_rl.app.api.replay import env_kwargs_for
from agent_rl.app.api.schemas import ForkOut
from agent_rl.config import Config, RolloutConfig
from agent_rl.kernel.errors import EngineError, EnvError
from agent_rl.rollout.recorded import recorded_turns
from agent_rl.rollout.runner import EpisodeRunner, RunnerContext
from agent_rl.store import Store
from agent_rl.sdk.tasks import Task


async def fork_episode(
    store: Store, cfg: Config, ctx: RunnerContext, episode_id: int, turn: int
) -> ForkOut:
    """Run a fork of `episode_id` from `turn` (0 <= turn < its number of turns)."""
    detail = await store.get_episode(episode_id)
    parent = detail.episode
    if not 0 <= turn < parent.num_turns:
        raise EnvError(
            f"episode {episode_id} has {parent.num_turns} turns: fork from a turn in 0..{parent.num_turns - 1}"
        )
    prefix = await recorded_turns(store, episode_id, upto=turn)
    task_row = await store.get_task(parent.task_id)
    run = await store.get_run(parent.run_id)
    group_id, (fork_id,) = await store.admit_group(
        parent.run_id, parent.task_id, parent.env_id, 1, [parent.seed],
        parent_episode_id=parent.id,
    )
    runner = EpisodeRunner(
        ctx, fork_id, parent.env_id, Task(id=task_row["key"], data=task_row["payload"]),
        parent.seed, env_kwargs_for(cfg, run.get("config"), parent.env_id), prefix=prefix,
    )
    with anyio.fail_after(cfg.api.replay_timeout_s):
        result = await runner.run()
    await store.complete_group(
        group_id,
        filter_reason=f"fork of episode {episode_id} from turn {turn}: for inspection, not training",
    )
    forked = (await store.get_episode(fork_id)).episode
    return ForkOut(
        episode_id=fork_id,
        parent_episode_id=episode_id,
        from_turn=turn,
        status=forked.status,
        reward=result.reward if result.status == "completed" else None,
    )


async def api_runner_context(
    store: Store, cfg: Config, run_config: dict[str, Any] | None, run_name: str
) -> RunnerContext:
    """A runner context for an API process that has none from `serve`: the engine (or router)
    at `rollout.router_url`, the run's model for its chat template and tokenizer, and the run's
    recorded rollout settings (turn and token limits, sampling) where they still validate."""
    from agent_rl.sglang.client import EngineClient
    from agent_rl.rollout.render import ChatRenderer

    if not cfg.rollout.router_url:
        raise EngineError(
            "fork needs an engine: set rollout.router_url (AGENT_RL_ROLLOUT__ROUTER_URL) for "
            "`agent-rl api`, or use the API that `agent-rl serve` mounts"
        )
    engine = (run_config or {}).get("engine") or {}
    model = engine.get("model") or cfg.engine.model
    if not model:
        raise EngineError("fork needs the run's model (engine.model) for its chat template")
    renderer = await anyio.to_thread.run_sync(ChatRenderer, model)
    rollout = cfg.rollout
    recorded = (run_config or {}).get("rollout")
    if recorded:
        try:
            rollout = RolloutConfig.model_validate(
                {**recorded, "router_url": cfg.rollout.router_url}
            )
        except ValidationError:
            pass  # recorded by another version of agent-rl: this process's settings apply
    return RunnerContext(
        store=store,
        client=EngineClient(cfg.rollout.router_url),
        renderer=renderer,
        cfg=rollout,
        owner=f"api-{os.uname().nodename}-{os.getpid()}-{int(time.time())}",
        run_name=run_name,
        routed_experts=bool(engine.get("moe_routing_replay", cfg.engine.moe_routing_replay)),
    )
