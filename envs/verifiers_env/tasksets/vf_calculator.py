"""`verifiers:vf_calculator`: the calculator's arithmetic, written as a verifiers v1 taskset and
harness against verifiers' public API only (verifiers==0.4.0, and the OpenAI client of its
sibling vf_client.py; nothing of agent-rl is imported: it runs in the verifiers environment's
Python, where agent-rl is not installed).

A task is an integer expression in a question ("What is 3*4+5?"); the harness asks the model
the question, runs every `calc` call the model makes (the tool runs in the harness itself)
and answers it with the bare result, for at most `max_calls` model calls; the reward is 1 when
the last number of the model's last reply is the expression's value. The harness sends what
agent-rl's `calculator` env (with `tools_in_prompt = false`) shows the model, the question as
the one user message and each result as a tool message, so that env's teacher demonstrations
warm-start a policy for this one (`agent-rl quickstart --env verifiers:vf_calculator`,
docs/ecosystems.md).

Rows are generated: row i of `seed` is a pure function of (seed, i); another `seed` is another
split (`splits = {eval = {taskset = {seed = 1}}}` in agent-rl's env kwargs).
"""

from __future__ import annotations

import ast
import json
import random
import re
from decimal import Decimal

import verifiers.v1 as vf
from vf_client import interception_client

OPS = ("+", "-", "*")
TEMPLATES = ("What is {e}?", "Compute {e}.", "Calculate {e}", "Please evaluate {e}.")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def safe_eval(expression: str) -> int | None:
    """The value of integer arithmetic with + - * ( ); None for anything else (never `eval`)."""
    if len(expression) > 64 or not re.fullmatch(r"[0-9+\-*() ]+", expression):
        return None
    try:
        return _eval(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        return None


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        a, b = _eval(node.left), _eval(node.right)
        out = a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        if abs(out) > 10**15:
            raise ValueError("result too large")
        return out
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


class CalcConfig(vf.TasksetConfig):
    seed: int = 0
    """Which rows: another seed is another split."""
    count: int = 2048
    """Rows in the taskset."""
    min_terms: int = 3
    max_terms: int = 3
    max_digits: int = 1
    """Digits of each term, at most."""


class CalcData(vf.TaskData):
    expression: str
    answer: str
    """The expression's value, in decimal."""


class CalcTask(vf.Task[CalcData]):
    @vf.reward
    async def correct(self, task: CalcData, trace: vf.Trace) -> float:
        """1 when the last number of the model's last reply is the answer."""
        replies = trace.assistant_messages
        text = replies[-1].content if replies else ""
        if not isinstance(text, str):
            text = " ".join(getattr(part, "text", "") or "" for part in text or [])
        found = NUMBER.findall(text.replace(",", ""))
        return float(bool(found) and Decimal(found[-1]) == Decimal(task.answer))


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self):
        c = self.config
        rng = random.Random(f"vf_calculator:{c.seed}")
        for i in range(c.count):
            parts: list[str] = []
            for k in range(rng.randint(c.min_terms, c.max_terms)):
                digits = rng.randint(1, c.max_digits)
                parts.append(str(rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)))
                if k:
                    parts.insert(-1, rng.choice(OPS))
            expression = "".join(parts)
            data = CalcData(id=f"calc-{c.seed}-{i}", prompt=rng.choice(TEMPLATES).format(e=expression),
                            expression=expression, answer=str(safe_eval(expression)))  # fmt: skip
            yield CalcTask(data, c.task)


def calc(arguments: str) -> str:
    """The `calc` tool: the value of `{"expression": ...}`, or an error the model reads."""
    try:
        expression = json.loads(arguments).get("expression", "")
    except (json.JSONDecodeError, AttributeError):
        return "error: the arguments must be a JSON object with an expression"
    value = safe_eval(str(expression))
    return "error: bad expression" if value is None else str(value)


class CalcHarnessConfig(vf.HarnessConfig):
    max_calls: int = 3
    """Model calls of an episode, at most (the last one's reply is the answer)."""


class CalcHarness(vf.Harness[CalcHarnessConfig]):
    """Its loop runs in-process (nothing is installed at run time); every model call goes
    through verifiers' interception endpoint, as `Harness.launch` requires."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        async with interception_client(endpoint, secret) as client:
            messages: list[dict] = [{"role": "user", "content": data.prompt}]
            for _ in range(self.config.max_calls):
                r = await client.chat.completions.create(model=ctx.model, messages=messages)
                message = r.choices[0].message
                if not message.tool_calls:
                    break
                messages.append(message.model_dump(exclude_none=True))
                for call in message.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": calc(call.function.arguments)})  # fmt: skip
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["CalcTaskset", "CalcHarness"]
