"""agent-rl: train LLM agents with reinforcement learning.

The SDK users import (environments, tools, tasks, rewards, registration) is exported here;
the trajectory store is `agent_rl.store`, the CLI `agent_rl.cli`.
"""

from __future__ import annotations

from agent_rl.env import Env, EnvCodeError, ResetResult, StepInfo, StepResult
from agent_rl.errors import EnvError, ToolError
from agent_rl.messages import AssistantTurn, MalformedToolCall, Message, ToolCall
from agent_rl.registry import EnvSpec, make, register, specs
from agent_rl.rewards import EpisodeOutcome, Reward
from agent_rl.tasks import GeneratedTasks, JsonlTasks, ListTasks, Task, TaskSource
from agent_rl.tools import Tool, ToolResult, tool

__version__ = "0.1.0"

__all__ = [
    "AssistantTurn", "Env", "EnvCodeError", "EnvError", "EnvSpec", "EpisodeOutcome", "GeneratedTasks",
    "JsonlTasks", "ListTasks", "MalformedToolCall", "Message", "ResetResult", "Reward", "StepInfo",
    "StepResult", "Task", "TaskSource", "Tool", "ToolCall", "ToolError", "ToolResult", "make",
    "register", "specs", "tool",
]  # fmt: skip
