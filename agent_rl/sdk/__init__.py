"""The SDK users import: environments, agent programs, tools, tasks, rewards, the sandbox an
environment's tools run in, tool-call parsing and registration.

Everything here is re-exported by `agent_rl` itself (`from agent_rl import Env, tool, register,
make, AgentEnv`). The SDK depends on the kernel only (`agent_rl.kernel`, `agent_rl.config`);
what runs an environment (the rollout runner, the sandboxes' backends, the store) sits above it.
"""

from __future__ import annotations

from agent_rl.kernel.errors import EnvError, ToolError
from agent_rl.sdk.agent import AgentEnv
from agent_rl.sdk.env import Env, EnvCodeError, ResetResult, StepInfo, StepResult
from agent_rl.sdk.messages import AssistantTurn, MalformedToolCall, Message, ToolCall
from agent_rl.sdk.registry import EnvSpec, make, register, specs
from agent_rl.sdk.rewards import EpisodeOutcome, Reward
from agent_rl.sdk.sandbox import ExecResult, Sandbox, SandboxSpec
from agent_rl.sdk.tasks import GeneratedTasks, JsonlTasks, ListTasks, Task, TaskSource
from agent_rl.sdk.tool_calls import format_tool_call, parse_completion
from agent_rl.sdk.tools import Tool, ToolErrorKind, ToolResult, tool

__all__ = [
    "AgentEnv", "AssistantTurn", "Env", "EnvCodeError", "EnvError", "EnvSpec", "EpisodeOutcome",
    "ExecResult", "GeneratedTasks", "JsonlTasks", "ListTasks", "MalformedToolCall", "Message",
    "ResetResult", "Reward", "Sandbox", "SandboxSpec", "StepInfo", "StepResult", "Task",
    "TaskSource", "Tool", "ToolCall", "ToolError", "ToolErrorKind", "ToolResult",
    "format_tool_call", "make", "parse_completion", "register", "specs", "tool",
]  # fmt: skip
