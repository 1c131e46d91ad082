"""agent-rl: train LLM agents with reinforcement learning.

The SDK users import (environments, tools, tasks, rewards, sandboxes, tool-call parsing,
registration) is exported here, lazily: `from agent_rl import Env` imports the SDK, while importing the kernel
(`agent_rl.errors`, `agent_rl.config`) imports nothing else, so a process that needs only the
kernel (the standalone router) never loads environment code. The trajectory store is
`agent_rl.store`, the CLI `agent_rl.cli`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and readers; at run time __getattr__ imports them
    from agent_rl.agent import AgentEnv  # noqa: F401
    from agent_rl.env import Env, EnvCodeError, ResetResult, StepInfo, StepResult  # noqa: F401
    from agent_rl.errors import EnvError, ToolError  # noqa: F401
    from agent_rl.messages import AssistantTurn, MalformedToolCall, Message, ToolCall  # noqa: F401
    from agent_rl.registry import EnvSpec, make, register, specs  # noqa: F401
    from agent_rl.rewards import EpisodeOutcome, Reward  # noqa: F401
    from agent_rl.sandbox import ExecResult, Sandbox, SandboxSpec  # noqa: F401
    from agent_rl.tasks import GeneratedTasks, JsonlTasks, ListTasks, Task, TaskSource  # noqa: F401
    from agent_rl.tool_calls import format_tool_call, parse_completion  # noqa: F401
    from agent_rl.tools import Tool, ToolResult, tool  # noqa: F401

__version__ = "0.1.0"

_EXPORTS = {
    "agent_rl.agent": ("AgentEnv",),
    "agent_rl.env": ("Env", "EnvCodeError", "ResetResult", "StepInfo", "StepResult"),
    "agent_rl.errors": ("EnvError", "ToolError"),
    "agent_rl.messages": ("AssistantTurn", "MalformedToolCall", "Message", "ToolCall"),
    "agent_rl.registry": ("EnvSpec", "make", "register", "specs"),
    "agent_rl.rewards": ("EpisodeOutcome", "Reward"),
    "agent_rl.sandbox": ("ExecResult", "Sandbox", "SandboxSpec"),
    "agent_rl.tasks": ("GeneratedTasks", "JsonlTasks", "ListTasks", "Task", "TaskSource"),
    "agent_rl.tool_calls": ("format_tool_call", "parse_completion"),
    "agent_rl.tools": ("Tool", "ToolResult", "tool"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'agent_rl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
