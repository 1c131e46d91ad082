"""calculator: the demonstration scores full reward through the env; tool, reward and tasks."""

from __future__ import annotations

import random

import pytest

from agent_rl import make
from agent_rl.sdk.demonstrations import demonstrations, run_demonstration
from agent_rl.sdk.tool_calls import format_tool_call, parse_completion
from envs.calculator.env import calc, make_problem, safe_eval

pytestmark = pytest.mark.anyio


async def test_demonstration_scores_full_reward_in_the_ideal_format() -> None:
    transcripts = await demonstrations("calculator", 50, seed=7)
    assert all(t.reward == 1.0 and t.terminated and not t.truncated for t in transcripts)
    t = transcripts[0]
    expr, answer = t.task["expression"], t.task["answer"]
    assert t.completions() == [
        f'<tool_call>{{"name":"calc","arguments":{{"expression":"{expr}"}}}}</tool_call>',
        answer,
    ]
    assert [m["role"] for m in t.messages] == ["user", "assistant", "tool", "assistant"]
    assert t.messages[2]["content"] == answer
    assert t.steps[0].tool_results[0].output == answer and t.steps[1].reward is not None


def test_tasks_are_deterministic_per_seed_and_split() -> None:
    src = make("calculator").task_source()
    a, b = src.take(20, seed=1), src.take(20, seed=1)
    assert a == b and a != src.take(20, seed=2)
    assert make("calculator").task_source("eval").take(5, seed=1) != a[:5]
    for t in a:
        n_terms = sum(ch in "+-*" for ch in t["expression"]) + 1
        assert 2 <= n_terms <= 4 and safe_eval(t["expression"]) == int(t["answer"])
        assert t["expression"] in t["question"]


async def test_wrong_answers_and_bad_expressions() -> None:
    env = make("calculator")
    task = env.task_source().take(1)[0]
    await env.reset(task)
    bad = await env.step(
        parse_completion(format_tool_call("calc", {"expression": "__import__('os')"}))
    )
    assert bad.observations[0]["content"] == "error: bad expression"
    wrong = await env.step(parse_completion(str(int(task["answer"]) + 1)))
    assert wrong.terminated and wrong.reward == 0.0
    assert (await run_demonstration(make("calculator"), task)).reward == 1.0


def test_safe_eval_refuses_everything_but_integer_arithmetic() -> None:
    assert safe_eval("(2+3)*-4") == -20
    for expr in ("2**10", "1/2", "a+1", "9" * 70, "999999999*999999999*99999"):
        assert safe_eval(expr) is None
    rng = random.Random(0)
    assert make_problem(rng, min_terms=4, max_terms=4, max_digits=1)["expression"].count("+") <= 3


def test_schema_is_the_openai_shape() -> None:
    fn = calc.schema()["function"]
    assert fn["name"] == "calc" and fn["parameters"]["required"] == ["expression"]


async def test_imperfect_teacher_answers_directly_at_the_given_rate() -> None:
    transcripts = await demonstrations("calculator", 400, seed=3, env_kwargs={"teacher_tool_rate": 0.5})
    direct = [t for t in transcripts if len(t.completions()) == 1]
    assert 0.4 < len(direct) / len(transcripts) < 0.6
    # The teacher's mental math is right (full reward), in a form a student can imitate.
    assert all(t.reward == 1.0 for t in transcripts)
    assert all(t.completions()[0] == f"The answer is {t.task['answer']}." for t in direct)
    again = await demonstrations("calculator", 400, seed=3, env_kwargs={"teacher_tool_rate": 0.5})
    assert [t.completions() for t in again] == [t.completions() for t in transcripts]
    assert all(len(t.completions()) == 1 for t in await demonstrations("calculator", 20, env_kwargs={"teacher_tool_rate": 0.0}))
    with pytest.raises(Exception, match="teacher_tool_rate must be in"):
        make("calculator", teacher_tool_rate=1.5)


async def test_tools_in_prompt_false_hides_the_schema_but_the_tool_still_runs() -> None:
    transcripts = await demonstrations("calculator", 5, seed=1, env_kwargs={"tools_in_prompt": False})
    assert all(t.tools == [] and t.reward == 1.0 for t in transcripts)
    assert all(m["role"] == "tool" for t in transcripts for m in t.messages[2:3])
    assert (await demonstrations("calculator", 1, seed=1))[0].tools[0]["function"]["name"] == "calc"
