"""An environment instance and its sandbox for one episode, released together.

The runner, replay and fork all hold an env and (when it needs one) a fresh sandbox for the
length of one episode; both must be closed however the episode ends, cancellation included.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from agent_rl.sdk.env import Env
from agent_rl.kernel.errors import SandboxError
from agent_rl.sdk.sandbox import SandboxSpec


@asynccontextmanager
async def episode_sandbox(env: Env, backend: Any, spec: SandboxSpec | None = None) -> AsyncIterator[Any]:
    """Yield the episode's sandbox from `backend` (None if `env` needs none), made from `spec`
    (default: the env's); on exit close the env, then the sandbox, shielded from cancellation."""
    sandbox = None
    try:
        if env.needs_sandbox:
            if backend is None:
                raise SandboxError(f"{env.env_id} needs a sandbox but no sandbox backend is configured")
            sandbox = await backend.create(spec or env.sandbox_spec or SandboxSpec())
        yield sandbox
    finally:
        with anyio.CancelScope(shield=True):
            try:
                await env.close()
            finally:
                if sandbox is not None:
                    await sandbox.close()
