"""The gateway's OpenAI wire format, as pure data: what a request may hold, how a client's
echo of an answer is recognised, how a completion is answered, and which part of a partial
completion may be streamed. (End to end with real clients: test_gateway.py.)"""

from __future__ import annotations

import pytest

from agent_rl.rollout.openai_wire import (
    ChatRequest,
    GatewayError,
    answer_key,
    reply_message,
    same_message,
    streamable,
    to_message,
)
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
    assert same_message(echoed, ours) and answer_key(echoed) == answer_key(ours)
    edited = {**echoed, "tool_calls": [{**echoed["tool_calls"][0], "function": {"name": "calc", "arguments": "{}"}}]}
    assert not same_message(edited, ours)


def test_a_malformed_call_stays_in_the_content() -> None:
    turn = parse_completion('Let me see. <tool_call>{"name": </tool_call>')
    message = reply_message(turn)
    assert "tool_calls" not in message and message["content"].endswith('<tool_call>{"name": </tool_call>')


@pytest.mark.parametrize(("text", "expected"), [
    ("The answer", "The answer"),
    ("The answer is 5.<|im_e", "The answer is 5."),
    ("Let me <tool_", "Let me"),
    ("Let me <tool_call>{\"name\"", "Let me"),
    ("\n  5 ", "5"),
])  # fmt: skip
def test_streaming_holds_back_what_may_open_a_tag(text: str, expected: str) -> None:
    assert streamable(text, "<|im_end|>") == expected


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


def test_openai_nulls_mean_the_defaults() -> None:
    req = ChatRequest.parse({"messages": [USER], "n": None, "stream": None, "logprobs": None,
                             "max_tokens": None, "stop": None, "tools": None, "tool_choice": None})  # fmt: skip
    assert not req.stream and not req.logprobs and req.forced_tools() is None


def test_anthropic_messages_become_the_same_chat_request() -> None:
    """A Messages body and the chat-completions body of the same conversation render alike:
    system, text blocks, a tool_use answer, its tool_result, tools with input_schema, and
    tool_choice any / tool / none."""
    from agent_rl.rollout.anthropic_wire import error_body, to_chat

    schema = {"type": "object", "properties": {"expression": {"type": "string"}}}
    body = {"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "Be terse."}],
            "tools": [{"name": "calc", "description": "Evaluate.", "input_schema": schema}],
            "stop_sequences": ["END"], "messages": [
                {"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                  {"type": "tool_use", "id": "call_0_0", "name": "calc",
                                                   "input": {"expression": "2+3"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_0_0",
                                              "content": [{"type": "text", "text": "5"}]},
                                             {"type": "text", "text": "Sure?"}]}]}  # fmt: skip
    req = to_chat(body)
    assert req.messages == [
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "", "reasoning_content": "hm", "tool_calls": [{"id": "call_0_0",
            "type": "function", "function": {"name": "calc", "arguments": '{"expression": "2+3"}'}}]},
        {"role": "tool", "tool_call_id": "call_0_0", "content": "5"}, {"role": "user", "content": "Sure?"}]  # fmt: skip
    assert req.function_tools() == [{"type": "function", "function": {
        "name": "calc", "description": "Evaluate.", "parameters": schema}}]  # fmt: skip
    assert req.stops() == ["END"] and req.max_tokens == 8
    # The thinking goes to the template as the answer's reasoning (rendered where it carries it).
    assert to_message(req.messages[2], 2, {})["reasoning_content"] == "hm"
    assert to_chat({**body, "tool_choice": {"type": "any"}}).tool_choice == "required"
    assert to_chat({**body, "tool_choice": {"type": "tool", "name": "calc"}}).forced_tools() == req.function_tools()
    assert to_chat({**body, "tool_choice": {"type": "none"}}).function_tools() == []
    for bad in ({**body, "max_tokens": None}, {**body, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
                {**body, "tool_choice": {"type": "tool", "name": "search"}},
                {**body, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}):  # fmt: skip
        with pytest.raises(GatewayError) as e:
            to_chat(bad)
        assert error_body(e.value)["error"]["type"] == "invalid_request_error"
    assert to_chat({**body, "max_tokens": None}, counting=True).max_tokens is None


def test_responses_input_becomes_the_same_chat_request() -> None:
    """Responses input items as chat messages: instructions first, an assistant message and
    the function calls after it as one answer with tool calls, outputs as tool messages,
    a reasoning item's text the reasoning of the answer after it; `previous_response_id`
    continues a response of the episode."""
    from types import SimpleNamespace

    from agent_rl.rollout.responses_wire import to_chat

    session = SimpleNamespace(responses={"resp_1-0": [{"role": "user", "content": "2+3?"}]})
    tool = {"type": "function", "name": "calc", "description": "Evaluate.", "parameters": {"type": "object"}}
    body = {"model": "m", "instructions": "Be terse.", "tools": [tool], "max_output_tokens": 8, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "2+3?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Add."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "call_0_0", "name": "calc", "arguments": '{"expression": "2+3"}'},
        {"type": "function_call", "call_id": "call_0_1", "name": "calc", "arguments": '{"expression": "1"}'},
        {"type": "function_call_output", "call_id": "call_0_0", "output": "5"},
        {"type": "function_call_output", "call_id": "call_0_1", "output": "1"}]}  # fmt: skip
    req, conversation = to_chat(body, session)  # type: ignore[arg-type]
    calls = [{"id": f"call_0_{j}", "type": "function", "function": {"name": "calc", "arguments": a}}
             for j, a in enumerate(('{"expression": "2+3"}', '{"expression": "1"}'))]  # fmt: skip
    assert req.messages == [{"role": "system", "content": "Be terse."}, *conversation]
    assert conversation == [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "Let me see.", "reasoning_content": "Add.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_0_0", "content": "5"},
        {"role": "tool", "tool_call_id": "call_0_1", "content": "1"}]  # fmt: skip
    assert req.function_tools() == [{"type": "function", "function": {
        "name": "calc", "description": "Evaluate.", "parameters": {"type": "object"}}}]  # fmt: skip
    assert req.max_tokens == 8
    chained, _ = to_chat({"input": "Sure?", "previous_response_id": "resp_1-0"}, session)  # type: ignore[arg-type]
    assert chained.messages == [{"role": "user", "content": "2+3?"}, {"role": "user", "content": "Sure?"}]
    for bad in ({"input": "x", "previous_response_id": "resp_9"}, {"input": [{"type": "web_search_call"}]},
                {"input": "x", "tools": [{"type": "web_search"}]}):  # fmt: skip
        with pytest.raises(GatewayError) as e:
            to_chat(bad, session)  # type: ignore[arg-type]
        assert e.value.status == 400


async def _ask(method: str, path: str, **kwargs: object) -> object:
    import httpx

    from agent_rl.rollout.gateway import Gateway
    from agent_rl.rollout.gateway_app import gateway_app

    transport = httpx.ASGITransport(app=gateway_app(Gateway("policy")))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        return await http.request(method, path, **kwargs)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_refusals_come_in_the_dialect_of_their_route_and_a_404_names_the_routes() -> None:
    """The gateway app itself (no episode running): an unknown route's 404 names the routes
    that exist; an unknown key on Anthropic's route is refused in Anthropic's shape, on
    OpenAI's in OpenAI's."""
    missing = await _ask("POST", "/agents/k/v1/completions", json={})
    assert missing.status_code == 404  # type: ignore[attr-defined]
    message = missing.json()["error"]["message"]  # type: ignore[attr-defined]
    for route in ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"):
        assert route in message
    anthropic = await _ask("POST", "/agents/k/v1/messages", json={}, headers={"x-api-key": "k"})
    assert anthropic.status_code == 404  # type: ignore[attr-defined]
    assert anthropic.json() == {"type": "error", "error": {  # type: ignore[attr-defined]
        "type": "not_found_error", "message": "no running episode has this key"}}  # fmt: skip
    openai_ = await _ask("POST", "/agents/k/v1/responses", json={})
    assert openai_.json()["error"]["code"] == "episode_not_found"  # type: ignore[attr-defined]
