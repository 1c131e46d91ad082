"""`calculator-agent` and `calculator-agent-cli`: the calculator's tasks and reward, with the
episode driven by agent.py's `openai` program instead of the SDK's tool loop.

`calculator-agent` runs the agent as a coroutine in serve's process; `calculator-agent-cli`
runs the same program as a subprocess (`python -m envs.calculator_agent.agent`), which finds
the gateway through `OPENAI_BASE_URL`/`OPENAI_API_KEY` and prints its answer.
"""

from __future__ import annotations

import functools
import ssl
import sys
from typing import Any

from agent_rl.sdk.agent import AgentEnv
from agent_rl.sdk.rewards import Reward, number_reward
from agent_rl.sdk.tasks import GeneratedTasks, Task, TaskSource
from envs.calculator.env import make_problem


class CalculatorAgentEnv(AgentEnv):
    """Arithmetic questions; reward 1 for the exact integer in the agent's answer."""

    def __init__(self, *, min_terms: int = 2, max_terms: int = 4, max_digits: int = 3,
                 max_turns: int | None = 4, tools_in_prompt: bool = True,
                 max_tokens: int | None = None, **kwargs: Any) -> None:  # fmt: skip
        """`max_turns`: model calls the agent makes at most (as the SDK env's turns);
        `tools_in_prompt=False`: the agent sends no tool schemas (a tiny model's prompt stays
        short; it still calls `calc`); `max_tokens`: the agent's per-call completion limit.
        The task kwargs are the calculator's, so one set of kwargs serves both envs."""
        super().__init__(tools_in_prompt=tools_in_prompt, max_turns=max_turns, **kwargs)
        self.problem_kwargs = {"min_terms": min_terms, "max_terms": max_terms, "max_digits": max_digits}
        self.max_completion = max_tokens

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        return GeneratedTasks(
            "calculator", lambda rng: make_problem(rng, **self.problem_kwargs), split=split
        )

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        import openai

        from envs.calculator_agent.agent import solve

        return await self.run_with(openai.AsyncOpenAI, openai.DefaultAsyncHttpxClient, solve,
                                   base_url, api_key, task)  # fmt: skip

    async def run_with(self, client_type: Any, http_type: Any, solve: Any, base_url: str,
                       api_key: str, task: Task) -> str:  # fmt: skip
        """`solve` with a `client_type` client (openai's or anthropic's) on the episode's
        endpoint. One TLS context for every episode's client: httpx builds a new one per client
        otherwise, loading the CA bundle each time (~20-90 ms of serve's event loop per episode)."""
        http = http_type(verify=tls_context())
        async with client_type(base_url=base_url, api_key=api_key, max_retries=0,
                               http_client=http) as client:  # fmt: skip
            return await solve(client, task["question"], tools=self.tools_in_prompt,
                               max_calls=self.max_turns or 4, max_tokens=self.max_completion)  # fmt: skip

    async def score(self, task: Task, result: Any, transcript: list[dict[str, Any]]) -> Reward:
        return number_reward(str(result), task["answer"])


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The process's one default TLS context, shared by every episode's client."""
    return ssl.create_default_context()


class CalculatorAgentCliEnv(CalculatorAgentEnv):
    """The same agent as a command: a subprocess with OPENAI_BASE_URL / OPENAI_API_KEY set."""

    command = (sys.executable, "-m", "envs.calculator_agent.agent")
