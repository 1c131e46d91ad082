"""Choosing and starting a sandbox backend from the config.

`open_backend(config.sandbox)` is how the rest of agent-rl gets sandboxes: it builds the
configured backend, runs its reaper once (so a crashed predecessor's sandboxes are gone before
new ones start) and returns it. Backends are imported lazily so that, for example, the docker
SDK is needed only when the Docker backend is chosen.
"""

from __future__ import annotations

import logging

import anyio

from agent_rl.config import SandboxConfig
from tools_sandbox.base import SandboxBackend

log = logging.getLogger(__name__)


def make_backend(config: SandboxConfig) -> SandboxBackend:
    """The configured backend, constructed (raises SandboxError if it cannot work here)."""
    if config.backend == "bwrap":
        from tools_sandbox.bwrap import BwrapBackend

        return BwrapBackend(config)
    if config.backend == "docker":
        from tools_sandbox.docker import DockerBackend

        return DockerBackend(config)
    from tools_sandbox.rlimit import RlimitBackend

    return RlimitBackend(config)


async def open_backend(config: SandboxConfig) -> SandboxBackend:
    """make_backend, then reap what a crashed server left, if the config says so."""
    backend = await anyio.to_thread.run_sync(make_backend, config)
    if config.reap_on_start:
        reaped = await backend.reap()
        if reaped:
            log.warning("sandbox reaper removed %d sandboxes left by a previous server", reaped)
    return backend
