"""The built-in environments, one folder each, registered here with the SDK.

Entry points are strings, so registering imports nothing: an environment's module (and its
dependencies, e.g. the BM25 index of search-qa) loads only when it is made.
"""

from __future__ import annotations

from agent_rl.sdk.registry import register

register("calculator", entry_point="envs.calculator.env:CalculatorEnv")
register("search-qa", entry_point="envs.search_qa.env:SearchQAEnv")
register("python-math", entry_point="envs.python_math.env:PythonMathEnv")
register("code-tests", entry_point="envs.code_tests.env:CodeTestsEnv")
register("long-tail", entry_point="envs.long_tail.env:LongTailEnv")
register("calculator-agent", entry_point="envs.calculator_agent.env:CalculatorAgentEnv")
register("calculator-agent-cli", entry_point="envs.calculator_agent.env:CalculatorAgentCliEnv")
register("calculator-agent-anthropic", entry_point="envs.calculator_agent.dialects:CalculatorAnthropicAgentEnv")
register("calculator-agent-responses", entry_point="envs.calculator_agent.dialects:CalculatorResponsesAgentEnv")
register("verifiers", entry_point="envs.verifiers_env.env:VerifiersEnv", id_argument="env")
