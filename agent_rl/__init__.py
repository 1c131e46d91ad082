"""agent-rl: train LLM agents with reinforcement learning.

The SDK users import (environments, tools, registration) is exported from here as it lands;
the trajectory store is `agent_rl.store`, the CLI `agent_rl.cli`.
"""

from __future__ import annotations

__version__ = "0.1.0"
