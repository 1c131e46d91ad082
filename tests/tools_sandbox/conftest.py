"""Fixtures for the sandbox tests: real backends (bubblewrap, Docker, rlimit), no fakes.

Every backend test runs against each registered backend (`tools_sandbox.backends.BACKENDS`).
bwrap and rlimit need root (CI runs as root). Docker needs a reachable engine (DOCKER_HOST, as
`.ci/start-dockerd.sh` exports); without one the Docker tests skip with the reason, except in
CI (CI=true), where that is a failure.
Tests use their own state dir and cgroup parent, so they never touch a server's sandboxes.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent_rl.config import SandboxConfig, SandboxLimits
from agent_rl.kernel.errors import SandboxError
from agent_rl.sdk.sandbox import SandboxBackend
from tools_sandbox.backends import BACKENDS as REGISTERED
from tools_sandbox.factory import make_backend

BACKENDS = sorted(REGISTERED)
"""Every registered backend: a new one runs every backend test (the attack suites included)."""
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # pytest-xdist: one of each per worker
STATE_DIR = Path("/tmp/agent-rl-test-sandboxes" + (f"-{_WORKER}" if _WORKER else ""))
CGROUP_PARENT = "agent-rl-test" + (f"-{_WORKER}" if _WORKER else "")
"""The tests' own state dir and cgroup parent: the leftover checks (helpers.leftovers) look
there, so tests running beside each other must not share them."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sandbox_config(backend: str, **kw: object) -> SandboxConfig:
    return SandboxConfig(backend=backend, state_dir=STATE_DIR, cgroup_parent=CGROUP_PARENT,
                         **kw)  # type: ignore[arg-type]


def small_limits(**kw: object) -> SandboxLimits:
    base: dict[str, object] = dict(wall_s=5.0, cpu_s=5, memory_mb=128, pids=48, disk_mb=32,
                                   tmp_mb=16, output_bytes=65536)
    base.update(kw)
    return SandboxLimits(**base)  # type: ignore[arg-type]


def backend_or_skip(name: str) -> SandboxBackend:
    """The backend, or a skip saying why it cannot run here (a failure in CI for Docker)."""
    if name in ("bwrap", "rlimit") and os.geteuid() != 0:
        pytest.skip(f"the {name} backend tests need root")
    try:
        return make_backend(sandbox_config(name))
    except SandboxError as e:
        if os.environ.get("CI") == "true" or name != "docker":
            raise
        pytest.skip(f"no Docker engine: {e}")


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[SandboxBackend]:
    b = backend_or_skip(request.param)
    try:
        yield b
    finally:
        await b.aclose()
        assert b.live() == 0
