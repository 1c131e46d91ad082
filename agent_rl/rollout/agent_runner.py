"""The agent episode runner: an `AgentEnv`'s program run to exactly one recorded end.

It is the episode runner with the loop replaced by the agent: the start, the deadline, the
mapping of every exit to one terminal state and the shielded write of that state are
`EpisodeRunner.run`'s. The agent gets its own gateway session (base URL and key), runs (a
coroutine, or a command as a subprocess with `OPENAI_BASE_URL`/`OPENAI_API_KEY`, on the host or
in the episode's sandbox through the gateway's relay socket), and the
gateway records each of its model calls as a turn while it does. Then:

- the agent returned and a budget was spent (turns, tokens) -> completed, reward 0,
  `truncated: <limit>`; the deadline passed -> the same with `deadline` (the agent is cancelled,
  a command killed);
- the agent returned -> `score(task, result, transcript)` -> completed with the reward;
- the agent raised, or the command exited non-zero -> failed (EnvError) with the traceback or
  the command's stderr; an engine failure behind one of its calls -> failed (EngineError);
- no call of the agent was kept (it returned without calling the model, or its first call was
  refused for a budget) -> failed: there is nothing to train on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack, suppress
from typing import Any

import anyio

from agent_rl.sdk.agent import TASK_ENV_VAR, AgentEnv
from agent_rl.kernel.errors import EngineError, EnvError
from agent_rl.sdk.registry import make
from agent_rl.sdk.rewards import as_reward
from agent_rl.rollout.episode_env import episode_sandbox
from agent_rl.rollout.gateway import AgentSession, Gateway
from agent_rl.rollout.gateway_relay import SOCKET_DIR, UnixRelay, sandbox_runner
from agent_rl.rollout.runner import EpisodeResult, EpisodeRunner, RunnerContext, _truncated
from agent_rl.sdk.sandbox import Mount, SandboxSpec
from agent_rl.store import EpisodeEnd, TurnRecord
from agent_rl.sdk.tasks import Task

STDERR_KEPT = 8_000
"""Characters of a failed command's stderr kept as the episode's cause (its end)."""


class AgentRunner(EpisodeRunner):
    """Runs one agent episode (see the module docstring)."""

    def __init__(self, ctx: RunnerContext, gateway: Gateway, episode_id: int, env_id: str,
                 task: Task, seed: int | None, env_kwargs: dict[str, Any] | None = None) -> None:  # fmt: skip
        super().__init__(ctx, episode_id, env_id, task, seed, env_kwargs)
        self.gateway = gateway
        self._held: list[TurnRecord] = []
        """The kept calls' turns the closed session had not written: written with the end."""

    async def _run(self) -> EpisodeEnd:
        env = make(self.env_id, **self.env_kwargs)
        if not isinstance(env, AgentEnv):
            raise EnvError(f"{self.env_id} is not an agent environment (AgentEnv)")
        async with AsyncExitStack() as stack:
            relay = None
            if env.command is not None and env.command_in_sandbox:
                # The episode's own way out of its sandbox: a socket piped to the gateway.
                relay = await UnixRelay(self.gateway.base_url).start()
                stack.push_async_callback(_shielded(relay.close))
            sandbox = await stack.enter_async_context(
                episode_sandbox(env, self.ctx.sandboxes, self._spec(env, relay)))
            if relay is not None:
                sandbox.own(str(relay.path))
            env.task, env.seed, env.sandbox = self.task, self.seed, sandbox
            # The start is written before the agent runs: its calls write turns at once.
            start, self._next_write = self._next_write, None
            if start is not None:
                await start()
            session = self.gateway.open(self)
            try:
                return await self._episode(env, session)
            finally:
                await self._close(session)
                self.gateway.forget(session)

    async def _close(self, session: AgentSession) -> None:
        """No call of the agent is kept from now on; its turns not written yet wait for the end."""
        self._held += await session.close()

    async def _end(self, end: EpisodeEnd) -> EpisodeResult:
        """The kept calls' turns the session held land with the episode's terminal state, in
        one transaction (`AgentSession`: no commit of their own)."""
        held, self._held = self._held, []
        if held and end.turn is None:
            *held, end.turn = held
        end.unwritten = [*held, *end.unwritten]
        return await super()._end(end)

    @staticmethod
    def _spec(env: AgentEnv, relay: UnixRelay | None) -> SandboxSpec | None:
        """For a command run in the sandbox: the env's spec with loopback sockets and the
        episode's relay directory (read-only) added."""
        if relay is None:
            return None
        spec = env.sandbox_spec or SandboxSpec()
        mount = Mount(source=str(relay.dir), target=SOCKET_DIR)
        return spec.model_copy(update={"loopback": True, "mounts": (*spec.mounts, mount)})

    async def _episode(self, env: AgentEnv, session: AgentSession) -> EpisodeEnd:
        try:
            result = await self._agent(env, session)
        except Exception as e:
            if session.truncated is not None and session.calls:  # refused for its budget, then gave up
                return self._truncated(session)
            if session.engine_error is not None:
                raise EngineError(f"agent call failed in the engine: {session.engine_error}") from e
            if session.truncated is not None:
                raise self._nothing(session) from e
            raise
        await self._close(session)
        if session.calls == 0:
            raise self._nothing(session)
        if session.truncated is not None:
            return self._truncated(session)
        reward = as_reward(await env.score(self.task, result, session.transcript()))
        details = {"reward": reward.model_dump(mode="json"), **_counts(session)}
        return EpisodeEnd("completed", reward=reward.value, reward_details=details)

    def _nothing(self, session: AgentSession) -> EnvError:
        """No call was kept: there is nothing to train on (a first call refused for its budget
        included: a prompt over `rollout.max_tokens` has no turn to train)."""
        why = (f"its first call was refused ({session.truncated} budget spent)" if session.truncated
               else f"the agent returned without calling the model at {session.base_url}")  # fmt: skip
        return EnvError(f"{self.env_id}: {why}: there is nothing to train on")

    def _truncated(self, session: AgentSession) -> EpisodeEnd:
        end = _truncated(session.truncated or "env")
        end.reward_details = {**(end.reward_details or {}), **_counts(session)}
        return end

    async def _agent(self, env: AgentEnv, session: AgentSession) -> Any:
        if env.command is None:
            return await env.run(session.base_url, session.key, self.task)
        if env.command_in_sandbox:
            return await self._sandboxed(env, session)
        environ = {**os.environ, **env.command_env, "OPENAI_BASE_URL": session.base_url,
                   "OPENAI_API_KEY": session.key, "ANTHROPIC_BASE_URL": session.base_url.removesuffix("/v1"),
                   "ANTHROPIC_API_KEY": session.key, TASK_ENV_VAR: env.task_json(self.task)}  # fmt: skip
        status, stdout, stderr = await run_command(list(env.command),
                                                   env.task_json(self.task).encode(), environ)
        if status != 0:
            tail = stderr.decode(errors="replace")[-STDERR_KEPT:]
            raise EnvError(f"{self.env_id}: the agent command {json.dumps(list(env.command))} "
                           f"exited with status {status}; its stderr:\n{tail}")
        return stdout.decode(errors="replace").strip()

    async def _sandboxed(self, env: AgentEnv, session: AgentSession) -> Any:
        """The command in the episode's sandbox, through the relay (`gateway_relay`)."""
        assert env.command is not None and env.sandbox is not None
        code = sandbox_runner(env.command, session.key,
                              {**env.command_env, TASK_ENV_VAR: env.task_json(self.task)})
        done = await env.sandbox.run_python(code, stdin=env.task_json(self.task))
        command = json.dumps(list(env.command))
        if done.timed_out:
            raise EnvError(f"{self.env_id}: the agent command {command} ran past its sandbox's "
                           f"wall_s limit ({env.sandbox.spec.limits.wall_s} s) and was killed")
        if not done.ok:
            why = ("wrote more than the sandbox's output limit" if done.truncated else
                   "ran out of memory" if done.oom_killed else f"exited with status {done.exit_code}")
            raise EnvError(f"{self.env_id}: the agent command {command} in its sandbox {why}; "
                           f"its stderr:\n{done.stderr[-STDERR_KEPT:]}")
        return done.stdout.strip()


async def run_command(
    command: list[str], stdin: bytes, environ: dict[str, str]
) -> tuple[int, bytes, bytes]:
    """`command` run to its end with `stdin` as its input: its exit status, stdout and stderr.
    A command may exit, or close its stdin, without reading all of its input: that is no error
    here (its exit status says how it went). anyio's `run_process` raised the broken pipe of
    such a command, wrapped in an ExceptionGroup, whenever it exited before its input was
    written, and the episode was recorded with that in place of the command's own failure."""
    out = [b"", b""]

    async def drain(stream: Any, index: int) -> None:
        chunks = [chunk async for chunk in stream]
        out[index] = b"".join(chunks)

    async with await anyio.open_process(command, env=environ) as process:
        async with anyio.create_task_group() as tg:
            tg.start_soon(drain, process.stdout, 0)
            tg.start_soon(drain, process.stderr, 1)
            assert process.stdin is not None
            # It may exit, or close its stdin, before reading all of it.
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                await process.stdin.send(stdin)
            with anyio.CancelScope(shield=True), suppress(OSError):
                await process.stdin.aclose()
            status = await process.wait()
    return status, out[0], out[1]


def _shielded(close: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        with anyio.CancelScope(shield=True):
            await close()
    return run


def _counts(session: AgentSession) -> dict[str, int]:
    return {"agent_calls": session.calls, "segments": session.segments,
            "rewrites": session.rewrites}  # fmt: skip

