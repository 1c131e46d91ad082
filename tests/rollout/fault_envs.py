"""Environments that fail on purpose, to show each failure is recorded where it belongs.

They run with the real engine: the model's (random) text is what they receive. `ToolRaisesEnv`
and `RawJsonCallEnv` decide how a completion becomes a tool call themselves, because a random
model cannot be asked to call a tool; everything after that is the real runner path.
"""

from __future__ import annotations

from agent_rl import Env, tool
from agent_rl.messages import AssistantTurn, Message, ToolCall, user
from agent_rl.registry import register
from agent_rl.tasks import ListTasks, Task, TaskSource
from agent_rl.tool_calls import parse_completion


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


def register_fault_envs() -> None:
    register("test-step-raises", StepRaisesEnv)
    register("test-tool-raises", ToolRaisesEnv)
    register("test-raw-json-call", RawJsonCallEnv)
