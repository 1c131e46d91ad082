"""Chat messages and tool calls: the vocabulary environments and the episode runner share.

Environments are token-agnostic: they speak OpenAI/Hugging Face-style chat messages (plain
dicts, so they go straight into `tokenizer.apply_chat_template(messages, tools=...)` and into
the store as JSON). The runner owns tokens; it renders these messages with the model's chat
template and keeps the engine's token ids as the truth.

Tool-call arguments are kept as a dict (not a JSON string) because that is what Hugging Face
chat templates (Qwen2.5, Qwen3, Hermes) expect in `message["tool_calls"][i]["function"]`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypedDict

Role = Literal["system", "user", "assistant", "tool"]


class FunctionCall(TypedDict):
    name: str
    arguments: dict[str, Any]


class ToolCallDict(TypedDict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(TypedDict, total=False):
    """One chat message. `role` and `content` are always present."""

    role: Role
    content: str
    tool_calls: list[ToolCallDict]
    """Assistant messages only: the calls the model made, in order."""
    tool_call_id: str
    """Tool messages only: the id of the call this message answers."""
    name: str
    """Tool messages only: the tool that produced this message."""
    reasoning_content: str
    """Assistant messages only: reasoning sent back by an agent (the gateway's thinking blocks
    and reasoning items), rendered where the chat template carries it."""


class ToolCall(BaseModel):
    """One well-formed call the model made: a tool name and its JSON arguments."""

    model_config = ConfigDict(frozen=True)

    id: str
    """Id of the call within its episode; tool observations refer to it."""
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    raw_arguments: str | None = None
    """The arguments' text exactly as the model wrote it (the JSON value after "arguments",
    e.g. `{"guess":8}`, or the string literal of double-encoded ones), when the call was parsed
    from a completion; None when the model wrote none or the call was made in code. This is
    what the store records; `arguments` is its parsed form."""

    def to_message_dict(self) -> ToolCallDict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": dict(self.arguments)},
        }


def system(content: str) -> Message:
    return {"role": "system", "content": content}


def user(content: str) -> Message:
    return {"role": "user", "content": content}


def assistant(content: str, tool_calls: list[ToolCall] | None = None) -> Message:
    msg: Message = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = [c.to_message_dict() for c in tool_calls]
    return msg


def tool_message(content: str, *, call_id: str | None = None, name: str | None = None) -> Message:
    """A tool observation. Malformed calls have neither id nor name: the model still sees why."""
    msg: Message = {"role": "tool", "content": content}
    if call_id is not None:
        msg["tool_call_id"] = call_id
    if name is not None:
        msg["name"] = name
    return msg


class MalformedToolCall(BaseModel):
    """A tool call the model tried to make but could not be parsed: data, not a crash.

    The environment answers it with an error observation (`observation()`) so the model sees
    what went wrong, and the runner records it on the turn.
    """

    model_config = ConfigDict(frozen=True)

    index: int
    """Position among the calls of its turn (well-formed and malformed counted together)."""
    raw: str
    """The offending text, as the model wrote it."""
    reason: str
    """What is wrong with it, in words the model can act on."""

    def observation(self) -> str:
        return f"error: malformed tool call: {self.reason}"


class AssistantTurn(BaseModel):
    """One assistant completion, parsed: what `Env.step` receives.

    `text` is the completion exactly as generated (without the end-of-turn token); `content` is
    the text outside tool-call blocks; `calls` holds every call in order of appearance,
    well-formed (`ToolCall`) or not (`MalformedToolCall`).
    """

    model_config = ConfigDict(frozen=True)

    text: str
    content: str
    calls: list[ToolCall | MalformedToolCall] = Field(default_factory=list)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [c for c in self.calls if isinstance(c, ToolCall)]

    @property
    def malformed(self) -> list[MalformedToolCall]:
        return [c for c in self.calls if isinstance(c, MalformedToolCall)]

    @property
    def has_calls(self) -> bool:
        """True if the model tried to call a tool (even if every call was malformed)."""
        return bool(self.calls)

    def to_message(self, *, structured: bool = False) -> Message:
        """The assistant message for the conversation.

        By default the content is the raw completion text, so any ChatML-style template renders
        exactly what the model generated (tool-call markup included). `structured=True` gives
        the OpenAI shape instead: content without the markup plus `tool_calls`.
        """
        if structured:
            return assistant(self.content, self.tool_calls)
        return {"role": "assistant", "content": self.text}
