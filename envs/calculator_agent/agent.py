"""A calculator agent written with nothing but the official `openai` client: the kind of
program the gateway turns into training episodes. It knows nothing of agent-rl.

It asks the model the question with a `calc` tool, runs every call the model makes, answers
with the tool's result, and returns the model's last answer. Run as a command it reads the
task's JSON from stdin and the endpoint from `OPENAI_BASE_URL`/`OPENAI_API_KEY`, as any
OpenAI program does, and prints the answer.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from openai import AsyncOpenAI

from envs.calculator.env import safe_eval

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate integer arithmetic with +, -, * and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 37*48+12"}},
            "required": ["expression"],
        },
    },
}


def calc(arguments: str) -> str:
    """The tool, run by the agent itself."""
    try:
        expression = json.loads(arguments).get("expression", "")
    except (json.JSONDecodeError, AttributeError):
        return "error: the arguments must be a JSON object with an expression"
    value = safe_eval(str(expression))
    return "error: bad expression" if value is None else str(value)


async def solve(client: AsyncOpenAI, question: str, *, tools: bool = True, max_calls: int = 4,
                max_tokens: int | None = None) -> str:  # fmt: skip
    """The model's final answer to `question`, after running the calls it makes."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    answer = ""
    for _ in range(max_calls):
        extra: dict[str, Any] = {"tools": [CALC]} if tools else {}
        if max_tokens is not None:
            extra["max_tokens"] = max_tokens
        response = await client.chat.completions.create(model="policy", messages=messages, **extra)  # type: ignore[arg-type]
        message = response.choices[0].message
        answer = message.content or ""
        if not message.tool_calls:
            return answer
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calc(call.function.arguments)})  # fmt: skip
    return answer


async def main() -> None:
    task = json.loads(sys.stdin.read())
    client = AsyncOpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY, as every OpenAI program
    print(await solve(client, task["data"]["question"]))


if __name__ == "__main__":
    asyncio.run(main())
