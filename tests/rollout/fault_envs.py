"""Environments that fail (or never end) on purpose, to show each ending is recorded where it
belongs.

They run with the real engine: the model's (random) text is what they receive. `ToolRaisesEnv`
and `RawJsonCallEnv` decide how a completion becomes a tool call themselves, because a random
model cannot be asked to call a tool; everything after that is the real runner path.
"""

from __future__ import annotations

import random

import anyio

from agent_rl import Env, StepResult, tool
from agent_rl.kernel.errors import SandboxError
from agent_rl.sdk.messages import AssistantTurn, Message, ToolCall, user
from agent_rl.sdk.registry import register
from agent_rl.sdk.tasks import ListTasks, Task, TaskSource
from agent_rl.sdk.tool_calls import parse_completion


class _Base(Env):
    def builtin_tasks(self, split: str = "train") -> TaskSource:
        return ListTasks([Task(id=f"t{i}", data={"q": f"question {i}"}) for i in range(4)])

    def initial_messages(self, task: Task) -> list[Message]:
        return [user(task["q"])]

    async def score(self, answer: str) -> float:
        return 0.0


class StepRaisesEnv(_Base):
    """User code with a bug: `step` raises."""

    async def step(self, turn: AssistantTurn):  # type: ignore[no-untyped-def]
        raise ValueError("a bug in the environment's step")


@tool
def boom(reason: str = "") -> str:
    """A tool whose implementation raises.

    Args:
        reason: Ignored.
    """
    raise RuntimeError("the tool's implementation crashed")


class ToolRaisesEnv(_Base):
    """Every completion is a call of `boom`, which raises; two turns, then truncated."""

    tools = (boom,)

    def __init__(self, **kwargs: object) -> None:
        super().__init__(max_turns=2, **kwargs)  # type: ignore[arg-type]

    async def step(self, turn: AssistantTurn):  # type: ignore[no-untyped-def]
        call = ToolCall(id=f"call_{self.turns}", name="boom", arguments={"reason": "x"})
        return await super().step(AssistantTurn(text=turn.text, content="", calls=[call]))


class RawJsonCallEnv(_Base):
    """The model answers with a bare JSON tool call; random text makes it malformed."""

    tools = (boom,)

    def __init__(self, **kwargs: object) -> None:
        super().__init__(max_turns=2, **kwargs)  # type: ignore[arg-type]

    async def step(self, turn: AssistantTurn):  # type: ignore[no-untyped-def]
        wrapped = parse_completion(f"<tool_call>{turn.text}</tool_call>", id_prefix=f"c{self.turns}_")
        return await super().step(wrapped)


class NeverEndsEnv(_Base):
    """Answers every turn and never terminates or truncates by itself: only the runner's own
    budgets (max_turns, max_tokens, max_new_tokens, the deadline) can end its episodes.
    `delay`: seconds each step takes (so a test can kill a serve in the middle of episodes)."""

    def __init__(self, *, delay: float = 0.0, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.delay = delay

    async def step(self, turn: AssistantTurn) -> StepResult:
        await anyio.sleep(self.delay)
        self.turns += 1
        return StepResult(observations=[user(f"go on ({self.turns}, {len(turn.text)})")])


class OptsOutEnv(NeverEndsEnv):
    """Says its episodes cannot be resumed after a crash."""

    resumable = False


class ForgetfulEnv(NeverEndsEnv):
    """Its observations depend on the process that runs it: a resume cannot reproduce them."""

    async def step(self, turn: AssistantTurn) -> StepResult:
        result = await super().step(turn)
        return StepResult(observations=[user(f"{result.observations[0]['content']} {id(self)}")])


@tool
async def nap(seconds: float = 30.0) -> str:
    """Sleep, like a tool that hangs.

    Args:
        seconds: How long.
    """
    await anyio.sleep(seconds)
    return "rested"


class HangingToolEnv(_Base):
    """Every completion is a call of `nap`: the episode can only end by its deadline."""

    tools = (nap,)

    async def step(self, turn: AssistantTurn):  # type: ignore[no-untyped-def]
        call = ToolCall(id=f"call_{self.turns}", name="nap", arguments={"seconds": 30.0})
        return await super().step(AssistantTurn(text=turn.text, content="", calls=[call]))


class SandboxDiesEnv(_Base):
    """The sandbox infrastructure fails under the episode (raised as SandboxError)."""

    async def step(self, turn: AssistantTurn):  # type: ignore[no-untyped-def]
        raise SandboxError("sandbox sb-test died: killed by the host")


class PromptTooLongEnv(_Base):
    """A prompt longer than the model's context: the engine refuses it (an EngineError)."""

    def initial_messages(self, task: Task) -> list[Message]:
        rng = random.Random(task.id)
        return [user(" ".join(f"w{rng.randrange(10**6)}" for _ in range(6000)))]


def register_fault_envs() -> None:
    register("test-step-raises", StepRaisesEnv)
    register("test-tool-raises", ToolRaisesEnv)
    register("test-raw-json-call", RawJsonCallEnv)
    register("test-never-ends", NeverEndsEnv)
    register("test-opts-out", OptsOutEnv)
    register("test-forgetful", ForgetfulEnv)
    register("test-hanging-tool", HangingToolEnv)
    register("test-sandbox-dies", SandboxDiesEnv)
    register("test-prompt-too-long", PromptTooLongEnv)
