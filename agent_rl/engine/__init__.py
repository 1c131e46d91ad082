"""The inference engine: SGLang servers launched from a dedicated environment, and their client.

- `agent_rl.engine.install`: `agent-rl engine install`, the engine venv and its pins.
- `agent_rl.engine.launcher.EngineServer`: start / health-wait / watch / stop one server.
- `agent_rl.engine.client.EngineClient`: the typed async client of SGLang's native protocol.
- `agent_rl/engine/cpu_compat/`: the CPU compatibility layer applied at launch.
"""

from __future__ import annotations

from agent_rl.engine.client import EngineClient, FinishReason, Generation, WeightSpan
from agent_rl.engine.install import engine_python, install_engine, is_installed
from agent_rl.engine.launcher import EngineServer, detect_device

__all__ = [
    "EngineClient",
    "EngineServer",
    "FinishReason",
    "Generation",
    "WeightSpan",
    "detect_device",
    "engine_python",
    "install_engine",
    "is_installed",
]
