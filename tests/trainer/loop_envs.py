"""A two-turn environment whose reward varies with the (random) model's text, so GRPO groups
carry signal: turn 1 is always a call of `note`, turn 2 is scored by its length. Multi-turn on
purpose: the trainer must handle tool-observation tokens and per-turn expert rows."""

from __future__ import annotations

from agent_rl import Env, tool
from agent_rl.sdk.messages import AssistantTurn, Message, ToolCall, user
from agent_rl.sdk.registry import register
from agent_rl.sdk.tasks import ListTasks, Task, TaskSource

ENV_ID = "test-two-turn-length"


@tool
def note(text: str = "") -> str:
    """Take a note.

    Args:
        text: Anything.
    """
    return "noted"


class TwoTurnLengthEnv(Env):
    tools = (note,)

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        return ListTasks([Task(id=f"t{i}", data={"q": f"tell me about {i}"}) for i in range(16)])

    def initial_messages(self, task: Task) -> list[Message]:
        return [user(task["q"])]

    async def step(self, turn: AssistantTurn):  # type: ignore[no-untyped-def]
        if self.turns == 0:
            call = ToolCall(id="call_0", name="note", arguments={"text": "x"})
            return await super().step(AssistantTurn(text=turn.text, content="", calls=[call]))
        return await super().step(AssistantTurn(text=turn.text, content=turn.text))

    async def score(self, answer: str) -> float:
        return (len(answer) % 5) / 4


def register_loop_envs() -> None:
    register(ENV_ID, TwoTurnLengthEnv)
