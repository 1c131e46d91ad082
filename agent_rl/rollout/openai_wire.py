"""OpenAI's chat-completions wire format, as the agent gateway speaks it.

What comes in: `ChatRequest` (the fields the gateway honours; others a client sends, such as
`user`, `metadata` or `parallel_tool_calls`, are accepted and ignored) and its messages, turned
into the SDK's chat messages for the chat template (`to_message`). What goes out: the
completion and its stream chunks in OpenAI's shape (`completion_body`, `chunk`), and errors
as `{"error": {"message", "type", "param", "code"}}` (`GatewayError`).

Everything here is pure data; the token work is `agent_rl.rollout.gateway`'s, and a call is
answered in this shape by `agent_rl.rollout.chat_completions`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent_rl.sdk.messages import AssistantTurn, Message, ToolCall
from agent_rl.sdk.tool_calls import CLOSE, OPEN
from agent_rl.sglang.generation import Generation


MAX_JSON_WHITESPACE = 4
"""Whitespace characters in a row a forced call's arguments may hold (`tool_constraint`)."""


class GatewayError(Exception):
    """A request the gateway refuses, answered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}  # fmt: skip


class ChatRequest(BaseModel):
    """`POST /v1/chat/completions`, the part of it the gateway honours."""

    model_config = ConfigDict(extra="ignore")

    model: str = ""
    """Any name: every episode's model is the policy being trained."""
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    # OpenAI accepts an explicit null for these: it means the default.
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    n: int | None = 1
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None

    @classmethod
    def parse(cls, body: Any) -> ChatRequest:
        """Validate a decoded JSON body; a `GatewayError` (400) says what is wrong."""
        if not isinstance(body, dict):
            raise GatewayError(400, "the request body must be a JSON object")
        try:
            req = cls.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise GatewayError(400, f"{where}: {first['msg']}", param=where or None) from e
        return req._checked()

    @classmethod
    def build(cls, **fields: Any) -> ChatRequest:
        """A request another dialect's route made from a body it validated itself (`messages`
        a non-empty list of message dicts, the other fields of the types declared here): not
        validated again, which would copy every message once more on every call."""
        if not fields.get("messages"):
            raise GatewayError(400, "messages: the conversation is empty", param="messages")
        return cls.model_construct(**{k: v for k, v in fields.items() if v is not None})._checked()

    def _checked(self) -> ChatRequest:
        """What a field's type cannot say: a `GatewayError` (400) for a request that cannot be
        one turn, or whose `tool_choice` names no known tool."""
        req = self
        if req.n not in (None, 1):
            raise GatewayError(400, "n must be 1: each call is one turn of the episode", param="n")
        if req.top_logprobs and not req.logprobs:
            raise GatewayError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if isinstance(req.stop, list) and not all(isinstance(s, str) for s in req.stop):
            raise GatewayError(400, "stop must be a string or a list of strings", param="stop")
        req.forced_tools()  # a tool_choice that names no known tool is refused now
        return req

    def function_tools(self) -> list[dict[str, Any]]:
        """The tools as the chat template takes them (none when `tool_choice` is "none")."""
        if self.tool_choice == "none" or not self.tools:
            return []
        out = []
        for i, t in enumerate(self.tools):
            if t.get("type", "function") != "function" or not isinstance(t.get("function"), dict) \
                    or not isinstance(t["function"].get("name"), str):  # fmt: skip
                raise GatewayError(400, "only function tools with a name are supported",
                                   param=f"tools.{i}")
            out.append({"type": "function", "function": t["function"]})
        return out

    def forced_tools(self) -> list[dict[str, Any]] | None:
        """The tools `tool_choice` forces a call of: all of them for "required", the named one
        for `{"type": "function", "function": {"name": ...}}`; None when the model is free
        ("auto", "none" or unset). A choice the request's tools cannot satisfy is a 400."""
        choice = self.tool_choice
        if choice is None or choice in ("auto", "none"):
            return None
        tools = self.function_tools()
        if choice == "required":
            if not tools:
                raise GatewayError(400, 'tool_choice "required" needs tools', param="tool_choice")
            return tools
        if isinstance(choice, dict) and choice.get("type", "function") == "function" \
                and isinstance(choice.get("function"), dict):  # fmt: skip
            name = choice["function"].get("name")
            named = [t for t in tools if t["function"]["name"] == name]
            if not named:
                raise GatewayError(400, f"tool_choice names {name!r}, which is not among the tools",
                                   param="tool_choice")
            return named
        raise GatewayError(400, 'tool_choice must be "none", "auto", "required" or '
                                '{"type": "function", "function": {"name": ...}}', param="tool_choice")

    def tool_constraint(self) -> str | None:
        """The engine's constraint for a forced tool call (SGLang's `structural_tag`, compiled by
        xgrammar): the completion opens with a call, written as the chat template writes one, of
        one of the forced tools, with arguments valid against its parameter schema and at most
        `MAX_JSON_WHITESPACE` whitespace characters in a row (a free run of them is how a weak
        policy fills its token budget inside a constraint). A named function is called once,
        then the completion ends; under "required" more calls or text may follow. None when the
        model is free."""
        forced = self.forced_tools()
        if forced is None:
            return None
        tags = [{
            "type": "tag",
            "begin": f'{OPEN}\n{{"name": {json.dumps(t["function"]["name"])}, "arguments": ',
            "content": {"type": "json_schema",
                        "json_schema": t["function"].get("parameters") or {"type": "object"},
                        "max_whitespace_cnt": MAX_JSON_WHITESPACE},
            "end": f"}}\n{CLOSE}",
        } for t in forced]  # fmt: skip
        named = isinstance(self.tool_choice, dict)
        return json.dumps({"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": [OPEN], "tags": tags, "at_least_one": True,
            "stop_after_first": named}})

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts joined (other parts are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                raise GatewayError(400, f"{where}: only text content parts are supported",
                                   param=where)
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise GatewayError(400, f"{where}: content must be a string or a list of text parts", param=where)


def to_message(m: dict[str, Any], index: int, tool_names: dict[str, str]) -> Message:
    """One request message as an SDK chat message for the template (a `developer` message is
    a system one; tool-call arguments become objects, which templates serialize themselves;
    a tool message gets the name of the call it answers). `tool_names` maps call ids seen so
    far to their tool names and is extended with this message's calls."""
    where = f"messages.{index}"
    role = m.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise GatewayError(400, f"{where}.role: unsupported role {role!r}", param=f"{where}.role")
    content = text_of(m.get("content"), f"{where}.content")
    if role in ("system", "developer", "user"):
        return {"role": "system" if role == "developer" else role, "content": content}  # type: ignore[typeddict-item]
    if role == "tool":
        call_id = m.get("tool_call_id")
        msg: Message = {"role": "tool", "content": content}
        if isinstance(call_id, str):
            msg["tool_call_id"] = call_id
            if call_id in tool_names:
                msg["name"] = tool_names[call_id]
        return msg
    msg = {"role": "assistant", "content": content}
    reasoning = m.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:  # where the chat template carries reasoning
        msg["reasoning_content"] = reasoning
    calls = m.get("tool_calls") or []
    if calls:
        msg["tool_calls"] = [_call(c, f"{where}.tool_calls.{j}", tool_names) for j, c in enumerate(calls)]
    return msg


def _call(c: Any, where: str, tool_names: dict[str, str]) -> Any:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise GatewayError(400, f"{where}: a tool call needs function.name", param=where)
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            args = {"_raw": args}  # kept, so the template still renders what the agent sent
    call_id = str(c.get("id") or "")
    tool_names[call_id] = fn["name"]
    return {"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args or {}}}


def same_message(sent: dict[str, Any], ours: dict[str, Any]) -> bool:
    """Whether a message the client sent back is the one recorded at its place: roles and
    text equal (content None and "" alike), tool calls equal by id, name and parsed arguments
    (clients re-serialize arguments, e.g. with spaces)."""
    return message_key(sent) == message_key(ours)


def message_key(m: dict[str, Any]) -> tuple[Any, ...]:
    """What `same_message` compares of a message."""
    try:
        content = text_of(m.get("content"), "content")
    except GatewayError:
        content = repr(m.get("content"))
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function") or {} if isinstance(c, dict) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        calls.append((c.get("id"), fn.get("name"), json.dumps(args, sort_keys=True)))
    role = "system" if m.get("role") == "developer" else m.get("role")
    return role, content.strip(), tuple(calls), m.get("tool_call_id")


def note_calls(m: dict[str, Any], names: dict[str, str]) -> None:
    """Remember the tool names of a message's calls by id (tool messages name their tool)."""
    for c in m.get("tool_calls") or []:
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names[str(c.get("id") or "")] = fn["name"]


def answer_key(m: dict[str, Any]) -> str:
    """What identifies an answer the gateway gave, in the shape a client sends it back."""
    if m.get("role") != "assistant":
        return ""
    calls = [c.get("id") for c in m.get("tool_calls") or [] if isinstance(c, dict)]
    if calls:
        return "calls:" + ",".join(str(c) for c in calls)
    content = m.get("content")
    return "text:" + content.strip() if isinstance(content, str) else ""


def reply_message(turn: AssistantTurn) -> dict[str, Any]:
    """The assistant message of a completion in OpenAI's shape: the text outside tool-call
    blocks (a malformed block is left in it, as the model wrote it) and the well-formed calls,
    their arguments exactly as the model wrote them."""
    content = turn.content
    if turn.malformed:
        content = "\n".join([content, *(m.raw for m in turn.malformed)]).strip()
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not turn.tool_calls else None}
    if turn.tool_calls:
        msg["tool_calls"] = [tool_call(c) for c in turn.tool_calls]
    return msg


def tool_call(c: ToolCall) -> dict[str, Any]:
    args = c.raw_arguments if c.raw_arguments is not None else json.dumps(c.arguments)
    if args.startswith('"'):  # double-encoded by the model: the string is the JSON
        args = json.loads(args)
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}}


FinishReason = Literal["stop", "length", "tool_calls"]


def completion_body(cid: str, model: str, message: dict[str, Any], finish: FinishReason,
                    logprobs: list[dict[str, Any]] | None, usage: dict[str, int]) -> dict[str, Any]:  # fmt: skip
    return {
        "id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish,
                     "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None}}],
        "usage": usage,
    }  # fmt: skip


def chunk(cid: str, model: str, delta: dict[str, Any], *, finish: FinishReason | None = None,
          logprobs: list[dict[str, Any]] | None = None, usage: dict[str, int] | None = None,
          choices: bool = True) -> dict[str, Any]:  # fmt: skip
    body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                            "model": model, "choices": []}  # fmt: skip
    if choices:
        body["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish,
                            "logprobs": None if logprobs is None else {"content": logprobs}}]
    if usage is not None:
        body["usage"] = usage
    return body


def streamable(text: str, eos: str) -> str:
    """The prefix of a completion that is surely content: before any tool-call tag, without a
    trailing piece that may be the start of one or of the end-of-turn text, and stripped as the
    final content is."""
    cut = min((i for i in (text.find(OPEN), text.find(CLOSE)) if i >= 0), default=len(text))
    text = text[:cut]
    for marker in (OPEN, CLOSE, eos):
        for k in range(min(len(marker), len(text)), 0, -1):
            if text.endswith(marker[:k]):
                text = text[:-k]
                break
    return text.strip() if text.strip() else ""


def logprobs_content(decode: Callable[[list[int]], str], gen: Generation, start: int = 0) -> list[dict[str, Any]]:
    """OpenAI's `logprobs.content` for output tokens from `start` on."""
    tops = gen.meta_info.get("output_top_logprobs") or []
    out = []
    assert gen.logprobs is not None
    for i in range(start, len(gen.output_ids)):
        token = decode([gen.output_ids[i]])
        top = tops[i] if i < len(tops) and tops[i] else []
        out.append({
            "token": token, "logprob": gen.logprobs[i], "bytes": list(token.encode()),
            "top_logprobs": [{"token": (t := decode([int(x[1])])), "logprob": float(x[0]),
                              "bytes": list(t.encode())} for x in top],
        })  # fmt: skip
    return out

