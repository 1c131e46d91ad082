"""Demonstration transcripts and their ChatML text (the tokenizer corpus)."""

from __future__ import annotations

import pytest

from agent_rl import make
from agent_rl.sdk.demonstrations import render_chatml, run_text_episode
from agent_rl.sdk.messages import tool_message, user
from tests.sdk._corpus import corpus_samples, sample_texts


def test_chatml_gives_each_tool_message_its_own_turn_and_can_show_tools() -> None:
    msgs = [
        user("q"),
        {"role": "assistant", "content": "a"},
        tool_message("r1"),
        tool_message("r2"),
        {"role": "assistant", "content": "done"},
    ]
    assert render_chatml(msgs) == (
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nr2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\ndone<|im_end|>\n"
    )
    with_tools = render_chatml([user("q")], [{"type": "function", "function": {"name": "calc"}}])
    assert with_tools.startswith("<|im_start|>system\n# Tools") and '"name": "calc"' in with_tools


def test_sample_texts_are_deterministic_and_corpus_covers_every_builtin_env() -> None:
    texts = sample_texts("calculator", 3, seed=5)
    assert texts == sample_texts("calculator", 3, seed=5) and len(set(texts)) == 3
    assert all("<tool_call>" in t and "<tool_response>" in t for t in texts)
    host_only = list(corpus_samples(2, seed=0, include_sandbox_envs=False))  # 3 envs (long-tail)
    assert len(host_only) == 6 and any('"name":"search"' in t for t in host_only)
    # Sandbox envs run in real sandboxes of the configured backend (bubblewrap by default).
    corpus = list(corpus_samples(2, seed=0))
    assert len(corpus) == 10 and corpus[:2] == host_only[:2]
    for tool_name in ("calc", "search", "python"):
        assert any(f'"name":"{tool_name}"' in t for t in corpus)
    assert any("```python" in t for t in corpus)
    rendered = sample_texts("calculator", 2, seed=5, render=lambda m, t: f"{len(m)}:{t[0]['type']}")
    assert rendered == ["4:function", "4:function"]


@pytest.mark.anyio
async def test_text_episode_with_a_scripted_policy_records_malformed_calls_and_scores() -> None:
    script = iter(['<tool_call>{"name": "calc"', "<tool_call>[]</tool_call>", "nonsense"])

    async def policy(messages: list) -> str:
        return next(script)

    env = make("calculator")
    task = env.task_source().take(1)[0]
    t = await run_text_episode(env, task, policy)
    assert [m["role"] for m in t.messages] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert "never closed" in t.messages[2]["content"] and "JSON object" in t.messages[4]["content"]
    assert t.terminated and t.reward == 0.0 and len(t.steps[0].malformed) == 1


@pytest.mark.anyio
async def test_a_teacher_with_history_gets_its_parsed_turns_and_the_results() -> None:
    from agent_rl import Env, Task, tool
    from agent_rl.sdk.demonstrations import DemoTurn, run_demonstration
    from agent_rl.sdk.tool_calls import format_tool_call

    seen: list[list[DemoTurn]] = []

    class Lookup(Env):
        """Look a number up, then say it."""

        @tool
        def lookup(self, key: str) -> str:
            """The number stored under a key.

            Args:
                key: The key.
            """
            return str(len(key) * 7)

        def initial_messages(self, task: Task) -> list:
            return [user(f"What is stored under {task['key']}?")]

        async def score(self, answer: str) -> float:
            return float(answer == str(len(self.task["key"]) * 7))  # type: ignore[index]

        async def demonstrate(self, messages: list, history: list[DemoTurn]) -> str:
            seen.append(history)
            if not history:
                return format_tool_call("lookup", {"key": self.task["key"]})  # type: ignore[index]
            (call,) = history[-1].turn.tool_calls  # no re-parsing of its own text
            assert call.arguments == {"key": self.task["key"]}  # type: ignore[index]
            assert call.raw_arguments == '{"key":"%s"}' % self.task["key"]  # type: ignore[index]
            return history[-1].result.info.tool_results[0].output

    t = await run_demonstration(Lookup(), Task(id="0", data={"key": "abc"}))
    assert t.reward == 1.0 and t.completions()[-1] == "21"
    assert [len(h) for h in seen] == [0, 1]

    # A teacher without the parameter is called as before.
    env = make("calculator")
    task = env.task_source().take(1)[0]
    assert (await run_demonstration(env, task)).reward == 1.0
