"""The inference engine: SGLang servers launched from a dedicated environment (layer L2).

- `agent_rl.engine.install`: `agent-rl engine install`, the engine venv and its pins.
- `agent_rl.engine.launcher.EngineServer`: start / health-wait / watch / stop one server.
- `agent_rl/engine/sglang_cpu/`: the SGLang CPU compatibility layer applied at launch.

Talking to a running engine is `agent_rl.sglang`'s (the wire client every layer may use).
"""
