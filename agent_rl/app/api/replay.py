"""Replay: re-execute an episode's recorded assistant turns against a fresh environment.

A check of environment determinism and of the recorded data. The environment is made from the
registry with the run's `rollout.env_kwargs`, reset on the stored task (its `key` is the task
id, its `payload` the task data) with the episode's seed, in a fresh sandbox when it needs
one. Each recorded assistant message (its content is the raw completion text) goes through
`parse_completion` and `env.step` exactly as the episode runner did; the observations that come
back are compared, turn by turn, with the stored ones, and the replayed reward with the
recorded one. Nothing is written to the store.

What cannot be compared is said in `notes`, not guessed: a completion the runner cut at its
token limit was never stepped, so it is not stepped here either; an environment whose group
reward rewrote the episode's reward is flagged.
"""

from __future__ import annotations

import difflib
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from agent_rl.app.api.schemas import ObservationDiff, ReplayOut
from agent_rl.config import Config
from agent_rl.sdk.env import Env
from agent_rl.kernel.errors import EnvError, StoreError
from agent_rl.sdk.registry import make
from agent_rl.rollout.episode_env import episode_sandbox
from agent_rl.config.secrets import holds_mask
from agent_rl.rollout.recorded import split_transcript
from agent_rl.store import Store
from agent_rl.sdk.tasks import Task
from agent_rl.sdk.tool_calls import parse_completion

PoolGetter = Callable[[], Awaitable[Any]]
"""Returns the sandbox pool (a `SandboxSource`) to draw sandboxes from (made on first use)."""
# Reward details the runner writes when a completion hit max_new_tokens (never stepped).
_CUT = "max_new_tokens"


def env_kwargs_for(cfg: Config, run_config: dict[str, Any] | None, env_id: str) -> dict[str, Any]:
    """The keyword arguments the run made its environment with (its recorded config first; a
    value with a secret in it, recorded masked, comes from this process's config)."""
    recorded = (run_config or {}).get("rollout") or {}
    if recorded.get("env") == env_id:
        kwargs = dict(recorded.get("env_kwargs") or {})
        own = cfg.rollout.env_kwargs
        return {k: own.get(k, v) if holds_mask(v) else v for k, v in kwargs.items()}
    if cfg.rollout.env == env_id:
        return dict(cfg.rollout.env_kwargs)
    return {}


def _key(m: dict[str, Any]) -> tuple[str, str, str | None]:
    return m["role"], m.get("content") or "", m.get("name")


def _lines(messages: list[dict[str, Any]]) -> list[str]:
    out = []
    for m in messages:
        role, content, name = _key(m)
        out.append(f"--- {role}{f' ({name})' if name else ''}")
        out.extend(content.splitlines() or [""])
    return out


def compare(
    turn: int, recorded: list[dict[str, Any]], replayed: list[dict[str, Any]]
) -> ObservationDiff:
    equal = [_key(m) for m in recorded] == [_key(m) for m in replayed]
    diff = (
        ""
        if equal
        else "\n".join(
            difflib.unified_diff(
                _lines(recorded), _lines(replayed), "recorded", "replayed", lineterm=""
            )
        )
    )
    return ObservationDiff(
        turn=turn,
        recorded=[
            {"role": m["role"], "content": m.get("content") or "", "name": m.get("name")}
            for m in recorded
        ],
        replayed=[dict(m) for m in replayed],
        equal=equal,
        diff=diff,
    )


async def replay_episode(
    store: Store, cfg: Config, episode_id: int, *, sandboxes: PoolGetter | None = None
) -> ReplayOut:
    """Replay one finished episode; `sandboxes()` gives the sandbox pool that sandbox
    environments get a fresh sandbox from."""
    detail = await store.get_episode(episode_id)
    ep = detail.episode
    if ep.status in ("waiting", "running"):
        raise StoreError(f"episode {episode_id} is {ep.status}: replay it once it has finished")
    task_row = await store.get_task(ep.task_id)
    run = await store.get_run(ep.run_id)
    env = make(ep.env_id, **env_kwargs_for(cfg, run.get("config"), ep.env_id))
    initial, turns = split_transcript(detail.messages)
    if env.needs_sandbox and sandboxes is None:
        raise EnvError(f"{ep.env_id} needs a sandbox and this API has no sandbox backend")
    with anyio.fail_after(cfg.api.replay_timeout_s):
        pool = await sandboxes() if env.needs_sandbox and sandboxes is not None else None
        async with episode_sandbox(env, pool) as sandbox:
            return await _replay(
                env, ep, Task(id=task_row["key"], data=task_row["payload"]), initial, turns, sandbox
            )


async def _replay(
    env: Env,
    ep: Any,
    task: Task,
    initial: list[dict[str, Any]],
    turns: list[tuple[dict[str, Any], list[dict[str, Any]]]],
    sandbox: Any,
) -> ReplayOut:
    notes: list[str] = []
    first = await env.reset(task, ep.seed, sandbox=sandbox)
    diffs = [compare(-1, initial, list(first.messages))]
    reward, terminated, truncated, ended, broken = 0.0, False, False, False, False
    cut = (ep.reward_details or {}).get("truncated") == _CUT
    for k, (assistant, recorded) in enumerate(turns):
        if ended:
            notes.append(f"turn {k} was recorded but the replayed episode had already ended")
            diffs.append(compare(k, recorded, []))
            broken = True
            break
        if cut and k == len(turns) - 1:
            notes.append(f"turn {k} was cut at max_new_tokens by the runner and never stepped")
            break
        try:
            result = await env.step(
                parse_completion(assistant.get("content") or "", id_prefix=f"call_{k}_")
            )
        except EnvError as e:
            notes.append(f"turn {k}: the environment raised: {e}")
            diffs.append(compare(k, recorded, []))
            ended = broken = True
            break
        diffs.append(compare(k, recorded, list(result.observations)))
        reward += result.reward
        terminated, truncated = result.terminated, result.truncated
        ended = terminated or truncated
    if env.has_group_reward():
        notes.append(f"{ep.env_id} rewrites rewards per group: the recorded reward may differ")
    if not ended and not cut and ep.error_type is None:
        notes.append("the replayed episode had not ended after the recorded turns")
    replayed = None if broken else reward
    reward_equal = ep.reward is not None and replayed is not None and float(ep.reward) == replayed
    if ep.reward is None:
        notes.append(f"the episode is {ep.status} without a reward: only observations compare")
    reproduced = not broken and all(d.equal for d in diffs) and (reward_equal or ep.reward is None)
    return ReplayOut(
        episode_id=ep.id,
        env_id=ep.env_id,
        reproduced=reproduced,
        recorded_reward=ep.reward,
        replayed_reward=replayed,
        reward_equal=reward_equal,
        terminated=terminated,
        truncated=truncated,
        turns=diffs,
        notes=notes,
    )
