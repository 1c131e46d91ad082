"""Anthropic's Messages wire format, as the agent gateway speaks it.

A Messages request becomes the same `ChatRequest` the chat-completions route builds (`to_chat`),
so both dialects share one recording path (`AgentSession.answer` / `pieces`): rendered by the
chat template, token in and token out, the same segments, budgets and endings. What changes is
the shape:

- in: `system` (a string or text blocks), messages whose content is a string or blocks
  (`text`, `tool_use`, `tool_result`; an assistant's `thinking` blocks become its
  `reasoning_content`, which the chat template renders where it carries reasoning and drops
  where it does not; `redacted_thinking` blocks, encrypted, are accepted and left out; the
  gateway never answers with thinking blocks: a model's reasoning stays in its text), `tools` with
  `input_schema`, `tool_choice` (`auto`, `any`, `tool`, `none`), `stop_sequences`, `max_tokens`,
  `temperature`, `top_p`, `stream`; other fields (`metadata`, `top_k`, `thinking`, ...) are
  accepted and ignored;
- out: a `message` with `text` and `tool_use` blocks and a `stop_reason` (`end_turn`,
  `max_tokens`, `stop_sequence`, `tool_use`), or its stream in Anthropic's event grammar
  (`message_start`, `content_block_start` / `_delta` / `_stop`, `message_delta`,
  `message_stop`), and errors as `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent_rl.rollout.openai_wire import ChatRequest, GatewayError
from agent_rl.sdk.messages import AssistantTurn
from agent_rl.sglang.generation import Generation

if TYPE_CHECKING:
    from agent_rl.rollout.gateway import AgentSession, Answer

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
               421: "permission_error", 429: "rate_limit_error", 502: "api_error",
               503: "overloaded_error"}  # fmt: skip


def error_body(e: GatewayError) -> dict[str, Any]:
    """A refusal in Anthropic's error shape."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


class MessagesRequest(BaseModel):
    """`POST /v1/messages`, the part of it the gateway honours."""

    model_config = ConfigDict(extra="ignore")

    model: str = ""
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool | None = None


def to_chat(body: Any, *, counting: bool = False) -> ChatRequest:
    """A decoded Messages body as the chat request the gateway records; a `GatewayError`
    (400) says what is wrong. `counting`: `/v1/messages/count_tokens`, which has no
    `max_tokens`."""
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    try:
        req = MessagesRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise GatewayError(400, f"{where}: {first['msg']}", param=where or None) from e
    if req.max_tokens is None and not counting:
        raise GatewayError(400, "max_tokens: Field required", param="max_tokens")
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        messages += _messages(m, f"messages.{i}")
    return ChatRequest.build(
        model=req.model, messages=messages, tools=_tools(req.tools),
        tool_choice=_choice(req.tool_choice, bool(req.tools)), temperature=req.temperature,
        top_p=req.top_p, max_tokens=req.max_tokens, stop=req.stop_sequences, stream=bool(req.stream),
    )  # fmt: skip


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise GatewayError(400, f"{where}: must be a string or a list of content blocks", param=where)
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise GatewayError(400, f"{where}.{j}: only text blocks are supported here", param=f"{where}.{j}")
        parts.append(str(block.get("text", "")))
    return "".join(parts)


def _messages(m: Any, where: str) -> list[dict[str, Any]]:
    """One Messages message as chat-completions messages: an assistant's text and `tool_use`
    blocks are one message with tool calls; a user's `tool_result` blocks are tool messages,
    its text a user message after them."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise GatewayError(400, f"{where}.role: must be \"user\" or \"assistant\"", param=f"{where}.role")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise GatewayError(400, f"{where}.content: must be a string or a list of content blocks",
                           param=f"{where}.content")  # fmt: skip
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content.{j}"
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "thinking":
            if role == "assistant" and isinstance(block.get("thinking"), str):
                thoughts.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str):
                raise GatewayError(400, f"{at}: a tool_use block needs a name", param=at)
            calls.append({"id": str(block.get("id") or ""), "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})  # fmt: skip
        elif kind == "tool_result" and role == "user":
            output = block.get("content")
            text = "" if output is None else _text(output, f"{at}.content")
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""), "content": text})
        else:
            raise GatewayError(400, f"{at}: unsupported content block {kind!r} in a {role} message "
                                    "(text, tool_use, tool_result and thinking are)", param=at)  # fmt: skip
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if thoughts:
            message["reasoning_content"] = "\n".join(thoughts)
        if calls:
            message["tool_calls"] = calls
        return [message]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t.get("type") not in (None, "custom"):
            raise GatewayError(400, f"tools.{i}: only custom tools (name, input_schema) are supported",
                               param=f"tools.{i}")  # fmt: skip
        fn: dict[str, Any] = {"name": t["name"]}  # in the order OpenAI's tools list them
        if t.get("description"):
            fn["description"] = t["description"]
        fn["parameters"] = t.get("input_schema") or {"type": "object"}
        out.append({"type": "function", "function": fn})
    return out


def _choice(choice: dict[str, Any] | None, tools: bool) -> Any:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "auto":
        return "auto"
    if kind == "none":
        return "none"
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise GatewayError(400, 'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} '
                            'or {"type": "tool", "name": ...}', param="tool_choice")  # fmt: skip


def content_blocks(turn: AssistantTurn, reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The answer's content blocks: its text (with any malformed call as the model wrote it,
    as `reply`, its `reply_message`, has it), then a `tool_use` block per call."""
    blocks: list[dict[str, Any]] = []
    if reply["content"]:
        blocks.append({"type": "text", "text": reply["content"]})
    for c in turn.tool_calls:
        args = c.arguments if isinstance(c.arguments, dict) else {"_raw": c.raw_arguments}
        blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": args})
    return blocks


def stop_reason(a: Answer) -> tuple[str, str | None]:
    if a.turn.tool_calls:
        return "tool_use", None
    if a.finish == "length":
        return "max_tokens", None
    if a.stop is not None:
        return "stop_sequence", a.stop
    return "end_turn", None


def _usage(a: Answer) -> dict[str, int]:
    return {"input_tokens": a.usage["prompt_tokens"], "output_tokens": a.usage["completion_tokens"]}


def message_body(a: Answer, model: str) -> dict[str, Any]:
    """A non-streamed call's answer as a Messages response."""
    reason, sequence = stop_reason(a)
    return {"id": _message_id(a.cid), "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(a.turn, a.reply), "stop_reason": reason, "stop_sequence": sequence,
            "usage": _usage(a)}  # fmt: skip


def _message_id(cid: str) -> str:
    return "msg_" + cid.removeprefix("chatcmpl-")


async def stream(session: AgentSession, req: ChatRequest, model: str) -> AsyncIterator[dict[str, Any]]:
    """A streamed call as Anthropic's events: the text as it is generated (what may open a
    tool call held back), then each tool call as a `tool_use` block with its input in one
    `input_json_delta`, then the stop reason and the usage."""
    mid = _message_id(f"chatcmpl-{session.episode_id}-{session.calls}")
    sent, text_open, index = "", False, 0
    async with aclosing(session.pieces(req)) as pieces:
        async for piece in pieces:
            if piece is None:
                yield {"type": "message_start", "message": {
                    "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
                    "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": session.prompt_tokens(), "output_tokens": 0}}}  # fmt: skip
            elif isinstance(piece, Generation):
                visible = session.visible(piece)
                if len(visible) > len(sent):
                    if not text_open:
                        yield {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
                        text_open = True
                    yield {"type": "content_block_delta", "index": 0,
                           "delta": {"type": "text_delta", "text": visible[len(sent):]}}  # fmt: skip
                    sent = visible
            else:
                blocks = content_blocks(piece.turn, piece.reply)
                text = blocks[0]["text"] if blocks and blocks[0]["type"] == "text" else ""
                if text and not text_open:
                    yield {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
                    text_open = True
                if text_open:
                    if text.startswith(sent) and len(text) > len(sent):
                        yield {"type": "content_block_delta", "index": 0,
                               "delta": {"type": "text_delta", "text": text[len(sent):]}}  # fmt: skip
                    yield {"type": "content_block_stop", "index": 0}
                    index = 1
                for block in blocks:
                    if block["type"] != "tool_use":
                        continue
                    yield {"type": "content_block_start", "index": index,
                           "content_block": {**block, "input": {}}}  # fmt: skip
                    yield {"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}}  # fmt: skip
                    yield {"type": "content_block_stop", "index": index}
                    index += 1
                reason, sequence = stop_reason(piece)
                yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                       "usage": {"output_tokens": piece.usage["completion_tokens"]}}  # fmt: skip
                yield {"type": "message_stop"}
