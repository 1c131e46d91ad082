"""OpenAI's Responses wire format, as the agent gateway speaks it.

A Responses request becomes the same `ChatRequest` the chat-completions route builds
(`to_chat`), so it goes through the one recording path (`AgentSession.answer` / `pieces`):

- in: `input` (a string, or items: messages with text parts, `function_call`,
  `function_call_output`; a `reasoning` item's text (its `content`, else its `summary`) becomes
  the `reasoning_content` of the assistant message after it, which the chat template renders
  where it carries reasoning and drops where it does not; the gateway never answers with
  reasoning items: a model's reasoning stays in its text), `instructions` (a system message first), function `tools`,
  `tool_choice`, `max_output_tokens`, `temperature`, `top_p`, `stream`, and
  `previous_response_id`: a response of the same episode, whose conversation (its input and its
  output) comes before `input`; other fields (`store`, `metadata`, `reasoning`, `text`,
  `parallel_tool_calls`, ...) are accepted and ignored;
- out: a `response` whose `output` holds a `message` item (`output_text`) and a
  `function_call` item per call, or its stream (`response.created`, `response.output_item.added`,
  `response.output_text.delta`, `response.function_call_arguments.delta`, their `.done`s,
  `response.completed`); errors in OpenAI's shape.

The conversation of each response kept is remembered for `previous_response_id` while its
episode runs (`AgentSession.responses`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent_rl.rollout.openai_wire import ChatRequest, GatewayError, tool_call
from agent_rl.sglang.generation import Generation

if TYPE_CHECKING:
    from agent_rl.rollout.gateway import AgentSession, Answer


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`, the part of it the gateway honours."""

    model_config = ConfigDict(extra="ignore")

    model: str = ""
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool | None = None
    previous_response_id: str | None = None


def to_chat(body: Any, session: AgentSession) -> tuple[ChatRequest, list[dict[str, Any]]]:
    """A decoded Responses body as the chat request the gateway records, and the conversation
    it holds without its instructions (what a later `previous_response_id` continues)."""
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise GatewayError(400, f"{where}: {first['msg']}", param=where or None) from e
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        found = session.responses.get(req.previous_response_id)
        if found is None:
            raise GatewayError(400, f"previous_response_id {req.previous_response_id!r} is no response "
                                    "of this episode", param="previous_response_id")  # fmt: skip
        history = list(found)
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    conversation = history + _messages(items)
    if not conversation:
        raise GatewayError(400, "input: the conversation is empty", param="input")
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    chat = ChatRequest.build(
        model=req.model, messages=system + conversation, tools=_tools(req.tools),
        tool_choice=_choice(req.tool_choice), temperature=req.temperature, top_p=req.top_p,
        max_tokens=req.max_output_tokens, stream=bool(req.stream),
    )  # fmt: skip
    return chat, conversation


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise GatewayError(400, f"{where}: must be a string or a list of text parts", param=where)
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            raise GatewayError(400, f"{where}.{j}: only text parts are supported", param=f"{where}.{j}")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages: an assistant message and the `function_call` items after
    it are one assistant message with tool calls; a `function_call_output` is a tool message."""
    out: list[dict[str, Any]] = []
    reasoning = ""  # the text of the reasoning items since the last answer, for the next one
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise GatewayError(400, f"{where}: an input item must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise GatewayError(400, f"{where}.role: unsupported role {role!r}", param=f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
            if role == "assistant" and reasoning:
                out[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call":
            if not isinstance(item.get("name"), str):
                raise GatewayError(400, f"{where}: a function_call needs a name", param=where)
            call = {"id": str(item.get("call_id") or ""), "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}  # fmt: skip
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                out.append(last)
                if reasoning:
                    last["reasoning_content"], reasoning = reasoning, ""
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                        "content": _text(item.get("output"), f"{where}.output")})  # fmt: skip
        elif kind == "reasoning":
            reasoning = "\n".join(filter(None, [reasoning, _reasoning_text(item)]))
        else:
            raise GatewayError(400, f"{where}: unsupported input item {kind!r} (message, function_call, "
                                    "function_call_output and reasoning are)", param=where)  # fmt: skip
    return out


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its `reasoning_text` parts, else its `summary_text` ones (an
    item with only `encrypted_content` has none)."""
    for field in ("content", "summary"):
        parts = item.get(field)
        if isinstance(parts, list):
            text = "\n".join(str(p.get("text", "")) for p in parts if isinstance(p, dict) and p.get("text"))
            if text:
                return text
    return ""


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise GatewayError(400, "only function tools with a name are supported", param=f"tools.{i}")
        fn: dict[str, Any] = {"name": t["name"]}  # in the order chat completions' tools list them
        if t.get("description"):
            fn["description"] = t["description"]
        fn["parameters"] = t.get("parameters") or {"type": "object"}
        out.append({"type": "function", "function": fn})
    return out


def _choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_id(cid: str) -> str:
    return "resp_" + cid.removeprefix("chatcmpl-")


def output_items(a: Answer) -> list[dict[str, Any]]:
    """The answer's output: its text as a `message` item (if any), then a `function_call` item
    per call, its arguments as the model wrote them."""
    reply = a.reply
    rid = response_id(a.cid)
    items: list[dict[str, Any]] = []
    if reply["content"]:
        items.append(_message_item(rid, reply["content"], "completed"))
    for j, c in enumerate(a.turn.tool_calls):
        fn = tool_call(c)["function"]
        items.append({"type": "function_call", "id": f"fc_{rid}_{j}", "call_id": c.id, "name": fn["name"],
                      "arguments": fn["arguments"], "status": "completed"})  # fmt: skip
    return items


def _message_item(rid: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{rid}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if text else []}  # fmt: skip


def response_body(rid: str, model: str, req: ChatRequest, previous: str | None,
                  a: Answer | None = None) -> dict[str, Any]:  # fmt: skip
    """A response: in progress (no answer yet) or completed / incomplete (cut at its token
    limit) with its output and usage."""
    body: dict[str, Any] = {
        "id": rid, "object": "response", "created_at": int(time.time()), "model": model,
        "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
        "instructions": None, "metadata": {}, "parallel_tool_calls": True,
        "previous_response_id": previous, "temperature": req.temperature, "top_p": req.top_p,
        "tool_choice": req.tool_choice or "auto", "tools": [], "usage": None,
    }  # fmt: skip
    if a is not None:
        cut = a.finish == "length"
        body.update(status="incomplete" if cut else "completed", output=output_items(a),
                    incomplete_details={"reason": "max_output_tokens"} if cut else None,
                    usage={"input_tokens": a.usage["prompt_tokens"], "output_tokens": a.usage["completion_tokens"],
                           "total_tokens": a.usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                           "output_tokens_details": {"reasoning_tokens": 0}})  # fmt: skip
    return body


def remember(session: AgentSession, a: Answer, conversation: list[dict[str, Any]],
             rid: str | None = None) -> str:  # fmt: skip
    """Keep a kept response's conversation for `previous_response_id`; its id."""
    rid = rid or response_id(a.cid)
    session.responses[rid] = [*conversation, a.reply]
    return rid


async def stream(session: AgentSession, req: ChatRequest, conversation: list[dict[str, Any]],
                 model: str, previous: str | None) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
    """A streamed call as Responses events, each with its `sequence_number`: the text as it is
    generated (what may open a tool call held back), then each call's arguments in one delta,
    then `response.completed` (or `response.incomplete`) with the whole response."""
    rid = response_id(f"chatcmpl-{session.episode_id}-{session.calls}")
    seq = 0
    sent, text_open = "", False

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        nonlocal seq
        seq += 1
        return {"type": kind, "sequence_number": seq - 1, **fields}

    msg = {"item_id": f"msg_{rid}", "output_index": 0, "content_index": 0}
    async with aclosing(session.pieces(req)) as pieces:
        async for piece in pieces:
            if piece is None:
                yield event("response.created", response=response_body(rid, model, req, previous))
                yield event("response.in_progress", response=response_body(rid, model, req, previous))
            elif isinstance(piece, Generation):
                visible = session.visible(piece)
                if len(visible) > len(sent):
                    if not text_open:
                        yield event("response.output_item.added", output_index=0, item=_message_item(rid, "", "in_progress"))
                        yield event("response.content_part.added", **msg, part={"type": "output_text", "text": "", "annotations": []})
                        text_open = True
                    yield event("response.output_text.delta", **msg, delta=visible[len(sent):])
                    sent = visible
            else:
                items = output_items(piece)
                text = items[0]["content"][0]["text"] if items and items[0]["type"] == "message" else ""
                if text and not text_open:
                    yield event("response.output_item.added", output_index=0, item=_message_item(rid, "", "in_progress"))
                    yield event("response.content_part.added", **msg, part={"type": "output_text", "text": "", "annotations": []})
                    text_open = True
                index = 0
                if text_open:
                    if text.startswith(sent) and len(text) > len(sent):
                        yield event("response.output_text.delta", **msg, delta=text[len(sent):])
                    yield event("response.output_text.done", **msg, text=text)
                    yield event("response.content_part.done", **msg, part={"type": "output_text", "text": text, "annotations": []})
                    yield event("response.output_item.done", output_index=0, item=_message_item(rid, text, "completed"))
                    index = 1
                for item in items:
                    if item["type"] != "function_call":
                        continue
                    yield event("response.output_item.added", output_index=index,
                                item={**item, "arguments": "", "status": "in_progress"})  # fmt: skip
                    yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=item["arguments"])  # fmt: skip
                    yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                arguments=item["arguments"])  # fmt: skip
                    yield event("response.output_item.done", output_index=index, item=item)
                    index += 1
                body = response_body(rid, model, req, previous, piece)
                final = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
                last = piece
                yield event(final, response=body)
    remember(session, last, conversation, rid)  # the call was kept: the stream went to its end
