"""An environment instance and its sandbox for one episode, released together.

The runner, replay and fork all hold an env and (when it needs one) a fresh sandbox for the
length of one episode, drawn from a `SandboxSource` (serve's and the API's is
`tools_sandbox.pool.SandboxPool`, which caps, warms and paces creations as `[sandbox]` says);
both are released however the episode ends, cancellation included: the env closed first, then
the sandbox handed back. A sandbox that cannot be had (the pool closed, its creation failed)
raises SandboxError, which the runner records as the episode's failure.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Protocol

import anyio

from agent_rl.kernel.errors import SandboxError
from agent_rl.sdk.env import Env
from agent_rl.sdk.sandbox import Sandbox, SandboxSpec


class SandboxSource(Protocol):
    """Where episodes get their sandboxes (the pool; rollout never picks a backend)."""

    def sandbox(self, spec: SandboxSpec) -> AbstractAsyncContextManager[Sandbox]:
        """A started sandbox of `spec` for one episode, closed when the context exits."""
        ...


@asynccontextmanager
async def episode_sandbox(env: Env, sandboxes: SandboxSource | None,
                          spec: SandboxSpec | None = None) -> AsyncIterator[Sandbox | None]:  # fmt: skip
    """Yield the episode's sandbox from `sandboxes` (None if `env` needs none), made from `spec`
    (default: the env's); on exit close the env, then the sandbox, shielded from cancellation."""
    async with AsyncExitStack() as stack:
        sandbox = None
        try:
            if env.needs_sandbox:
                if sandboxes is None:
                    raise SandboxError(f"{env.env_id} needs a sandbox but no sandbox backend is configured")
                sandbox = await stack.enter_async_context(
                    sandboxes.sandbox(spec or env.sandbox_spec or SandboxSpec()))
        finally:
            # Pushed last, so it runs first: the env is done with the sandbox before it goes.
            stack.push_async_callback(_close, env)
        yield sandbox


async def _close(env: Env) -> None:
    with anyio.CancelScope(shield=True):
        await env.close()
