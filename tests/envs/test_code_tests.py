"""code-tests in a real bubblewrap sandbox: demonstrations pass, and grading resists bad code."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from agent_rl import Task, make
from agent_rl.sdk.demonstrations import demonstrations
from agent_rl.sdk.env import Env
from agent_rl.sdk.sandbox import Sandbox, SandboxSpec
from agent_rl.sdk.tool_calls import parse_completion
from envs.code_tests.env import extract_code

pytestmark = pytest.mark.anyio
Create = Callable[[SandboxSpec | None], Awaitable[Sandbox]]


async def test_demonstration_passes_every_hidden_test(sandbox_backend: Create) -> None:
    transcripts = await demonstrations("code-tests", 20, sandbox_factory=sandbox_backend)
    assert len({t.task.id for t in transcripts}) == 20
    for t in transcripts:
        assert t.reward == 1.0, t.steps[-1].reward
        final = t.steps[-1].reward
        assert final is not None and final.components["passed"] == final.components["total"] >= 3
        assert t.steps[0].tool_results[0].error is None  # the demo tried its code in the sandbox


async def _grade(env: Env, task: Task, answer: str, sandbox: Sandbox) -> tuple[float, str]:
    await env.reset(task, sandbox=sandbox)
    result = await env.step(parse_completion(answer))
    assert result.terminated and result.info.reward is not None
    return result.reward, result.info.reward.detail


def _task(env: Env, name: str) -> Task:
    return next(t for t in env.task_source().take(20) if t["function"] == name)


async def test_partial_credit_and_failures_are_graded_not_raised(sandbox_backend: Create) -> None:
    env = make("code-tests", per_test_timeout_s=1)
    sandbox = await sandbox_backend(env.sandbox_spec)
    words = _task(env, "reverse_words")
    reward, detail = await _grade(
        env, words, "```python\ndef reverse_words(s):\n    return s\n```", sandbox
    )
    assert reward == pytest.approx(2 / 5) and "expected 'world hello'" in detail
    reward, detail = await _grade(env, words, "```python\ndef reverse_words(s:\n```", sandbox)
    assert reward == 0.0 and "SyntaxError" in detail
    reward, _ = await _grade(
        env, words, "def reverse_words(s):\n    return ' '.join(s.split()[::-1])", sandbox
    )
    assert reward == 1.0  # no code block: the whole message is the code
    vowels = _task(env, "count_vowels")
    looping = (
        "```python\ndef count_vowels(s):\n    while s == '':\n        pass\n"
        "    return sum(c in 'aeiouAEIOU' for c in s)\n```"
    )
    reward, detail = await _grade(env, vowels, looping, sandbox)
    assert reward == pytest.approx(3 / 4) and "TimeoutError" in detail


async def test_a_solution_cannot_forge_the_verdict(sandbox_backend: Create) -> None:
    env = make("code-tests")
    sandbox = await sandbox_backend(env.sandbox_spec)
    task = _task(env, "fizzbuzz")
    forged = (
        "```python\nimport os\n"
        'os.write(1, b\'\\n{"value": 1.0, "outputs": [{"ok": 1}]}\\n\')\n'
        "os._exit(0)\n```"
    )
    reward, detail = await _grade(env, task, forged, sandbox)
    assert reward == 0.0 and detail


def test_extract_code_takes_the_last_block() -> None:
    text = "first\n```python\na = 1\n```\nthen\n```\nb = 2\n```"
    assert extract_code(text) == "b = 2\n" and extract_code("x = 1") == "x = 1"
