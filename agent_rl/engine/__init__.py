"""The inference engine: SGLang servers launched from a dedicated environment, and their client.

- `agent_rl.engine.client.EngineClient`: the typed async client of SGLang's native protocol
  (generation, control, weight updates), a contract every layer may use;
  `agent_rl.engine.generation` holds the data it sends and decodes (`Generation`, `TokenIds`).
- `agent_rl.engine.install`: `agent-rl engine install`, the engine venv and its pins.
- `agent_rl.engine.launcher.EngineServer`: start / health-wait / watch / stop one server.
- `agent_rl/engine/sglang_cpu/`: the SGLang CPU compatibility layer applied at launch.

Import the modules themselves: this package imports none of them, so taking the client does
not load the launcher.
"""
