"""Parse Qwen/Hermes tool calls out of a completion, and write them the same way.

The format is the one Qwen2.5/Qwen3 and Hermes chat templates teach:

    <tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>

with any whitespace around the JSON. `parse_completion(text)` never raises: every block that is
not a well-formed call becomes a `MalformedToolCall` with a reason, in order among the good
ones, so the environment can answer it with an error observation the model sees ("a bad
rollout is data, not a crash"). Text outside the blocks is the turn's `content` (the final
answer when there are no calls).

Malformed: invalid JSON, JSON that is not an object, a missing or non-string `name`,
`arguments` that is neither an object nor a JSON string holding one, an unclosed
`<tool_call>` (e.g. the completion hit its token limit), a `<tool_call>` opened inside another,
and a `</tool_call>` with no opening tag.

A well-formed call keeps the text of its arguments as the model wrote it (`raw_arguments`:
`{"guess":8}` stays `{"guess":8}`, not `{"guess": 8}`), which is what the store records.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from agent_rl.sdk.messages import AssistantTurn, MalformedToolCall, ToolCall

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def parse_completion(text: str, *, id_prefix: str = "call_") -> AssistantTurn:
    """Split a completion into content and tool calls; ids are `{id_prefix}{index}`."""
    calls: list[ToolCall | MalformedToolCall] = []
    content: list[str] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        stray = text.find(CLOSE, pos)
        if start == -1 and stray == -1:
            content.append(text[pos:])
            break
        if stray != -1 and (start == -1 or stray < start):
            content.append(text[pos:stray])
            calls.append(_malformed(len(calls), CLOSE, f"{CLOSE} without a matching {OPEN}"))
            pos = stray + len(CLOSE)
            continue
        content.append(text[pos:start])
        body_start = start + len(OPEN)
        end = text.find(CLOSE, body_start)
        reopened = text.find(OPEN, body_start)
        if end == -1:
            calls.append(
                _malformed(len(calls), text[start:], f"{OPEN} is never closed with {CLOSE}")
            )
            break
        if reopened != -1 and reopened < end:
            calls.append(
                _malformed(len(calls), text[start:reopened], f"{OPEN} opened again before {CLOSE}")
            )
            pos = reopened
            continue
        calls.append(
            _parse_body(len(calls), text[body_start:end], text[start : end + len(CLOSE)], id_prefix)
        )
        pos = end + len(CLOSE)
    return AssistantTurn(text=text, content="".join(content).strip(), calls=calls)


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """One call as compact Hermes text, the exact form demonstrations teach.

    Compact JSON (no spaces) keeps calls short and their tokenization uniform, which is what
    let a sub-1M-parameter model learn to copy an expression into a call.
    """
    payload = {"name": name, "arguments": dict(arguments)}
    return OPEN + json.dumps(payload, separators=(",", ":"), ensure_ascii=False) + CLOSE


def _parse_body(index: int, body: str, raw: str, id_prefix: str) -> ToolCall | MalformedToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return _malformed(index, raw, f"invalid JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict):
        return _malformed(index, raw, 'expected a JSON object with "name" and "arguments"')
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return _malformed(index, raw, '"name" must be a non-empty string')
    args = obj.get("arguments", {})
    if isinstance(args, str):
        # Some models double-encode the arguments (the OpenAI wire format); accept that.
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return _malformed(index, raw, f'"arguments" is a string but not JSON ({e.msg})')
    if not isinstance(args, dict):
        return _malformed(index, raw, '"arguments" must be a JSON object')
    return ToolCall(id=f"{id_prefix}{index}", name=name.strip(), arguments=args,
                    raw_arguments=member_text(body, "arguments"))


_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")


def member_text(body: str, key: str) -> str | None:
    """The exact text of the value of top-level member `key` in the JSON object `body` (which
    must be valid JSON; the last one when the key repeats, as `json.loads` keeps), or None."""
    pos = _skip(body, 0)
    if body[pos : pos + 1] != "{":
        return None
    pos = _skip(body, pos + 1)
    found = None
    while body[pos : pos + 1] == '"':
        name, pos = _DECODER.raw_decode(body, pos)
        start = _skip(body, _skip(body, pos) + 1)  # past the ':'
        _, end = _DECODER.raw_decode(body, start)
        if name == key:
            found = body[start:end]
        pos = _skip(body, end)
        if body[pos : pos + 1] == ",":
            pos = _skip(body, pos + 1)
    return found


def _skip(body: str, pos: int) -> int:
    """The first position at or after `pos` that is not JSON whitespace."""
    return _SPACE.match(body, pos).end()  # type: ignore[union-attr]  # `*` always matches


def _malformed(index: int, raw: str, reason: str) -> MalformedToolCall:
    return MalformedToolCall(index=index, raw=raw, reason=reason)
