"""agent-rl: train LLM agents with reinforcement learning.

The package's folders are its layers (docs/layers.md; `lint-imports` enforces them):

- `kernel/`, `config/`: errors, configuration and process-wide settings; they import nothing of ours.
- `sdk/`, `store/`, `sglang/`: the SDK users import, the trajectory store, SGLang's wire client.
- `rollout/`, `engine/`, `models/`, `testing/`: the subsystems (episode runner, the SGLang server's
  launcher, tiny models, test doubles), beside the top-level `trainer/`, `router/`, `envs/` and
  the sandbox backends of `tools_sandbox/`.
- `app/`: the application: the CLI, `serve`, evaluation, the web API and the quickstart.

The SDK is exported here (`from agent_rl import Env, tool, register, make, AgentEnv`), lazily:
importing the kernel alone (the standalone router does) never loads environment code.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and readers; at run time __getattr__ imports them
    from agent_rl.sdk import *  # noqa: F403

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # import_module, not `from agent_rl import sdk`: that form asks this very function for
    # `sdk` first (hasattr on the package) and recurses until the stack runs out
    sdk = import_module("agent_rl.sdk")

    if name not in sdk.__all__:
        raise AttributeError(f"module 'agent_rl' has no attribute {name!r}")
    value = getattr(sdk, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    sdk = import_module("agent_rl.sdk")

    return sorted([*globals(), *sdk.__all__])
