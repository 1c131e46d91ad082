"""The gateway's limits and failures, each ending its episode in exactly one recorded state:
an agent that raises or a command that exits non-zero fails it with the traceback or stderr;
spent turn and token budgets answer 400 and end it truncated; the deadline cuts it; malformed
requests get OpenAI-shaped 400s; a wrong key reaches nothing; a call after the end gets 409;
a call is answered before its turn commits, and every turn lands.
Real serve, real SGLang engine (the session's), the official openai client and raw HTTP."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from agent_rl.sdk.agent import AgentEnv
from agent_rl.sdk.registry import register
from agent_rl.rollout import gateway
from agent_rl.rollout.agent_runner import run_command
from agent_rl.rollout.render import ChatRenderer
from agent_rl.app.serve import serve
from agent_rl.store import Store
from agent_rl.store.base import StoreFault
from agent_rl.sdk.tasks import ListTasks, Task, TaskSource
from tests.rollout.conftest import serve_config
from tests.rollout.gateway_helpers import QUESTION, Tap, check_agent_episode

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

KEYS: list[tuple[str, str]] = []
OUTCOMES: dict[str, Any] = {}


class _Agent(AgentEnv):
    def builtin_tasks(self, split: str = "train") -> TaskSource:
        return ListTasks([Task(id="q", data={"question": QUESTION})])

    async def score(self, task: Task, result: Any, transcript: list[dict[str, Any]]) -> float:
        return 1.0

    async def ask(self, base_url: str, api_key: str, **kwargs: Any) -> Any:
        # Every client is closed inside the test that made it: one left to the garbage
        # collector closes its connections on a later test's event loop, which fails that test.
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            return await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": QUESTION}], **kwargs)


@register("test-agent-raises")
class RaisesAgent(_Agent):
    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        await self.ask(base_url, api_key)
        raise ValueError("the agent's own bug")


@register("test-agent-exits")
class ExitsAgent(_Agent):
    command = (sys.executable, "-c", "import sys; sys.stderr.write('agent broke down\\n'); sys.exit(3)")


@register("test-agent-turns")
class TurnBudgetAgent(_Agent):
    """Calls until refused, then gives up by raising what the client raised."""

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        try:
            for _ in range(5):
                await self.ask(base_url, api_key)
        except openai.BadRequestError as e:
            OUTCOMES.setdefault("turns", []).append(e)
            raise
        return "never refused"


@register("test-agent-tokens")
class TokenBudgetAgent(_Agent):
    """Catches the refusal and returns normally: the episode is truncated all the same."""

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        first = await self.ask(base_url, api_key)
        messages = [{"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "Go on."}]  # fmt: skip
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            try:
                await client.chat.completions.create(model="policy", messages=messages)  # type: ignore[arg-type]
            except openai.BadRequestError as e:
                OUTCOMES.setdefault("tokens", []).append((first, e))
        return "5"


@register("test-agent-malformed")
class MalformedAgent(_Agent):
    """Raw HTTP with what a client must not send, and keys that are not its own."""

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        KEYS.append((base_url, api_key))
        auth = {"Authorization": f"Bearer {api_key}"}
        good = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        answers = {}
        async with httpx.AsyncClient(timeout=60) as http:
            url = f"{base_url}/chat/completions"
            answers["not json"] = await http.post(url, content=b"{not json", headers=auth)
            answers["n=2"] = await http.post(url, json={**good, "n": 2}, headers=auth)
            answers["no messages"] = await http.post(url, json={**good, "messages": []}, headers=auth)
            answers["bad role"] = await http.post(url, json={**good, "messages": [{"role": "wizard", "content": "x"}]},
                                                  headers=auth)  # fmt: skip
            answers["temperature"] = await http.post(url, json={**good, "temperature": 9}, headers=auth)
            answers["image"] = await http.post(url, json={**good, "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, headers=auth)
            answers["wrong key"] = await http.post(url, json=good, headers={"Authorization": "Bearer nope"})
            answers["no key"] = await http.post(url, json=good)
            unknown = base_url.replace(api_key, "ep0-unknown")
            answers["unknown episode"] = await http.post(f"{unknown}/chat/completions", json=good, headers=auth)
            with anyio.fail_after(60):  # the other episode of the group runs beside this one
                while len([k for _, k in KEYS if k != api_key]) < 1:
                    await anyio.sleep(0.05)
            other_url, _ = next((u, k) for u, k in reversed(KEYS) if k != api_key)
            answers["other episode"] = await http.post(f"{other_url}/chat/completions", json=good, headers=auth)
            answers["good"] = await http.post(url, json=good, headers=auth)
        OUTCOMES.setdefault("malformed", []).append(answers)
        return "5"


@register("test-agent-deadline")
class DeadlineAgent(_Agent):
    """The first episode calls once and then hangs past the deadline; the next one calls the
    first one's endpoint (ended: 409), then its own."""

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        earlier = list(KEYS)
        KEYS.append((base_url, api_key))
        await self.ask(base_url, api_key, max_tokens=4)
        if not earlier:
            await anyio.sleep(3600)
        old_url, old_key = earlier[-1]
        try:
            await self.ask(old_url, old_key, max_tokens=4)
        except openai.APIStatusError as e:
            OUTCOMES["late"] = e
        return "5"


async def _run(tmp_path: Path, url: str, model: Path, env: str, episodes: int = 2, **rollout: Any):  # type: ignore[no-untyped-def]
    rollout.setdefault("max_new_tokens", 16)
    cfg = serve_config(f"sqlite:///{tmp_path / 'store.db'}", url, model, env=env, **rollout)
    summary = await serve(cfg, max_episodes=episodes)
    assert summary.admitted == episodes and summary.run_ledger.balances()
    assert summary.run_ledger.running == summary.run_ledger.waiting == 0
    async with await Store.open(cfg.store) as store:
        episodes_ = await store.list_episodes(run_id=summary.run_id)
        audit = await store.audit(summary.run_id)
    assert audit.problems() == [], audit.problems()
    return cfg, episodes_


async def test_an_agent_that_raises_fails_its_episode_with_the_traceback(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path
) -> None:
    _, episodes = await _run(tmp_path, sglang_moe_server.url, tiny_moe_model, "test-agent-raises")
    for e in episodes:
        assert (e.status, e.error_type, e.reward) == ("failed", "EnvError", None)
        assert "ValueError: the agent's own bug" in e.error_cause and "Traceback" in e.error_cause
        assert e.num_turns == 1  # its call was recorded before it failed


async def test_a_command_that_exits_non_zero_fails_with_its_stderr(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path
) -> None:
    _, episodes = await _run(tmp_path, sglang_moe_server.url, tiny_moe_model, "test-agent-exits")
    for e in episodes:
        assert (e.status, e.error_type) == ("failed", "EnvError")
        assert "exited with status 3" in e.error_cause and "agent broke down" in e.error_cause


async def test_a_command_that_exits_before_reading_its_task_reports_its_own_status() -> None:
    """The task goes to the command's stdin; one that exits without reading it (here 4 MB, more
    than a pipe holds, so the write surely meets the closed pipe) fails by its exit status and
    stderr, not by the broken pipe (anyio's run_process raised an ExceptionGroup there, and the
    episode above was sometimes recorded with it)."""
    exits = [sys.executable, "-c", "import sys; sys.stderr.write('gone'); sys.exit(3)"]
    status, out, err = await run_command(exits, b"x" * (4 << 20), dict(os.environ))
    assert (status, out, err) == (3, b"", b"gone")
    echo = [sys.executable, "-c", "import sys; sys.stdout.write(sys.stdin.read()[-3:])"]
    assert await run_command(echo, b"task" * 100_000, dict(os.environ)) == (0, b"ask", b"")


async def test_the_turn_budget_answers_400_and_truncates(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path
) -> None:
    OUTCOMES.clear()
    _, episodes = await _run(tmp_path, sglang_moe_server.url, tiny_moe_model, "test-agent-turns", max_turns=2)
    for e in episodes:
        assert e.status in ("completed", "filtered") and e.reward == 0.0
        assert e.reward_details["truncated"] == "max_turns" and e.num_turns == 2
    for refusal in OUTCOMES["turns"]:
        assert refusal.status_code == 400 and refusal.code == "budget_exhausted"
        assert "rollout.max_turns = 2" in refusal.message


async def test_the_token_budget_ends_a_call_with_length_then_refuses(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path
) -> None:
    OUTCOMES.clear()
    renderer = ChatRenderer(tiny_moe_model)
    prompt = len(renderer.encode(renderer.render([{"role": "user", "content": QUESTION}], [])))
    async with Tap(sglang_moe_server.url).running() as tap:
        cfg, episodes = await _run(tmp_path, tap.url, tiny_moe_model, "test-agent-tokens",
                                   max_tokens=prompt + 6, max_new_tokens=48)
        async with await Store.open(cfg.store) as store:
            for e in episodes:
                assert e.status in ("completed", "filtered") and e.reward == 0.0
                assert e.reward_details["truncated"] == "max_tokens"
                assert e.num_turns == 1 and e.num_tokens <= prompt + 6
                await check_agent_episode(store, renderer, tap, e.id, [])
    for first, refusal in OUTCOMES["tokens"]:
        # Never past the budget: cut at it (`length`), or ended by the model within it.
        assert first.usage.total_tokens <= prompt + 6
        assert first.choices[0].finish_reason in ("length", "stop")
        assert first.choices[0].finish_reason == "stop" or first.usage.total_tokens == prompt + 6
        assert refusal.status_code == 400 and "rollout.max_tokens" in refusal.message


async def test_malformed_requests_and_other_keys_are_refused_in_openai_shape(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path
) -> None:
    OUTCOMES.clear()
    KEYS.clear()
    _, episodes = await _run(tmp_path, sglang_moe_server.url, tiny_moe_model, "test-agent-malformed")
    assert all(e.status in ("completed", "filtered") and e.num_turns == 1 for e in episodes)
    expected = {"not json": 400, "n=2": 400, "no messages": 400, "bad role": 400, "temperature": 400,
                "image": 400, "wrong key": 401, "no key": 401, "unknown episode": 404,
                "other episode": 401, "good": 200}  # fmt: skip
    for answers in OUTCOMES["malformed"]:
        assert {k: r.status_code for k, r in answers.items()} == expected
        for name, r in answers.items():
            if name != "good":
                error = r.json()["error"]
                assert error["message"] and error["type"] and set(error) == {"message", "type", "param", "code"}
        assert answers["n=2"].json()["error"]["param"] == "n"
        assert answers["good"].json()["choices"][0]["message"]["role"] == "assistant"


async def test_the_deadline_truncates_and_a_late_call_gets_409(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path
) -> None:
    OUTCOMES.clear()
    KEYS.clear()
    _, episodes = await _run(tmp_path, sglang_moe_server.url, tiny_moe_model, "test-agent-deadline",
                             group_size=1, max_concurrent_episodes=1, episode_timeout_s=4.0)
    first, second = sorted(episodes, key=lambda e: e.id)
    assert first.status == "completed" and first.reward == 0.0
    assert first.reward_details["truncated"] == "deadline" and first.num_turns == 1
    assert second.status == "completed" and second.reward == 1.0 and second.num_turns == 1
    late = OUTCOMES["late"]
    assert late.status_code == 409 and late.code == "episode_ended"


@register("test-agent-rewrites")
class RewritingAgent(_Agent):
    """Call 1, then a rewritten history (the system prompt and the answer dropped, the question
    summarised), then a call that extends the rewritten one."""

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            ask = lambda m: client.chat.completions.create(model="policy", messages=m, max_tokens=8)  # noqa: E731
            await ask([{"role": "system", "content": "Be terse."}, {"role": "user", "content": QUESTION}])
            rewritten = [{"role": "user", "content": f"Summary: I asked {QUESTION}"}, {"role": "user", "content": "Answer."}]
            second = await ask(rewritten)
            await ask([*rewritten, {"role": "assistant", "content": second.choices[0].message.content},
                       {"role": "user", "content": "Sure?"}])
        return "5"


async def test_a_rewritten_history_starts_a_new_segment(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path
) -> None:
    """The rewrite is a fresh prompt that the engine sees alone (not after the first
    segment's tokens); the call after it extends the new segment; both are counted, and the
    trainer reads each segment as a sequence of its own, replays the engine's routed experts on
    it (routing mismatch reported) and scores its tokens as the engine did."""
    from agent_rl.config import TrainerConfig
    from trainer.data import load_batch
    from trainer.learner import learner

    renderer = ChatRenderer(tiny_moe_model)
    async with Tap(sglang_moe_server.url).running() as tap:
        cfg, episodes = await _run(tmp_path, tap.url, tiny_moe_model, "test-agent-rewrites",
                                   filter_zero_variance=False)
    async with await Store.open(cfg.store) as store:
        for e in episodes:
            assert e.status == "completed" and e.num_turns == 3, e.error_cause
            assert (e.reward_details["segments"], e.reward_details["rewrites"]) == (2, 1)
            detail = await store.get_episode(e.id)
            assert [t.segment for t in detail.turns] == [0, 1, 1]
            ids = (await store.episode_tokens(e.id)).token_ids.tolist()
            first, second, third = detail.turns
            fresh = renderer.encode(renderer.render(
                [{"role": "user", "content": f"Summary: I asked {QUESTION}"}, {"role": "user", "content": "Answer."}], []))
            assert ids[second.span_start: second.span_start + second.num_prompt_tokens] == fresh
            # What the engine saw for each call: its segment only, from the segment's start.
            for turn, start in ((first, 0), (second, second.span_start), (third, second.span_start)):
                prompt = ids[start: turn.span_start + turn.num_prompt_tokens]
                completion = ids[turn.span_start + turn.num_prompt_tokens: turn.span_start + turn.num_tokens]
                assert completion in tap.outputs_for(prompt)
            assert len(tap.outputs_for(ids[: second.span_start + second.num_prompt_tokens])) == 0
        # Training reads each segment as a sequence of its own, with its routed experts.
        claim = await store.claim(episodes[0].run_id, "trainer", 1)
        data = await load_batch(store, claim, version=1)
        assert data.row_episodes == [e for e in claim.episode_ids for _ in range(2)]
        for row, eid in enumerate(data.row_episodes):
            stream = await store.episode_tokens(eid)
            cut = (await store.get_episode(eid)).turns[1].span_start
            part = stream.token_ids[:cut] if row % 2 == 0 else stream.token_ids[cut:]
            assert data.batch.tokens[row, : len(part)].tolist() == part.tolist()
        assert data.batch.routed_experts is not None
    # The trainer replays the engine's experts on both segments and scores them as the engine did.
    with learner(tiny_moe_model, TrainerConfig(micro_batch_size=4, routing_replay=True)) as e:
        ours = e.logprobs(data.batch)["logprobs"]
        mask = data.batch.loss_mask
        diff = float(((ours - data.batch.rollout_logprobs).abs() * mask).sum() / mask.sum())
        metrics = e.rl_step(data.batch)
    assert diff <= 1e-4, f"trainer vs engine logprobs differ by {diff:.2e} on average"
    assert metrics["routing_mismatch_fraction"] <= 0.02 and metrics["update_ok"] == 1.0


SANDBOXED_AGENT = r"""
import json, os, socket, sys, urllib.request
task = json.loads(sys.stdin.read())
# Nothing but the relay leads out: the engine's port on the host is not reachable.
host, port = os.environ["HOST_ENGINE"].rsplit(":", 1)
try:
    socket.create_connection((host, int(port)), timeout=2).close()
    reached = True
except OSError:
    reached = False
body = {"model": "policy", "messages": [{"role": "user", "content": task["data"]["question"]}],
        "max_tokens": 8}
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                                 data=json.dumps(body).encode(), headers={
                                     "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                     "Content-Type": "application/json"})
answer = json.load(urllib.request.urlopen(request, timeout=60))
print(json.dumps({"reached_engine": reached, "in_sandbox": os.getcwd(),
                  "content": answer["choices"][0]["message"]["content"]}))
"""


@register("test-agent-sandboxed")
class SandboxedAgent(_Agent):
    """A stdlib-only agent command run in the episode's sandbox (bubblewrap)."""

    command = ("python3", "-c", SANDBOXED_AGENT)
    command_in_sandbox = True

    async def score(self, task: Task, result: Any, transcript: list[dict[str, Any]]) -> float:
        OUTCOMES["sandboxed"] = json.loads(result)
        return 1.0


async def test_a_command_in_its_sandbox_reaches_the_gateway_and_nothing_else(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`command_in_sandbox`: the command runs in the episode's bubblewrap sandbox (no network),
    its OpenAI calls go through the relay socket it is given and are recorded token for token
    like any agent's, and the engine's own port is out of its reach."""
    engine = sglang_moe_server.url.removeprefix("http://")
    monkeypatch.setattr(SandboxedAgent, "command_env", {"HOST_ENGINE": engine})
    renderer = ChatRenderer(tiny_moe_model)
    async with Tap(sglang_moe_server.url).running() as tap:
        cfg, episodes = await _run(tmp_path, tap.url, tiny_moe_model, "test-agent-sandboxed")
        async with await Store.open(cfg.store) as store:
            for e in episodes:
                assert e.status in ("completed", "filtered") and e.reward == 1.0, e.error_cause
                assert e.num_turns == 1
                await check_agent_episode(store, renderer, tap, e.id, [])
    seen = OUTCOMES["sandboxed"]
    assert seen["reached_engine"] is False and seen["in_sandbox"] == "/work"
    assert isinstance(seen["content"], str)


# A short arithmetic expression: the random-init policy left free inside a string fills any
# budget, and writes bytes (control characters, halves of UTF-8 sequences) that JSON parsing
# refuses though the grammar's string admits them.
SHORT_CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string", "pattern": "^[0-9+*-]{1,4}$"}},
    "required": ["expression"], "additionalProperties": False}}}


@register("test-agent-tool-choice")
class ToolChoiceAgent(_Agent):
    """Forces a call of `calc` by name, then any tool ("required"), then names a tool it did
    not pass."""

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            messages = [{"role": "user", "content": QUESTION}]
            for choice in ({"type": "function", "function": {"name": "calc"}}, "required"):
                answer = await client.chat.completions.create(
                    model="policy", messages=messages, tools=[SHORT_CALC], tool_choice=choice, max_tokens=96)
                OUTCOMES.setdefault("forced", []).append(answer.choices[0])
                message = answer.choices[0].message
                messages += [message.model_dump(exclude_none=True)] + [
                    {"role": "tool", "tool_call_id": c.id, "content": "7"} for c in message.tool_calls or []]
            try:
                await client.chat.completions.create(
                    model="policy", messages=messages, tools=[SHORT_CALC],
                    tool_choice={"type": "function", "function": {"name": "search"}})
            except openai.BadRequestError as e:
                OUTCOMES["unknown_tool"] = e
        return "done"


async def test_tool_choice_forces_a_call_of_the_named_or_any_tool(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path
) -> None:
    """tool_choice "required" or a named function is enforced by the engine's constrained
    decoding: the random-init policy, which on its own writes no tool calls, answers with a
    well-formed call of that tool whose arguments fit its schema, recorded token for token; a
    choice of a tool the request does not pass is a 400 in OpenAI's shape."""
    OUTCOMES.pop("forced", None)
    renderer = ChatRenderer(tiny_moe_model)
    async with Tap(sglang_moe_server.url).running() as tap:
        cfg, episodes = await _run(tmp_path, tap.url, tiny_moe_model, "test-agent-tool-choice",
                                   episodes=1, group_size=1, max_new_tokens=96)
        async with await Store.open(cfg.store) as store:
            (e,) = episodes
            assert e.status in ("completed", "filtered") and e.num_turns == 2, e.error_cause
            detail = await store.get_episode(e.id)
            calls = [c for c in detail.tool_calls if c["status"] == "ok"]
            assert calls[0]["turn_index"] == 0 and [c["name"] for c in calls][:2] == ["calc", "calc"], detail.tool_calls
            await check_agent_episode(store, renderer, tap, e.id, [SHORT_CALC])
    named, required = OUTCOMES["forced"]
    (call,) = named.message.tool_calls or []  # a named function: called once, then the end
    assert named.finish_reason == "tool_calls"
    assert required.message.tool_calls, required.message  # "required": at least one call
    for call in [*named.message.tool_calls, *required.message.tool_calls]:
        assert call.function.name == "calc"
        assert len(json.loads(call.function.arguments)["expression"]) <= 4
    bad = OUTCOMES["unknown_tool"]
    assert bad.status_code == 400 and "search" in bad.message and bad.body["param"] == "tool_choice"


@register("test-agent-commits")
class CommitsAgent(_Agent):
    """Two calls, the second extending the first; looks at the store after each."""

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        episode_id = int(api_key.removeprefix("ep").split("-")[0])  # the key names its episode
        stored = []
        messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client, \
                await Store.open(OUTCOMES["store"]) as store:  # fmt: skip
            for k in range(2):
                if k:  # the second extends the first
                    messages += [answer.choices[0].message.model_dump(exclude_none=True),
                                 {"role": "user", "content": "And 2+2?"}]  # fmt: skip
                answer = await client.chat.completions.create(model="policy", messages=messages)
                stored.append(len((await store.get_episode(episode_id)).turns))
        OUTCOMES["commits"] = stored
        return "done"


@pytest.mark.parametrize(("write_s", "held_tokens", "stored"),
                         [(0.0, gateway.HELD_TOKENS, [0, 1]), (60.0, gateway.HELD_TOKENS, [0, 0]),
                          (60.0, 1, [0, 1])])  # fmt: skip
async def test_a_call_is_answered_before_its_turn_commits_and_every_turn_lands(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path, monkeypatch: pytest.MonkeyPatch,
    write_s: float, held_tokens: int, stored: list[int],
) -> None:
    """A call's turn is written during a later call (the agent does not wait for the store),
    the last ones when the episode closes. With `rollout.gateway_write_s = 0`, during the next
    call: after the first answer nothing is stored, after the second the first turn is. Held
    for longer than the episode lasts, nothing is stored before its end, unless the held turns
    reach `HELD_TOKENS`. Either way the ended episode holds both, token for token."""
    monkeypatch.setattr(gateway, "HELD_TOKENS", held_tokens)
    OUTCOMES["store"] = serve_config(f"sqlite:///{tmp_path / 'store.db'}", sglang_moe_server.url,
                                     tiny_moe_model, env="test-agent-commits").store  # fmt: skip
    renderer = ChatRenderer(tiny_moe_model)
    async with Tap(sglang_moe_server.url).running() as tap:
        cfg, episodes = await _run(tmp_path, tap.url, tiny_moe_model, "test-agent-commits",
                                   episodes=1, group_size=1, gateway_write_s=write_s)
        (e,) = episodes
        assert e.status in ("completed", "filtered") and e.num_turns == 2, e.error_cause
        assert OUTCOMES["commits"] == stored
        async with await Store.open(cfg.store) as store:
            await check_agent_episode(store, renderer, tap, e.id, [])


@register("test-agent-write-fails")
class WriteFailsAgent(_Agent):
    """Three calls, each extending the one before (streamed with `stream`); a call that fails
    is made again."""

    stream = False

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
        failed = []
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            for k in range(3):
                for _ in range(2):
                    try:
                        if self.stream:
                            chunks = await client.chat.completions.create(model="policy", messages=messages, stream=True)
                            content = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
                            reply = {"role": "assistant", "content": content}
                        else:
                            answer = await client.chat.completions.create(model="policy", messages=messages)
                            reply = answer.choices[0].message.model_dump(exclude_none=True)
                        break
                    except openai.InternalServerError as e:
                        failed.append((k, e.status_code, e.body["code"], e.body["type"]))  # type: ignore[index]
                messages += [reply, {"role": "user", "content": f"And {k}+{k}?"}]
        OUTCOMES["failed"] = failed
        return "done"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_held_write_that_fails_fails_its_call_and_its_turns_land_later(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """The held turns' write that fails (injected: the store refuses it once) fails the call it
    ran in with a 503 in OpenAI's shape (before any byte of a stream), which leaves the episode
    as it was; the turns stay held, so the next write takes them, and the ended episode holds
    every kept call, token for token."""
    append_turns = Store.append_turns
    attempts: list[int] = []

    async def refuse_once(self: Store, episode_id: int, turns: Any, **kwargs: Any) -> int:
        attempts.append(len(turns))
        if len(attempts) == 1:
            raise StoreFault("injected: the database refused the write", transient=False)
        return await append_turns(self, episode_id, turns, **kwargs)

    monkeypatch.setattr(Store, "append_turns", refuse_once)
    monkeypatch.setattr(WriteFailsAgent, "stream", stream)
    renderer = ChatRenderer(tiny_moe_model)
    async with Tap(sglang_moe_server.url).running() as tap:
        cfg, episodes = await _run(tmp_path, tap.url, tiny_moe_model, "test-agent-write-fails",
                                   episodes=1, group_size=1, gateway_write_s=0.0)
        (e,) = episodes
        assert e.status in ("completed", "filtered") and e.num_turns == 3, e.error_cause
        # The second call, in which the first turn's write ran.
        assert OUTCOMES["failed"] == [(1, 503, "store_unavailable", "server_error")]
        assert attempts == [1, 1, 1]  # the first turn, again (the second call made again), the second
        async with await Store.open(cfg.store) as store:
            await check_agent_episode(store, renderer, tap, e.id, [])


async def test_max_tokens_is_the_episodes_budget_across_segments(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path
) -> None:
    """`rollout.max_tokens` bounds what the episode stores and trains, all its segments
    together: a rewrite starts a new segment, not a new budget."""
    renderer = ChatRenderer(tiny_moe_model)
    first = renderer.encode(renderer.render([{"role": "system", "content": "Be terse."}, {"role": "user", "content": QUESTION}], []))
    second = renderer.encode(renderer.render(
        [{"role": "user", "content": f"Summary: I asked {QUESTION}"}, {"role": "user", "content": "Answer."}], []))
    budget = len(first) + len(second) + 10
    _, episodes = await _run(tmp_path, sglang_moe_server.url, tiny_moe_model, "test-agent-rewrites",
                             max_tokens=budget, temperature=1.0)
    for e in episodes:
        assert e.num_tokens <= budget, (e.num_tokens, budget)
        assert e.status in ("completed", "filtered") and e.reward_details["truncated"] == "max_tokens"
        assert e.reward_details["segments"] == 2


async def test_a_first_call_refused_for_its_budget_leaves_nothing_to_train_on(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path
) -> None:
    """The zero-turn case as documented: a prompt over `rollout.max_tokens` is refused (400)
    and the episode fails with nothing to train on, not completed with no turn."""
    renderer = ChatRenderer(tiny_moe_model)
    prompt = renderer.encode(renderer.render([{"role": "system", "content": "Be terse."}, {"role": "user", "content": QUESTION}], []))
    assert len(prompt) > 16  # the smallest budget the config allows
    _, episodes = await _run(tmp_path, sglang_moe_server.url, tiny_moe_model, "test-agent-rewrites", max_tokens=16)
    for e in episodes:
        assert (e.status, e.error_type, e.num_turns) == ("failed", "EnvError", 0)
        assert "nothing to train on" in e.error_cause and "max_tokens" in e.error_cause


@pytest.mark.parametrize("env", ["calculator-agent-anthropic", "calculator-agent-responses"])
async def test_the_example_agents_in_the_other_dialects_are_recorded_token_for_token(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path, env: str
) -> None:
    """envs/calculator_agent/dialects.py: the calculator agent written with Anthropic's client
    and with `responses.create` runs through serve, every call a turn of the engine's own
    tokens (the random policy answers without calling its tool)."""
    from envs.calculator_agent.agent import CALC

    renderer = ChatRenderer(tiny_moe_model)
    async with Tap(sglang_moe_server.url).running() as tap:
        cfg, episodes = await _run(tmp_path, tap.url, tiny_moe_model, env)
        async with await Store.open(cfg.store) as store:
            for e in episodes:
                assert e.status in ("completed", "filtered") and e.num_turns >= 1, e.error_cause
                await check_agent_episode(store, renderer, tap, e.id, [CALC])
