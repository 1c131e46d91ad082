"""`calculator`: 2-4 term integer arithmetic questions, a `calc` tool, exact-answer reward.

Designed so a sub-1M-parameter model can learn it on a CPU (the shared learning notes measured
this exact format): the question states the expression ("What is 37*48+12?"), the ideal first
turn copies it into one compact call
`<tool_call>{"name":"calc","arguments":{"expression":"37*48+12"}}</tool_call>`, the env answers
with the bare result, and the ideal second turn is the bare number ("1788"). The reward is 1
when the last integer of the final answer equals the true value, else 0.

Tasks are generated: task i of seed s is a pure function of (split, s, i). `teacher_tool_rate`
makes the demonstrations imperfect on purpose (the quickstart's warm start): the teacher answers
that fraction of questions with the tool and the rest directly.
"""

from __future__ import annotations

import ast
import random
import re
from typing import Any

from agent_rl.sdk.env import Env
from agent_rl.kernel.errors import ToolError
from agent_rl.sdk.messages import Message
from agent_rl.sdk.rewards import Reward, number_reward
from agent_rl.sdk.tasks import GeneratedTasks, TaskSource
from agent_rl.sdk.tool_calls import format_tool_call
from agent_rl.sdk.tools import tool

OPS = ("+", "-", "*")
TEMPLATES = ("What is {e}?", "Compute {e}.", "Calculate {e}", "Please evaluate {e}.")
MAX_EXPRESSION_CHARS = 64
MAX_MAGNITUDE = 10**15


def safe_eval(expression: str) -> int | None:
    """Value of integer arithmetic with + - * ( ); None for anything else (never `eval`)."""
    if len(expression) > MAX_EXPRESSION_CHARS or not re.fullmatch(r"[0-9+\-*() ]+", expression):
        return None
    try:
        return _eval(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        return None


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        a, b = _eval(node.left), _eval(node.right)
        r = (
            a + b
            if isinstance(node.op, ast.Add)
            else a - b
            if isinstance(node.op, ast.Sub)
            else a * b
        )
        if abs(r) > MAX_MAGNITUDE:
            raise ValueError("result too large")
        return r
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


@tool
def calc(expression: str) -> str:
    """Evaluate integer arithmetic with +, -, * and parentheses.

    Args:
        expression: The expression to evaluate, e.g. "37*48+12".
    """
    value = safe_eval(expression)
    if value is None:
        raise ToolError("bad expression")
    return str(value)


def make_problem(
    rng: random.Random, *, min_terms: int = 2, max_terms: int = 4, max_digits: int = 3
) -> dict[str, Any]:
    """One question: {"expression", "question", "answer"} (answer as a decimal string)."""
    parts: list[str] = []
    for i in range(rng.randint(min_terms, max_terms)):
        digits = rng.randint(1, max_digits)
        parts.append(str(rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)))
        if i:
            parts.insert(-1, rng.choice(OPS))
    expression = "".join(parts)
    value = safe_eval(expression)
    assert value is not None, expression  # generated from the grammar safe_eval accepts
    return {
        "expression": expression,
        "question": rng.choice(TEMPLATES).format(e=expression),
        "answer": str(value),
    }


class CalculatorEnv(Env):
    """Arithmetic word problems with a calc tool; reward 1 for the exact integer answer."""

    tools = (calc,)

    def __init__(
        self,
        *,
        min_terms: int = 2,
        max_terms: int = 4,
        max_digits: int = 3,
        max_turns: int | None = 4,
        teacher_tool_rate: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(max_turns=max_turns, **kwargs)
        if not 1 <= min_terms <= max_terms:
            raise ValueError(f"need 1 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
        if not 0.0 <= teacher_tool_rate <= 1.0:
            raise ValueError(f"teacher_tool_rate must be in [0, 1], got {teacher_tool_rate}")
        self.teacher_tool_rate = teacher_tool_rate
        self.problem_kwargs = {
            "min_terms": min_terms,
            "max_terms": max_terms,
            "max_digits": max_digits,
        }

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        return GeneratedTasks(
            "calculator", lambda rng: make_problem(rng, **self.problem_kwargs), split=split
        )

    async def score(self, answer: str) -> Reward:
        assert self.task is not None
        return number_reward(answer, self.task["answer"])

    async def demonstrate(self, messages: list[Message]) -> str:
        # First turn: copy the expression into one call. After the tool answered: repeat its result.
        # With teacher_tool_rate < 1 the teacher sometimes answers by mental math instead: right
        # for the teacher, but a small student imitating it cannot compute the product of 3-digit
        # numbers, so the warm start it gives leaves RL something to discover (the tool pays).
        assert self.task is not None
        last = messages[-1]
        if last["role"] != "tool":
            if self.rng.random() >= self.teacher_tool_rate:
                return f"The answer is {self.task['answer']}."
            return format_tool_call("calc", {"expression": self.task["expression"]})
        return last["content"].strip()
