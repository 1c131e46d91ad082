"""`AgentEnv`: an environment whose episode is an agent program that talks to the policy through
an OpenAI-compatible endpoint.

Bring your own agent: anything written against the `openai` client (or a framework on top of
it, or a program that reads `OPENAI_BASE_URL`) becomes a source of training episodes. `serve`
gives every episode its own endpoint, `{gateway}/agents/{key}/v1`, whose API key is `key`; the
gateway renders each request with the model's chat template, generates token-in/token-out
through the router and records every call as a turn with the engine's exact tokens. The agent
never sees tokens, and the trainer never sees text.

Two forms, both subclasses registered and made like every env:

    class MyAgent(AgentEnv):                      # 1. an async function
        async def run(self, base_url, api_key, task):
            async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
                ...                               # any number of chat.completions calls
            return answer                         # the result `score` judges

    class MyCli(AgentEnv):                        # 2. a command, run as a subprocess
        command = ["python", "-m", "my_agent"]    # with OPENAI_BASE_URL / OPENAI_API_KEY set,
                                                  # the task's JSON on stdin (and in
                                                  # AGENT_RL_TASK); its stdout is the result
        command_in_sandbox = True                 # optional: run it in the episode's sandbox,
                                                  # the gateway its only way out

    async def score(self, task, result, transcript) -> Reward | float: ...

`transcript` is the conversation of the episode's last model call, its answer included, in
OpenAI's message shape. An agent that raises, or a command that exits non-zero, fails the
episode with its traceback or stderr (never a reward); the gateway's budgets (turns, tokens,
deadline) end it as a truncation (reward 0), exactly as for an SDK env.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from agent_rl.sdk.env import Env, _guard
from agent_rl.kernel.errors import EnvError
from agent_rl.sdk.messages import AssistantTurn
from agent_rl.sdk.rewards import Reward
from agent_rl.sdk.tasks import Task

TASK_ENV_VAR = "AGENT_RL_TASK"
"""The task as JSON (`{"id": ..., "data": {...}}`), for a command that prefers it to stdin."""


class AgentEnv(Env):
    """Base class of agent environments (see the module docstring)."""

    command: ClassVar[Sequence[str] | None] = None
    """The agent as a command line (the subprocess form); None: `run` is the agent."""
    command_env: ClassVar[Mapping[str, str]] = {}
    """Extra environment variables for the command (on the host the parent's environment is
    inherited; in the sandbox nothing of the host's is)."""
    command_in_sandbox: ClassVar[bool] = False
    """Run the command inside the episode's sandbox (`sandbox_spec`, with loopback sockets and
    the gateway's relay socket added) instead of on the host: it reaches the gateway through
    that socket and nothing else (no network). Its programs must be in the sandbox: the host's
    /usr is there read-only under bubblewrap; mount a virtual environment (`sandbox_spec.mounts`)
    or use an image with what it imports."""
    resumable: ClassVar[bool] = False
    """An agent program cannot be resumed: an episode whose serve died fails as interrupted."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "run" in cls.__dict__:
            cls.run = _guard("run", cls.__dict__["run"])  # type: ignore[method-assign]

    @property
    def needs_sandbox(self) -> bool:
        return super().needs_sandbox or (self.command is not None and self.command_in_sandbox)

    async def run(self, base_url: str, api_key: str, task: Task) -> Any:
        """The agent (function form): talk to `base_url` (an OpenAI `/v1` base) with `api_key`
        and return the result `score` judges. Subclasses without `command` implement it."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement run(base_url, api_key, task) or set command"
        )

    async def score(self, task: Task, result: Any, transcript: list[dict[str, Any]]) -> Reward | float:  # type: ignore[override]
        """Reward of the agent's `result` on `task` (a rule, or a verifier in `self.sandbox`);
        `transcript` is the last model call's conversation with its answer."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement score(task, result, transcript)"
        )

    def demonstrations_from(self) -> tuple[str, dict[str, Any]] | None:
        """The SDK env (its id and kwargs) whose teacher's demonstrations are what this agent
        shows the model, token for token (its prompts, calls and tool messages): `agent-rl
        train --sft` on this env trains on them. None (the default): an agent program has no
        teacher, and `train --sft` refuses it in one line."""
        return None

    @classmethod
    def task_json(cls, task: Task) -> str:
        """The task as the command form receives it."""
        return json.dumps({"id": task.id, "data": task.data}, ensure_ascii=False)

    async def step(self, turn: AssistantTurn) -> Any:  # noqa: D102 - the agent drives itself
        raise EnvError(f"{self.env_id} is an agent environment: its agent drives the episode "
                       "through the gateway, there is no step")
