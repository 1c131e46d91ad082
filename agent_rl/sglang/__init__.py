"""SGLang's wire protocol as agent-rl speaks it (layer L1): the typed async client of the native
API (`client.EngineClient`: generation, control, weight updates), the data it sends and decodes
(`generation`), and the server arguments and draft layout of speculative decoding
(`speculative`). Every layer above may use it; starting a server is `agent_rl.engine`'s."""
