"""The Hermes tool-call parser: good calls, and every malformed shape becoming data."""

from __future__ import annotations

import json

import pytest

from agent_rl.sdk.messages import MalformedToolCall, ToolCall
from agent_rl.sdk.tool_calls import format_tool_call, parse_completion


def test_plain_answer_has_no_calls() -> None:
    turn = parse_completion("  1788 ")
    assert turn.calls == [] and turn.content == "1788" and turn.text == "  1788 "
    assert not turn.has_calls


def test_compact_call_roundtrips_through_format() -> None:
    text = format_tool_call("calc", {"expression": "37*48+12"})
    assert text == '<tool_call>{"name":"calc","arguments":{"expression":"37*48+12"}}</tool_call>'
    turn = parse_completion(text)
    assert turn.tool_calls == [
        ToolCall(id="call_0", name="calc", arguments={"expression": "37*48+12"},
                 raw_arguments='{"expression":"37*48+12"}')
    ]
    assert turn.content == "" and turn.malformed == []


def test_qwen_style_whitespace_and_several_calls_keep_order_and_content() -> None:
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "search", "arguments": {"query": "a b"}}\n</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"c\\"}"}</tool_call>'
    )
    turn = parse_completion(text, id_prefix="t3_")
    assert [c.arguments for c in turn.tool_calls] == [{"query": "a b"}, {"query": "c"}]
    assert [c.id for c in turn.tool_calls] == ["t3_0", "t3_1"]
    assert turn.content == "Let me look."


def test_missing_arguments_means_no_arguments() -> None:
    (call,) = parse_completion('<tool_call>{"name":"now"}</tool_call>').tool_calls
    assert call.arguments == {} and call.raw_arguments is None


@pytest.mark.parametrize(
    ("body", "raw"),
    [
        ('{"name":"guess","arguments":{"guess":8}}', '{"guess":8}'),
        ('{"name": "guess", "arguments": {"guess": 8}}', '{"guess": 8}'),
        ('\n { "arguments" :\t{ "a" : [1, {"b": "}\\",{"}] , "c":null } ,"name":"g" }\n',
         '{ "a" : [1, {"b": "}\\",{"}] , "c":null }'),
        ('{"name":"g","arguments":"{\\"q\\": \\"c\\"}"}', '"{\\"q\\": \\"c\\"}"'),
        ('{"name":"g","arguments":{},"arguments":{"z":1.50}}', '{"z":1.50}'),  # json keeps the last
        ('{"name":"g","arguments":{"s":"\\u00e9 caf\u00e9"}}', '{"s":"\\u00e9 caf\u00e9"}'),
    ],
)
def test_a_call_keeps_its_arguments_as_written(body: str, raw: str) -> None:
    (call,) = parse_completion(f"<tool_call>{body}</tool_call>").tool_calls
    assert call.raw_arguments == raw
    decoded = json.loads(raw)
    assert call.arguments == (json.loads(decoded) if isinstance(decoded, str) else decoded)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('<tool_call>{"name":"calc","arguments":{"expression":"1+"}</tool_call>', "invalid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "JSON object"),
        ('<tool_call>{"arguments":{}}</tool_call>', '"name"'),
        ('<tool_call>{"name":"","arguments":{}}</tool_call>', '"name"'),
        ('<tool_call>{"name":3,"arguments":{}}</tool_call>', '"name"'),
        ('<tool_call>{"name":"calc","arguments":[1]}</tool_call>', '"arguments" must be'),
        ('<tool_call>{"name":"calc","arguments":"{oops"}</tool_call>', "not JSON"),
        ('<tool_call>{"name":"calc","arguments":{"expression":"1', "never closed"),
        ("<tool_call></tool_call>", "invalid JSON"),
        ("done</tool_call>", "without a matching"),
    ],
)
def test_malformed_calls_become_typed_errors(text: str, reason: str) -> None:
    turn = parse_completion(text)
    assert turn.tool_calls == []
    (bad,) = turn.malformed
    assert isinstance(bad, MalformedToolCall) and reason in bad.reason
    assert bad.observation().startswith("error: malformed tool call: ")
    assert turn.has_calls


def test_reopened_block_is_malformed_and_the_next_call_still_parses() -> None:
    good = format_tool_call("calc", {"expression": "2*3"})
    turn = parse_completion('<tool_call>{"name":"calc"' + good)
    assert [type(c) for c in turn.calls] == [MalformedToolCall, ToolCall]
    assert "opened again" in turn.malformed[0].reason
    assert turn.tool_calls[0].id == "call_1" and turn.tool_calls[0].arguments == {
        "expression": "2*3"
    }


def test_raw_message_reproduces_the_completion_and_structured_one_splits_it() -> None:
    text = "ok " + format_tool_call("calc", {"expression": "1+1"})
    turn = parse_completion(text)
    assert turn.to_message() == {"role": "assistant", "content": text}
    msg = turn.to_message(structured=True)
    assert msg["content"] == "ok"
    assert msg["tool_calls"][0]["function"] == {"name": "calc", "arguments": {"expression": "1+1"}}
