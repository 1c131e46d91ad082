"""The agent gateway end to end: agent programs written with the official `openai` client call
`serve`'s gateway, which generates on the session's real SGLang engine (tiny-moe, routing
replay on) and records every call; each stored episode is checked against what the engine
itself saw and produced (`gateway_helpers.Tap`, a recording hop on loopback).

A random tiny model never writes a tool call, so the module loads weights memorized to answer
one question with a `calc` call and then the result (`memorize_calculator`, for the tool schema
each client sends) into the shared engine, and puts the engine's own weights back afterwards.
The OpenAI Agents SDK and LangGraph (with `langchain-openai`) run their own tool-using agents
against the gateway, offline (the Agents SDK's tracing is off).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import openai
import pytest

from agent_rl.sdk.agent import AgentEnv
from agent_rl.sglang.client import EngineClient
from agent_rl.sdk.registry import register
from agent_rl.sdk.rewards import number_reward
from agent_rl.rollout.render import ChatRenderer
from agent_rl.app.serve import serve
from agent_rl.store import Store
from agent_rl.sdk.tasks import ListTasks, Task, TaskSource
from envs.calculator.env import safe_eval
from envs.calculator_agent.agent import CALC, calc
from tests.rollout.conftest import serve_config
from tests.rollout.gateway_helpers import (
    CALL_TEXT,
    FINAL_TEXT,
    QUESTION,
    Tap,
    check_agent_episode,
    memorize_calculator,
)

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SEEN: dict[str, list[Any]] = {}
"""What each agent got back, by its API key (the episode's key)."""
KEYS: list[tuple[str, str]] = []
"""(base_url, key) of every episode, in the order they ran."""


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def calc_tool(expression: str) -> str:
    """Evaluate integer arithmetic with +, -, * and parentheses.

    Args:
        expression: The expression to evaluate, e.g. "37*48+12".
    """
    value = safe_eval(expression)
    return "error: bad expression" if value is None else str(value)


def agents_sdk_tool() -> Any:
    from agents import function_tool

    return function_tool(calc_tool, name_override="calc")


def langchain_tool() -> Any:
    from langchain_core.tools import StructuredTool

    return StructuredTool.from_function(calc_tool, name="calc")


def tool_schemas() -> dict[str, dict[str, Any]]:
    """The `calc` schema as each client sends it in `tools`."""
    from agents.models.chatcmpl_converter import Converter
    from langchain_core.utils.function_calling import convert_to_openai_tool

    return {"openai": CALC, "agents": dict(Converter.tool_to_openai(agents_sdk_tool())),
            "langchain": convert_to_openai_tool(langchain_tool())}  # fmt: skip


@pytest.fixture(scope="module")
async def memorized(sglang_moe_server, tiny_moe_model: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    weights = memorize_calculator(tiny_moe_model, tmp_path_factory.mktemp("memorized") / "model",
                                  [[t] for t in tool_schemas().values()])  # fmt: skip
    async with EngineClient(sglang_moe_server.url) as client:
        await client.update_weights_from_disk(weights, weight_version="default")
        try:
            yield sglang_moe_server
        finally:
            await client.update_weights_from_disk(tiny_moe_model, weight_version="default")


class _OneQuestion(AgentEnv):
    def builtin_tasks(self, split: str = "train") -> TaskSource:
        return ListTasks([Task(id="q", data={"question": QUESTION, "answer": "5"})])

    async def score(self, task: Task, result: Any, transcript: list[dict[str, Any]]) -> Any:
        return number_reward(str(result), task["answer"])

    def client(self, base_url: str, api_key: str) -> openai.AsyncOpenAI:
        """A client for the episode, to be closed by the agent (`async with`): one left to the
        garbage collector closes its connections on a later test's event loop and fails it."""
        KEYS.append((base_url, api_key))
        return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)


@register("test-openai-tools")
class ToolsAgent(_OneQuestion):
    """The plain client: tools, greedy, logprobs with two alternatives; runs calc itself."""

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        async with self.client(base_url, api_key) as client:
            return await self.converse(client, api_key, task)

    async def converse(self, client: openai.AsyncOpenAI, api_key: str, task: Task) -> str:
        SEEN[api_key] = [await client.models.list()]
        messages: list[Any] = [{"role": "user", "content": task["question"]}]
        for _ in range(3):
            r = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC],
                                                     temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
            SEEN[api_key].append(r)
            message = r.choices[0].message
            if not message.tool_calls:
                return message.content or ""
            messages.append(message.model_dump(exclude_none=True))
            for c in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": c.id, "content": calc(c.function.arguments)})
        return ""


@register("test-openai-stream")
class StreamingAgent(_OneQuestion):
    """The same agent, streaming: content, tool calls and logprobs put together from chunks."""

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        async with self.client(base_url, api_key) as client:
            return await self.converse(client, api_key, task)

    async def converse(self, client: openai.AsyncOpenAI, api_key: str, task: Task) -> str:
        SEEN[api_key] = []
        messages: list[Any] = [{"role": "user", "content": task["question"]}]
        for _ in range(3):
            stream = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALC], temperature=0, logprobs=True,
                stream=True, stream_options={"include_usage": True})  # fmt: skip
            content, calls, logprobs, finish, usage = "", {}, [], None, None
            async for c in stream:
                usage = c.usage or usage
                if not c.choices:
                    continue
                choice = c.choices[0]
                content += choice.delta.content or ""
                for t in choice.delta.tool_calls or []:
                    calls[t.index] = t
                logprobs += choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
                finish = choice.finish_reason or finish
            SEEN[api_key].append({"content": content, "calls": calls, "logprobs": logprobs,
                                  "finish": finish, "usage": usage})  # fmt: skip
            if not calls:
                return content
            messages.append({"role": "assistant", "content": content or None, "tool_calls": [
                {"id": t.id, "type": "function", "function": {"name": t.function.name,
                                                              "arguments": t.function.arguments}}
                for t in calls.values()]})  # fmt: skip
            for t in calls.values():
                messages.append({"role": "tool", "tool_call_id": t.id, "content": calc(t.function.arguments)})
        return ""


ANTHROPIC_CALC = {"name": CALC["function"]["name"], "description": CALC["function"]["description"],
                  "input_schema": CALC["function"]["parameters"]}  # fmt: skip
"""The calc tool as Anthropic's client sends it (rendered as the OpenAI one is)."""
RUNS: list[str] = []


@register("test-anthropic")
class AnthropicAgent(_OneQuestion):
    """Anthropic's client, its tool loop written the usual way: the first episode of a run with
    the sync client (in a thread) on the base URL without /v1, the next one with the async
    client on the base URL as given, streaming with `messages.stream`, and counting its
    tokens first."""

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        import anthropic

        KEYS.append((base_url, api_key))
        SEEN[api_key] = []
        RUNS.append(api_key)
        messages: list[Any] = [{"role": "user", "content": task["question"]}]
        # This client no longer has `temperature`; the gateway honours it (greedy: the memorized answer).
        ask = {"model": "policy", "max_tokens": 48, "tools": [ANTHROPIC_CALC], "extra_body": {"temperature": 0}}
        if len(RUNS) % 2:
            with anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0) as sync:
                for _ in range(3):
                    r = await anyio.to_thread.run_sync(lambda: sync.messages.create(messages=messages, **ask))
                    if not self.keep(api_key, messages, r):
                        return "".join(b.text for b in r.content if b.type == "text")
            return ""
        async with anthropic.AsyncAnthropic(base_url=base_url, api_key=api_key, max_retries=0) as client:
            SEEN[api_key].append(await client.messages.count_tokens(model="policy", messages=messages,
                                                                    tools=[ANTHROPIC_CALC]))  # fmt: skip
            for _ in range(3):
                async with client.messages.stream(messages=messages, **ask) as stream:
                    events = [e.type async for e in stream]
                    r = await stream.get_final_message()
                SEEN[api_key].append(events)
                if not self.keep(api_key, messages, r):
                    return "".join(b.text for b in r.content if b.type == "text")
        return ""

    @staticmethod
    def keep(api_key: str, messages: list[Any], r: Any) -> bool:
        """Keep the answer; run its tool calls (False when there are none)."""
        SEEN[api_key].append(r)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
        uses = [b for b in r.content if b.type == "tool_use"]
        if uses:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b.id, "content": calc(json.dumps(b.input))} for b in uses]})
        return bool(uses)


RESPONSES_CALC = {"type": "function", **CALC["function"]}
"""The calc tool as the Responses API takes it (rendered as the chat-completions one is)."""


@register("test-openai-responses")
class ResponsesAgent(_OneQuestion):
    """`client.responses.create`: the first episode of a run sends its whole input each time
    (the output items back, then a function_call_output), not streamed; the next one streams
    and continues with `previous_response_id` and only the new items."""

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        SEEN[api_key] = []
        RUNS.append(api_key)
        chained = not len(RUNS) % 2
        items: list[Any] = [{"role": "user", "content": task["question"]}]
        previous = None
        async with self.client(base_url, api_key) as client:
            for _ in range(3):
                ask: dict[str, Any] = {"model": "policy", "tools": [RESPONSES_CALC], "temperature": 0,
                                       "max_output_tokens": 48}  # fmt: skip
                if chained and previous is not None:
                    ask["previous_response_id"] = previous
                if chained:
                    events = []
                    async with client.responses.stream(input=items, **ask) as stream:
                        async for e in stream:
                            events.append(e.type)
                        r = await stream.get_final_response()
                    SEEN[api_key].append(events)
                else:
                    r = await client.responses.create(input=items, **ask)
                SEEN[api_key].append(r)
                calls = [o for o in r.output if o.type == "function_call"]
                if not calls:
                    return r.output_text
                outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": calc(c.arguments)}
                           for c in calls]  # fmt: skip
                previous = r.id
                items = outputs if chained else [*items, *[o.model_dump(exclude_none=True) for o in r.output], *outputs]
        return ""


def _key(episode_id: int) -> str:
    """The API key the latest run's episode `episode_id` was given (each test has its store)."""
    return next(k for _, k in reversed(KEYS) if k.startswith(f"ep{episode_id}-"))


@register("test-openai-agents-sdk")
class AgentsSdkAgent(_OneQuestion):
    """The OpenAI Agents SDK's own agent loop, on its chat-completions model."""

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, set_tracing_disabled

        set_tracing_disabled(True)
        async with self.client(base_url, api_key) as client:
            model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
            agent = Agent(name="calculator", tools=[agents_sdk_tool()], model=model,
                          model_settings=ModelSettings(temperature=0))  # fmt: skip
            result = await Runner.run(agent, task["question"], max_turns=3,
                                      run_config=RunConfig(tracing_disabled=True))
        return str(result.final_output)


@register("test-langgraph")
class LangGraphAgent(_OneQuestion):
    """LangGraph's prebuilt ReAct agent over `langchain-openai`'s ChatOpenAI."""

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        from langchain_openai import ChatOpenAI
        from langgraph.prebuilt import create_react_agent

        KEYS.append((base_url, api_key))
        llm = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, temperature=0, max_retries=0)
        graph = create_react_agent(llm, [langchain_tool()])
        out = await graph.ainvoke({"messages": [("user", task["question"])]})
        return str(out["messages"][-1].content)


async def _serve(tmp_path: Path, tap: Tap, model: Path, env: str, episodes: int = 2, **rollout: Any):  # type: ignore[no-untyped-def]
    rollout.setdefault("max_new_tokens", 48)
    cfg = serve_config(f"sqlite:///{tmp_path / f'{env}.db'}", tap.url, model, env=env, **rollout)
    summary = await serve(cfg, max_episodes=episodes)
    assert summary.admitted == episodes and summary.run_ledger.balances()
    assert summary.run_ledger.running == summary.run_ledger.waiting == 0
    return cfg, summary


async def test_openai_client_with_tools_and_logprobs(tmp_path: Path, memorized, tiny_moe_model: Path) -> None:
    async with Tap(memorized.url).running() as tap:
        cfg, summary = await _serve(tmp_path, tap, tiny_moe_model, "test-openai-tools")
    renderer = ChatRenderer(tiny_moe_model)
    async with await Store.open(cfg.store) as store:
        episodes = await store.list_episodes(run_id=summary.run_id)
        assert {e.status for e in episodes} <= {"completed", "filtered"}, [e.error_cause for e in episodes]
        for e in episodes:
            await check_agent_episode(store, renderer, tap, e.id, [CALC])
            assert e.reward == 1.0 and e.num_turns == 2
            assert e.reward_details["segments"] == 1 and e.reward_details["rewrites"] == 0
            tokens = await store.episode_tokens(e.id)
            detail = await store.get_episode(e.id)
            key = _key(e.id)
            models, first, second = SEEN[key]
            assert [m.id for m in models.data] == [tiny_moe_model.name]
            # The engine wrote the call; the client got it parsed, arguments as written.
            assert first.choices[0].finish_reason == "tool_calls"
            (call,) = first.choices[0].message.tool_calls
            assert call.function.name == "calc" and call.function.arguments == '{"expression": "2+3"}'
            assert second.choices[0].message.content == FINAL_TEXT
            assert second.choices[0].finish_reason == "stop"
            assert detail.messages[1]["content"] == CALL_TEXT  # stored as the model wrote it
            for response, turn in zip((first, second), detail.turns):
                span = slice(turn.span_start + turn.num_prompt_tokens, turn.span_start + turn.num_tokens)
                returned = response.choices[0].logprobs.content
                assert len(returned) == turn.num_tokens - turn.num_prompt_tokens
                assert np.allclose([t.logprob for t in returned], tokens.logprobs[span], atol=1e-6)
                assert all(len(t.top_logprobs) == 2 for t in returned)
                assert "".join(t.token for t in returned) == renderer.decode(tokens.token_ids[span].tolist())
                assert response.usage.completion_tokens == turn.num_tokens - turn.num_prompt_tokens
                assert response.usage.prompt_tokens == turn.span_start + turn.num_prompt_tokens


@pytest.mark.parametrize("write_s", [0.0, 60.0])
async def test_an_agents_turns_commit_without_an_fsync_and_its_end_with_one(
        tmp_path: Path, memorized, tiny_moe_model: Path, monkeypatch: pytest.MonkeyPatch,
        write_s: float) -> None:  # fmt: skip
    """The gateway writes an agent's turns `durable=False` (SQLite's NORMAL: no fsync of their
    own) and the episode's end durably: an agent episode cannot be resumed, so a machine crash
    fails it whatever it kept, and its end's commit makes the turns before it durable. Held
    (`rollout.gateway_write_s`), its turns have no commit of their own at all: they land with
    the end."""
    writes: list[tuple[str, bool]] = []
    run_in_transaction = Store.run_in_transaction

    async def spy(self: Store, fn: Any, *, write: bool, durable: bool = True, name: str = "") -> Any:
        if write:
            writes.append((name, durable))
        return await run_in_transaction(self, fn, write=write, durable=durable, name=name)

    monkeypatch.setattr(Store, "run_in_transaction", spy)
    async with Tap(memorized.url).running() as tap:
        cfg, summary = await _serve(tmp_path, tap, tiny_moe_model, "test-openai-tools", episodes=1,
                                    gateway_write_s=write_s)
    assert summary.completed == 1
    turns = [durable for name, durable in writes if name == "append_turns"]
    ends = [durable for name, durable in writes if name.startswith("end_episode")]
    # Written at once, the first of its two calls is written during the second, which lands
    # with the end; held, both land with the end.
    assert turns == ([False] if write_s == 0 else []), writes
    assert ends == [True], writes
    async with await Store.open(cfg.store) as store:
        (e,) = await store.list_episodes(run_id=summary.run_id)
        assert e.num_turns == 2
    # Its admission is bookkeeping too: lost in a machine crash only with all of the above.
    assert [durable for name, durable in writes if name == "admit_task"] == [False], writes


async def test_openai_client_streaming(tmp_path: Path, memorized, tiny_moe_model: Path) -> None:
    async with Tap(memorized.url).running() as tap:
        cfg, summary = await _serve(tmp_path, tap, tiny_moe_model, "test-openai-stream")
    renderer = ChatRenderer(tiny_moe_model)
    async with await Store.open(cfg.store) as store:
        for e in await store.list_episodes(run_id=summary.run_id):
            assert e.status in ("completed", "filtered"), e.error_cause
            await check_agent_episode(store, renderer, tap, e.id, [CALC])
            assert e.reward == 1.0 and e.num_turns == 2
            tokens = await store.episode_tokens(e.id)
            detail = await store.get_episode(e.id)
            key = _key(e.id)
            first, second = SEEN[key]
            assert first["finish"] == "tool_calls" and first["content"] == ""
            (call,) = first["calls"].values()
            assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expression": "2+3"}
            assert second["finish"] == "stop" and second["content"] == FINAL_TEXT
            for seen, turn in zip((first, second), detail.turns):
                span = slice(turn.span_start + turn.num_prompt_tokens, turn.span_start + turn.num_tokens)
                assert np.allclose([t.logprob for t in seen["logprobs"]], tokens.logprobs[span], atol=1e-6)
                assert seen["usage"].completion_tokens == turn.num_tokens - turn.num_prompt_tokens


async def test_command_agent_gets_the_gateway_from_its_environment(
    tmp_path: Path, memorized, tiny_moe_model: Path
) -> None:
    """`calculator-agent-cli`: the example agent as a subprocess that reads OPENAI_BASE_URL and
    OPENAI_API_KEY, as any OpenAI program does."""
    async with Tap(memorized.url).running() as tap:
        cfg, summary = await _serve(tmp_path, tap, tiny_moe_model, "calculator-agent-cli")
    renderer = ChatRenderer(tiny_moe_model)
    async with await Store.open(cfg.store) as store:
        for e in await store.list_episodes(run_id=summary.run_id):
            assert e.status in ("completed", "filtered"), e.error_cause
            await check_agent_episode(store, renderer, tap, e.id, [CALC])


@pytest.mark.parametrize(("env", "schema"), [("test-openai-agents-sdk", "agents"), ("test-langgraph", "langchain")])
async def test_frameworks_run_their_tool_using_agents(tmp_path: Path, memorized, tiny_moe_model: Path,
                                                      env: str, schema: str) -> None:  # fmt: skip
    """Agent loops nobody here wrote: each sends the calc schema its way, gets the engine's call
    parsed into tool_calls, runs the tool, sends the history back, and gets the answer."""
    async with Tap(memorized.url).running() as tap:
        cfg, summary = await _serve(tmp_path, tap, tiny_moe_model, env)
    renderer = ChatRenderer(tiny_moe_model)
    async with await Store.open(cfg.store) as store:
        for e in await store.list_episodes(run_id=summary.run_id):
            assert e.status in ("completed", "filtered"), e.error_cause
            await check_agent_episode(store, renderer, tap, e.id, [tool_schemas()[schema]])
            assert (e.reward, e.num_turns, e.reward_details["segments"]) == (1.0, 2, 1)
            detail = await store.get_episode(e.id)
            assert [m["role"] for m in detail.messages] == ["user", "assistant", "tool", "assistant"]
            assert detail.messages[1]["content"] == CALL_TEXT and detail.messages[2]["content"] == "5"
            assert detail.messages[3]["content"] == FINAL_TEXT


async def test_anthropic_client_sync_async_and_streaming(tmp_path: Path, memorized, tiny_moe_model: Path) -> None:
    """The official anthropic client (sync on the base URL without /v1; async and streaming,
    with count_tokens, on the base URL as given; its key as `x-api-key`) runs its tool loop:
    the engine's call comes back as a tool_use block, its result goes back as a tool_result,
    and every turn is the engine's own tokens, one segment, as with the OpenAI client."""
    RUNS.clear()
    async with Tap(memorized.url).running() as tap:
        cfg, summary = await _serve(tmp_path, tap, tiny_moe_model, "test-anthropic")
    renderer = ChatRenderer(tiny_moe_model)
    async with await Store.open(cfg.store) as store:
        episodes = await store.list_episodes(run_id=summary.run_id)
        assert len(episodes) == 2
        for e in episodes:
            assert e.status in ("completed", "filtered"), e.error_cause
            await check_agent_episode(store, renderer, tap, e.id, [CALC])
            assert (e.reward, e.num_turns, e.reward_details["segments"]) == (1.0, 2, 1)
            detail = await store.get_episode(e.id)
            assert [m["role"] for m in detail.messages] == ["user", "assistant", "tool", "assistant"]
            assert detail.messages[1]["content"] == CALL_TEXT and detail.messages[2]["content"] == "5"
            key = _key(e.id)
            seen = SEEN[key]
            streamed = key == RUNS[1]
            if streamed:
                counted, first_events, first, second_events, second = seen
                # count_tokens: the prompt the first call generated after.
                assert counted.input_tokens == detail.turns[0].num_prompt_tokens
                grammar = ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                           "message_delta", "message_stop"]  # fmt: skip
                assert [t for t in first_events if t in grammar] == grammar, first_events
                assert second_events[0] == "message_start" and second_events[-1] == "message_stop"
            else:
                first, second = seen
            assert first.stop_reason == "tool_use" and second.stop_reason == "end_turn"
            (use,) = [b for b in first.content if b.type == "tool_use"]
            assert use.name == "calc" and use.input == {"expression": "2+3"}
            assert [b.text for b in second.content if b.type == "text"] == [FINAL_TEXT]
            for r, turn in zip((first, second), detail.turns):
                assert r.usage.output_tokens == turn.num_tokens - turn.num_prompt_tokens
                assert r.usage.input_tokens == turn.span_start + turn.num_prompt_tokens


async def test_openai_responses_full_input_and_previous_response_id(tmp_path: Path, memorized,
                                                                    tiny_moe_model: Path) -> None:  # fmt: skip
    """`client.responses.create`, with its whole input each call and, streamed, with
    `previous_response_id`: the engine's call comes back as a function_call item, its output
    goes back as a function_call_output, and every turn is the engine's own tokens in one
    segment."""
    RUNS.clear()
    async with Tap(memorized.url).running() as tap:
        cfg, summary = await _serve(tmp_path, tap, tiny_moe_model, "test-openai-responses")
    renderer = ChatRenderer(tiny_moe_model)
    async with await Store.open(cfg.store) as store:
        episodes = await store.list_episodes(run_id=summary.run_id)
        assert len(episodes) == 2
        for e in episodes:
            assert e.status in ("completed", "filtered"), e.error_cause
            await check_agent_episode(store, renderer, tap, e.id, [CALC])
            detail = await store.get_episode(e.id)
            assert (e.num_turns, e.reward_details["segments"]) == (2, 1), detail.messages
            assert [m["role"] for m in detail.messages] == ["user", "assistant", "tool", "assistant"]
            key = _key(e.id)
            seen = SEEN[key]
            if key == RUNS[1]:
                first_events, first, second_events, second = seen
                for events in (first_events, second_events):
                    assert events[0] == "response.created" and events[-1] == "response.completed", events
                assert "response.function_call_arguments.delta" in first_events
                assert "response.output_text.delta" in second_events
            else:
                first, second = seen
            (call,) = [o for o in first.output if o.type == "function_call"]
            assert call.name == "calc" and json.loads(call.arguments) == {"expression": "2+3"}
            assert second.output_text == FINAL_TEXT and second.status == "completed"
            for r, turn in zip((first, second), detail.turns):
                assert r.usage.output_tokens == turn.num_tokens - turn.num_prompt_tokens
