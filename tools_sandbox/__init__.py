"""Sandboxes for the agents' tool calls: the backends of the SDK's sandbox contract, and a pool.

The contract (`Sandbox`, `SandboxSpec`, `ExecResult`, `Limits`, `SandboxBackend`) and the
built-in tools (python, shell, read_file, write_file) are the SDK's: `agent_rl.sdk.sandbox` and
`agent_rl.sdk.sandbox_tools`. Here:
- `backends/`: `bwrap` (default), `docker`, `rlimit` (insecure, explicit only), one module each,
  named in `backends.BACKENDS`; `factory` builds the one `[sandbox]` names and reaps what a
  crashed server left.
- `backend`: what the worker-served backends share; `worker`: the persistent process inside
  every sandbox; `session`: its host side.
- `pool`: one sandbox per episode, warm pool, cap, live metric.
See docs/sandbox.md.
"""
