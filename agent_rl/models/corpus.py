"""The text the tiny models' tokenizer is trained on, generated in code.

No corpus can be downloaded here, so the tokenizer learns its merges from text written by this
module: English sentences, arithmetic word problems solved with a `calc` tool, search questions
answered with a `search` tool, small Python functions with their tests, and the chat-template
scaffolding itself (rendered conversations with tool calls and tool responses). The output is a
pure function of `seed`, so the tokenizer trained on it is reproducible byte for byte.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator

NAMES = ["Alice", "Bob", "Carol", "Dan", "Eve", "Tom", "Mia", "Sam", "Lena", "Omar"]
ITEMS = ["apples", "books", "coins", "pencils", "cookies", "marbles", "stamps", "tickets"]
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please answer the question and explain your reasoning step by step.",
    "The result of the calculation is shown below.",
    "Use the tool to look up the answer, then reply with the final answer.",
    "A function returns a value; a test checks that the value is correct.",
    "The capital of France is Paris, and the capital of Japan is Tokyo.",
    "Water boils at 100 degrees Celsius at sea level.",
    "Write a short Python function that solves the problem and passes the tests.",
    "The answer is correct. Well done!",
    "I could not find that. Let me search again with a different query.",
]
FACTS = [
    (
        "Who wrote Hamlet?",
        "William Shakespeare",
        "Hamlet is a tragedy written by William Shakespeare.",
    ),
    ("What is the capital of Italy?", "Rome", "Rome is the capital city of Italy."),
    (
        "When did the Apollo 11 mission land on the Moon?",
        "1969",
        "Apollo 11 landed on the Moon in July 1969.",
    ),
    (
        "What is the largest planet in the solar system?",
        "Jupiter",
        "Jupiter is the largest planet in the solar system.",
    ),
    (
        "Who painted the Mona Lisa?",
        "Leonardo da Vinci",
        "The Mona Lisa was painted by Leonardo da Vinci.",
    ),
    ("What is the chemical symbol for gold?", "Au", "Gold has the chemical symbol Au."),
    ("How many legs does a spider have?", "8", "Spiders have 8 legs."),
    ("Which river flows through Cairo?", "the Nile", "The Nile flows through Cairo, Egypt."),
]
CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression and return the number.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 3 * (4 + 5)"}},
            "required": ["expression"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search a text collection and return the best matching passages.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "What to look for."}},
            "required": ["query"],
        },
    },
}
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code and return its standard output.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python source code."}},
            "required": ["code"],
        },
    },
}

Conversation = tuple[list[dict], list[dict]]  # (messages, tools)


def _expression(rng: random.Random) -> tuple[str, int]:
    terms = [str(rng.randint(1, 999)) for _ in range(rng.randint(2, 4))]
    ops = [rng.choice("+-*") for _ in terms[1:]]
    expr = terms[0] + "".join(f" {op} {t}" for op, t in zip(ops, terms[1:], strict=True))
    return expr, eval(expr)  # noqa: S307 - digits and + - * only, built just above


def arithmetic(rng: random.Random) -> Conversation:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    expr, value = _expression(rng)
    question = f"{name} has some {item}. Compute {expr} to find how many {item} {name} has now."
    call = {"name": "calc", "arguments": {"expression": expr}}
    return [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": call}],
        },
        {"role": "tool", "content": str(value)},
        {"role": "assistant", "content": f"The answer is {value}."},
    ], [CALC_TOOL]


def search(rng: random.Random) -> Conversation:
    question, answer, passage = rng.choice(FACTS)
    call = {"name": "search", "arguments": {"query": question.rstrip("?").lower()}}
    return [
        {"role": "system", "content": "You answer questions using the search tool."},
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": "Let me search.",
            "tool_calls": [{"type": "function", "function": call}],
        },
        {"role": "tool", "content": json.dumps([{"title": answer, "text": passage}])},
        {"role": "assistant", "content": f"The answer is {answer}."},
    ], [SEARCH_TOOL]


def python_code(rng: random.Random) -> str:
    a, b = rng.randint(0, 99), rng.randint(1, 99)
    fn = rng.choice(["add", "mul", "sub", "max2", "clip", "mean"])
    bodies = {
        "add": ("a + b", a + b),
        "mul": ("a * b", a * b),
        "sub": ("a - b", a - b),
        "max2": ("a if a > b else b", max(a, b)),
        "clip": ("min(max(a, 0), b)", min(max(a, 0), b)),
        "mean": ("(a + b) / 2", (a + b) / 2),
    }
    body, value = bodies[fn]
    return (
        f"def {fn}(a: int, b: int) -> int:\n"
        f'    """Return {body} for the two inputs."""\n'
        f"    return {body}\n\n\n"
        f"def test_{fn}():\n"
        f"    assert {fn}({a}, {b}) == {value!r}\n\n\n"
        f"for i in range({b % 10 + 1}):\n"
        f"    print(i, {fn}(i, {b}))\n"
    )


def code_task(rng: random.Random) -> Conversation:
    code = python_code(rng)
    return [
        {
            "role": "user",
            "content": "Write the function and run its test.\n```python\n" + code + "```",
        },
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "python", "arguments": {"code": code}}}
            ],
        },
        {"role": "tool", "content": "1 passed in 0.01s"},
        {"role": "assistant", "content": "All tests passed."},
    ], [PYTHON_TOOL]


def plain_text(rng: random.Random) -> str:
    words = " ".join(rng.choice(SENTENCES) for _ in range(3))
    numbers = " ".join(str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(4))
    return f"{words} Numbers: {numbers}."


def corpus(
    render: Callable[[list[dict], list[dict]], str], seed: int = 0, n: int = 600
) -> Iterator[str]:
    """Yield training texts; conversations go through `render` (the chat template)."""
    rng = random.Random(seed)
    makers = [arithmetic, search, code_task]
    for i in range(n):
        yield plain_text(rng)
        yield python_code(rng)
        messages, tools = makers[i % len(makers)](rng)
        yield render(messages, tools)
