"""The calculator agent written against the gateway's other two dialects, each with nothing but
its official client: Anthropic's Messages API (`anthropic`) and OpenAI's Responses API
(`openai`'s `responses.create`). Same tasks, same `calc` tool run by the agent itself, same
reward as `calculator-agent`; registered as `calculator-agent-anthropic` and
`calculator-agent-responses`. As commands (`python -m envs.calculator_agent.dialects
anthropic|responses`) they read the task's JSON from stdin and the endpoint from the usual
variables (ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY, OPENAI_BASE_URL / OPENAI_API_KEY).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from agent_rl.sdk.tasks import Task
from envs.calculator_agent.agent import CALC, calc
from envs.calculator_agent.env import CalculatorAgentEnv

ANTHROPIC_CALC = {"name": CALC["function"]["name"], "description": CALC["function"]["description"],
                  "input_schema": CALC["function"]["parameters"]}  # fmt: skip
RESPONSES_CALC = {"type": "function", **CALC["function"]}


async def solve_anthropic(client: Any, question: str, *, tools: bool = True, max_calls: int = 4,
                          max_tokens: int | None = None) -> str:  # fmt: skip
    """The model's final answer to `question` over Anthropic's Messages API."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    answer = ""
    for _ in range(max_calls):
        extra: dict[str, Any] = {"tools": [ANTHROPIC_CALC]} if tools else {}
        response = await client.messages.create(model="policy", messages=messages,
                                                max_tokens=max_tokens or 1024, **extra)  # fmt: skip
        answer = "".join(b.text for b in response.content if b.type == "text")
        uses = [b for b in response.content if b.type == "tool_use"]
        if not uses:
            return answer
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in response.content]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": calc(json.dumps(b.input))} for b in uses]})
    return answer


async def solve_responses(client: Any, question: str, *, tools: bool = True, max_calls: int = 4,
                          max_tokens: int | None = None) -> str:  # fmt: skip
    """The model's final answer to `question` over OpenAI's Responses API, each call continuing
    the previous response (`previous_response_id`) with the tools' outputs."""
    items: list[dict[str, Any]] = [{"role": "user", "content": question}]
    previous = None
    answer = ""
    for _ in range(max_calls):
        extra: dict[str, Any] = {"tools": [RESPONSES_CALC]} if tools else {}
        if max_tokens is not None:
            extra["max_output_tokens"] = max_tokens
        if previous is not None:
            extra["previous_response_id"] = previous
        response = await client.responses.create(model="policy", input=items, **extra)
        answer = response.output_text
        calls = [o for o in response.output if o.type == "function_call"]
        if not calls:
            return answer
        previous = response.id
        items = [{"type": "function_call_output", "call_id": c.call_id, "output": calc(c.arguments)} for c in calls]
    return answer


class CalculatorAnthropicAgentEnv(CalculatorAgentEnv):
    """`calculator-agent` with the agent written with Anthropic's client."""

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        import anthropic

        return await self.run_with(anthropic.AsyncAnthropic, anthropic.DefaultAsyncHttpxClient,
                                   solve_anthropic, base_url, api_key, task)  # fmt: skip


class CalculatorResponsesAgentEnv(CalculatorAgentEnv):
    """`calculator-agent` with the agent written with `client.responses.create`."""

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        import openai

        return await self.run_with(openai.AsyncOpenAI, openai.DefaultAsyncHttpxClient,
                                   solve_responses, base_url, api_key, task)  # fmt: skip


async def main(dialect: str) -> None:
    task = json.loads(sys.stdin.read())
    if dialect == "anthropic":
        from anthropic import AsyncAnthropic

        async with AsyncAnthropic() as client:  # ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY
            print(await solve_anthropic(client, task["data"]["question"]))
    else:
        from openai import AsyncOpenAI

        async with AsyncOpenAI() as client:  # OPENAI_BASE_URL, OPENAI_API_KEY
            print(await solve_responses(client, task["data"]["question"]))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "responses"))
