"""`python-math`: number problems that are easy to program and tedious by hand (ReTool-style).

The model has one tool, `python`, a persistent interpreter in the episode's sandbox, and ends
with the number as its final message. Reward: 1 when the last number of the final answer equals
the true answer, else 0.

Tasks are generated from a handful of problem families; the true answer is computed here, on
the host, by this module's own code (never by running anything the model wrote). Each family
also writes the reference program the demonstration policy sends to the tool; the
demonstration then answers with what the sandbox printed, so a full-reward demonstration
proves the sandbox ran it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from agent_rl.sdk.env import Env
from agent_rl.sdk.messages import Message
from agent_rl.sdk.rewards import Reward, last_number, number_reward
from agent_rl.sdk.sandbox import Limits, SandboxSpec
from agent_rl.sdk.sandbox_tools import python_repl
from agent_rl.sdk.tasks import GeneratedTasks, TaskSource
from agent_rl.sdk.tool_calls import format_tool_call

Problem = tuple[str, str, int]  # question, reference program, answer


def _sum_multiples(rng: random.Random) -> Problem:
    n, a, b = rng.randint(50, 5000), rng.randint(2, 9), rng.randint(2, 13)
    q = f"What is the sum of all positive integers below {n} that are divisible by {a} or {b}?"
    code = f"print(sum(i for i in range(1, {n}) if i % {a} == 0 or i % {b} == 0))"
    return q, code, sum(i for i in range(1, n) if i % a == 0 or i % b == 0)


def _is_prime(k: int) -> bool:
    return k >= 2 and all(k % d for d in range(2, math.isqrt(k) + 1))


def _count_primes(rng: random.Random) -> Problem:
    n = rng.randint(30, 3000)
    q = f"How many prime numbers are there below {n}?"
    code = f"print(sum(all(k % d for d in range(2, int(k ** 0.5) + 1)) for k in range(2, {n})))"
    return q, code, sum(_is_prime(k) for k in range(2, n))


def _power_mod(rng: random.Random) -> Problem:
    a, b, m = rng.randint(2, 99), rng.randint(10, 500), rng.randint(7, 1000)
    q = f"What is the remainder when {a} to the power {b} is divided by {m}?"
    return q, f"print(pow({a}, {b}, {m}))", pow(a, b, m)


def _fibonacci(rng: random.Random) -> Problem:
    n = rng.randint(10, 90)
    a, b = 1, 1
    for _ in range(n - 2):
        a, b = b, a + b
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    q = f"What is the {n}{suffix} Fibonacci number, if the first two are 1 and 1?"
    code = f"a, b = 1, 1\nfor _ in range({n} - 2):\n    a, b = b, a + b\nprint(b)"
    return q, code, b


def _digit_sum(rng: random.Random) -> Problem:
    a, b = rng.randint(2, 19), rng.randint(10, 80)
    q = f"What is the sum of the digits of {a} to the power {b}?"
    return q, f"print(sum(int(d) for d in str({a} ** {b})))", sum(int(d) for d in str(a**b))


def _lcm(rng: random.Random) -> Problem:
    a, b, c = (rng.randint(2, 60) for _ in range(3))
    q = f"What is the least common multiple of {a}, {b} and {c}?"
    return q, f"import math\nprint(math.lcm({a}, {b}, {c}))", math.lcm(a, b, c)


def _collatz(rng: random.Random) -> Problem:
    n = rng.randint(3, 10_000)
    steps, k = 0, n
    while k != 1:
        k, steps = (k // 2 if k % 2 == 0 else 3 * k + 1), steps + 1
    q = f"How many steps does the Collatz sequence starting at {n} take to reach 1?"
    code = (f"n, steps = {n}, 0\nwhile n != 1:\n    n = n // 2 if n % 2 == 0 else 3 * n + 1\n"
            "    steps += 1\nprint(steps)")  # fmt: skip
    return q, code, steps


FAMILIES: dict[str, Callable[[random.Random], Problem]] = {
    "sum_multiples": _sum_multiples, "count_primes": _count_primes, "power_mod": _power_mod,
    "fibonacci": _fibonacci, "digit_sum": _digit_sum, "lcm": _lcm, "collatz": _collatz,
}  # fmt: skip


def make_problem(rng: random.Random) -> dict[str, Any]:
    family = rng.choice(sorted(FAMILIES))
    question, code, answer = FAMILIES[family](rng)
    return {"family": family, "question": question, "program": code, "answer": str(answer)}


class PythonMathEnv(Env):
    """Math problems solved with a sandboxed Python interpreter; exact numeric reward."""

    tools = (python_repl,)
    sandbox_spec = SandboxSpec(limits=Limits(wall_s=10.0, cpu_s=10, memory_mb=256, disk_mb=64, tmp_mb=32))

    def __init__(self, *, max_turns: int | None = 6, **kwargs: Any) -> None:
        super().__init__(max_turns=max_turns, **kwargs)

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        return GeneratedTasks("python-math", make_problem, split=split)

    async def score(self, answer: str) -> Reward:
        assert self.task is not None
        return number_reward(answer, self.task["answer"])

    async def demonstrate(self, messages: list[Message]) -> str:
        # Run the reference program, then answer with the number the sandbox printed.
        assert self.task is not None
        if messages[-1]["role"] != "tool":
            return format_tool_call("python", {"code": self.task["program"]})
        return last_number(messages[-1]["content"]) or messages[-1]["content"].strip()
