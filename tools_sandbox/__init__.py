"""Sandboxes for the agents' tool calls: one protocol, three backends, a pool, the tools.

- `base`: the contract (`SandboxSpec`, `Limits`, `ExecResult`, `Sandbox`, `SandboxBackend`).
- `bwrap` (default), `docker`, `rlimit` (insecure, explicit only): the backends; `factory`
  picks one from `[sandbox]` config and reaps what a crashed server left.
- `worker`: the persistent process inside every sandbox; `session`: its host side.
- `pool`: one sandbox per episode, warm pool, cap, live metric.
- `tools`: python, shell, read_file, write_file with OpenAI schemas.
See docs/sandbox.md.
"""
