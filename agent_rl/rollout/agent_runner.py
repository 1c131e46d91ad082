"""The agent episode runner: an `AgentEnv`'s program run to exactly one recorded end.

It is the episode runner with the loop replaced by the agent: the start, the deadline, the
mapping of every exit to one terminal state and the shielded write of that state are
`EpisodeRunner.run`'s. The agent gets its own gateway session (base URL and key), runs (a
coroutine, or a command as a subprocess with `OPENAI_BASE_URL`/`OPENAI_API_KEY`), and the
gateway records each of its model calls as a turn while it does. Then:

- the agent returned and a budget was spent (turns, tokens) -> completed, reward 0,
  `truncated: <limit>`; the deadline passed -> the same with `deadline` (the agent is cancelled,
  a command killed);
- the agent returned -> `score(task, result, transcript)` -> completed with the reward;
- the agent raised, or the command exited non-zero -> failed (EnvError) with the traceback or
  the command's stderr; an engine failure behind one of its calls -> failed (EngineError);
- the agent returned without calling the model -> failed: there is nothing to train on.
"""

from __future__ import annotations

import json
import os
from typing import Any

import anyio

from agent_rl.agent import TASK_ENV_VAR, AgentEnv
from agent_rl.errors import EngineError, EnvError
from agent_rl.registry import make
from agent_rl.rewards import as_reward
from agent_rl.rollout.episode_env import episode_sandbox
from agent_rl.rollout.gateway import AgentSession, Gateway
from agent_rl.rollout.runner import EpisodeRunner, RunnerContext, _truncated
from agent_rl.store import EpisodeEnd
from agent_rl.tasks import Task

STDERR_KEPT = 8_000
"""Characters of a failed command's stderr kept as the episode's cause (its end)."""


class AgentRunner(EpisodeRunner):
    """Runs one agent episode (see the module docstring)."""

    def __init__(self, ctx: RunnerContext, gateway: Gateway, episode_id: int, env_id: str,
                 task: Task, seed: int | None, env_kwargs: dict[str, Any] | None = None) -> None:  # fmt: skip
        super().__init__(ctx, episode_id, env_id, task, seed, env_kwargs)
        self.gateway = gateway

    async def _run(self) -> EpisodeEnd:
        env = make(self.env_id, **self.env_kwargs)
        if not isinstance(env, AgentEnv):
            raise EnvError(f"{self.env_id} is not an agent environment (AgentEnv)")
        async with episode_sandbox(env, self.ctx.sandbox_backend) as sandbox:
            env.task, env.seed, env.sandbox = self.task, self.seed, sandbox
            session = self.gateway.open(self)
            try:
                return await self._episode(env, session)
            finally:
                await session.close()
                self.gateway.forget(session)

    async def _episode(self, env: AgentEnv, session: AgentSession) -> EpisodeEnd:
        try:
            result = await self._agent(env, session)
        except Exception as e:
            if session.truncated is not None:  # refused for its budget, then gave up
                return self._truncated(session)
            if session.engine_error is not None:
                raise EngineError(f"agent call failed in the engine: {session.engine_error}") from e
            raise
        await session.close()
        if session.truncated is not None:
            return self._truncated(session)
        if session.calls == 0:
            raise EnvError(f"{self.env_id}: the agent returned without calling the model at "
                           f"{session.base_url}: there is nothing to train on")
        reward = as_reward(await env.score(self.task, result, session.transcript()))
        details = {"reward": reward.model_dump(mode="json"), **_counts(session)}
        return EpisodeEnd("completed", reward=reward.value, reward_details=details)

    def _truncated(self, session: AgentSession) -> EpisodeEnd:
        end = _truncated(session.truncated or "env")
        end.reward_details = {**(end.reward_details or {}), **_counts(session)}
        return end

    async def _agent(self, env: AgentEnv, session: AgentSession) -> Any:
        if env.command is None:
            return await env.run(session.base_url, session.key, self.task)
        environ = {**os.environ, **env.command_env, "OPENAI_BASE_URL": session.base_url,
                   "OPENAI_API_KEY": session.key, TASK_ENV_VAR: env.task_json(self.task)}  # fmt: skip
        done = await anyio.run_process(list(env.command), input=env.task_json(self.task).encode(),
                                       env=environ, check=False)  # fmt: skip
        if done.returncode != 0:
            stderr = done.stderr.decode(errors="replace")[-STDERR_KEPT:]
            raise EnvError(f"{self.env_id}: the agent command {json.dumps(list(env.command))} "
                           f"exited with status {done.returncode}; its stderr:\n{stderr}")
        return done.stdout.decode(errors="replace").strip()


def _counts(session: AgentSession) -> dict[str, int]:
    return {"agent_calls": session.calls, "segments": session.segments,
            "rewrites": session.rewrites}  # fmt: skip

