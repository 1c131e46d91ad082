"""Choosing and starting a sandbox backend from the config.

`open_backend(config.sandbox)` is how the rest of agent-rl gets sandboxes: it builds the
configured backend, runs its reaper once (so a crashed predecessor's sandboxes are gone before
new ones start) and returns it. The backends are named in `tools_sandbox.backends.BACKENDS` and
imported lazily, only the chosen one.
"""

from __future__ import annotations

import logging

import anyio

from agent_rl.config import SandboxConfig
from agent_rl.sdk.sandbox import SandboxBackend
from tools_sandbox import backends

log = logging.getLogger(__name__)


def make_backend(config: SandboxConfig) -> SandboxBackend:
    """The configured backend, constructed (raises SandboxError if it cannot work here, and
    ConfigError if `sandbox.backend` names none of `tools_sandbox.backends.BACKENDS`)."""
    return backends.load(config.backend)(config)


async def open_backend(config: SandboxConfig) -> SandboxBackend:
    """make_backend, then reap what a crashed server left, if the config says so."""
    backend = await anyio.to_thread.run_sync(make_backend, config)
    if config.reap_on_start:
        reaped = await backend.reap()
        if reaped:
            log.warning("sandbox reaper removed %d sandboxes left by a previous server", reaped)
    return backend
