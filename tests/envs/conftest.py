"""A real sandbox backend for the sandbox environments (bubblewrap, as configured by default).

Each test gets its own backend with a private state dir, so concurrent test runs on one host
never reap each other's sandboxes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from agent_rl.config import SandboxConfig
from agent_rl.sdk.sandbox import Sandbox, SandboxSpec
from tools_sandbox.factory import open_backend


@pytest.fixture
async def sandbox_backend() -> AsyncIterator[Callable[[SandboxSpec | None], Awaitable[Sandbox]]]:
    """`create(spec)` of a fresh backend; every sandbox it made is closed afterwards."""
    state = Path(tempfile.mkdtemp(prefix="agent-rl-envs-"))
    state.chmod(0o711)  # sandbox uids must traverse it to reach their work dirs
    backend = await open_backend(SandboxConfig(state_dir=state))

    async def create(spec: SandboxSpec | None = None) -> Sandbox:
        return await backend.create(spec or SandboxSpec())

    try:
        yield create
    finally:
        await backend.aclose()
        shutil.rmtree(state, ignore_errors=True)
        assert not os.path.exists(state)
