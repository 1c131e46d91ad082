"""python-math in a real bubblewrap sandbox: demonstrations, the python tool, the reward."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from agent_rl import EnvError, make
from agent_rl.sdk.demonstrations import demonstrations
from agent_rl.sdk.sandbox import Sandbox, SandboxSpec
from agent_rl.sdk.tool_calls import format_tool_call, parse_completion
from envs.python_math.env import FAMILIES

pytestmark = pytest.mark.anyio
Create = Callable[[SandboxSpec | None], Awaitable[Sandbox]]


async def test_demonstration_scores_full_reward_with_the_sandbox_output(
    sandbox_backend: Create,
) -> None:
    transcripts = await demonstrations("python-math", 16, seed=3, sandbox_factory=sandbox_backend)
    assert all(t.reward == 1.0 and t.terminated for t in transcripts)
    assert len({t.task["family"] for t in transcripts}) >= 5
    for t in transcripts:
        (result,) = t.steps[0].tool_results
        assert result.error is None and result.output.strip() == t.task["answer"]


async def test_python_tool_keeps_state_and_reports_errors(sandbox_backend: Create) -> None:
    env = make("python-math")
    task = env.task_source().take(1)[0]
    with pytest.raises(EnvError, match="needs a sandbox"):
        await env.reset(task)
    sandbox = await sandbox_backend(env.sandbox_spec)
    await env.reset(task, sandbox=sandbox)
    outputs = []
    for code in ("x = 41", "print(x + 1)", "6 * 7", "1/0"):
        r = await env.step(parse_completion(format_tool_call("python", {"code": code})))
        outputs.append(r.observations[0]["content"])
    assert outputs[:3] == ["[no output]", "42", "[result]\n42"]
    assert "ZeroDivisionError: division by zero" in outputs[3]
    missing = await env.step(parse_completion(format_tool_call("python", {"cmd": "1"})))
    (result,) = missing.info.tool_results
    assert result.error == "invalid_arguments"
    assert result.output == (
        "error: invalid arguments for python: code: Field required; "
        "cmd: Extra inputs are not permitted"
    )
    wrong = await env.step(parse_completion(str(int(task["answer"]) + 1)))
    assert wrong.terminated and wrong.reward == 0.0


def test_every_family_generates_a_consistent_problem() -> None:
    import random

    for name, family in FAMILIES.items():
        question, program, answer = family(random.Random(name))
        assert question.endswith("?") and "print(" in program and isinstance(answer, int)
