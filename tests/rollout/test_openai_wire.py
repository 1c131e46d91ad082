"""The gateway's OpenAI wire format, as pure data: what a request may hold, how a client's
echo of an answer is recognised, how a completion is answered, and which part of a partial
completion may be streamed. (End to end with real clients: test_gateway.py.)"""

from __future__ import annotations

import pytest

from agent_rl.rollout.gateway import _answer_key, _streamable
from agent_rl.rollout.openai_wire import ChatRequest, GatewayError, reply_message, same_message, to_message
from agent_rl.sdk.tool_calls import parse_completion

USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [USER], "n": 2}, "n"),
    ({"messages": []}, "messages"),
    ({"messages": [USER], "temperature": 3}, "temperature"),
    ({"messages": [USER], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [USER], "stop": [1, 2]}, "stop"),
    ([USER], None),
])  # fmt: skip
def test_refused_requests_say_which_field(body: object, param: str | None) -> None:
    with pytest.raises(GatewayError) as e:
        ChatRequest.parse(body)
    assert e.value.status == 400 and e.value.body()["error"]["type"] == "invalid_request_error"
    assert (e.value.param or "").startswith(param or "")


def test_unknown_fields_are_ignored_and_tools_keep_their_schema() -> None:
    tool = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}, "strict": True}}
    req = ChatRequest.parse({"messages": [USER], "tools": [tool], "parallel_tool_calls": False, "user": "u"})
    assert req.function_tools() == [tool]
    assert ChatRequest.parse({"messages": [USER], "tools": [tool], "tool_choice": "none"}).function_tools() == []
    with pytest.raises(GatewayError):
        ChatRequest.parse({"messages": [USER], "tools": [{"type": "web_search"}]}).function_tools()


def test_messages_become_template_messages() -> None:
    names: dict[str, str] = {}
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "2+3"}'}}
    assistant = to_message({"role": "assistant", "content": None, "tool_calls": [call]}, 1, names)
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"expression": "2+3"}
    assert to_message({"role": "tool", "tool_call_id": "c1", "content": "5"}, 2, names) == \
        {"role": "tool", "content": "5", "tool_call_id": "c1", "name": "calc"}
    assert to_message({"role": "developer", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": " terse"}]},
                      0, names) == {"role": "system", "content": "be terse"}  # fmt: skip
    with pytest.raises(GatewayError, match="unsupported role"):
        to_message({"role": "wizard", "content": "x"}, 3, names)


def test_an_answer_echoed_back_is_recognised_however_the_client_serialises_it() -> None:
    turn = parse_completion('<tool_call>{"name":"calc","arguments":{"expression":"2+3"}}</tool_call>', id_prefix="call_0_")
    ours = reply_message(turn)
    assert ours == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0_0", "type": "function", "function": {"name": "calc", "arguments": '{"expression":"2+3"}'}}]}
    echoed = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0_0", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "2+3"}'}}]}
    assert same_message(echoed, ours) and _answer_key(echoed) == _answer_key(ours)
    edited = {**echoed, "tool_calls": [{**echoed["tool_calls"][0], "function": {"name": "calc", "arguments": "{}"}}]}
    assert not same_message(edited, ours)


def test_a_malformed_call_stays_in_the_content() -> None:
    turn = parse_completion('Let me see. <tool_call>{"name": </tool_call>')
    message = reply_message(turn)
    assert "tool_calls" not in message and message["content"].endswith('<tool_call>{"name": </tool_call>')


@pytest.mark.parametrize(("text", "streamable"), [
    ("The answer", "The answer"),
    ("The answer is 5.<|im_e", "The answer is 5."),
    ("Let me <tool_", "Let me"),
    ("Let me <tool_call>{\"name\"", "Let me"),
    ("\n  5 ", "5"),
])  # fmt: skip
def test_streaming_holds_back_what_may_open_a_tag(text: str, streamable: str) -> None:
    assert _streamable(text, "<|im_end|>") == streamable


def test_tool_choice_is_checked_against_the_tools_and_becomes_a_structural_tag() -> None:
    import json as _json

    from agent_rl.rollout.openai_wire import ChatRequest, GatewayError

    tool = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
    base = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    assert ChatRequest.parse({**base, "tool_choice": "auto"}).tool_constraint() is None
    assert ChatRequest.parse({**base, "tool_choice": "none"}).tool_constraint() is None
    required = _json.loads(ChatRequest.parse({**base, "tool_choice": "required"}).tool_constraint())
    fmt = required["format"]
    assert fmt["at_least_one"] and not fmt["stop_after_first"] and fmt["triggers"] == ["<tool_call>"]
    assert fmt["tags"][0]["begin"] == '<tool_call>\n{"name": "calc", "arguments": '
    assert fmt["tags"][0]["end"] == "}\n</tool_call>"
    named = {"type": "function", "function": {"name": "calc"}}
    assert _json.loads(ChatRequest.parse({**base, "tool_choice": named}).tool_constraint())["format"]["stop_after_first"]
    for bad in ({"type": "function", "function": {"name": "search"}}, "always", {"type": "custom"}):
        with pytest.raises(GatewayError) as e:
            ChatRequest.parse({**base, "tool_choice": bad})
        assert e.value.status == 400 and e.value.param == "tool_choice"
    with pytest.raises(GatewayError):
        ChatRequest.parse({"messages": base["messages"], "tool_choice": "required"})
