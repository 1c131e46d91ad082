"""`tools_sandbox.backends.BACKENDS` is the one registration of a backend: the factory builds the
configured one by its name, refuses an unknown name in one line, and every backend module of
the folder is registered under the name it reports."""

from __future__ import annotations

import pkgutil

import pytest

import tools_sandbox.backends
from agent_rl.kernel.errors import ConfigError
from agent_rl.sdk.sandbox import SandboxBackend
from tools_sandbox.backends import BACKENDS, load
from tools_sandbox.factory import make_backend

from .conftest import backend_or_skip, sandbox_config

pytestmark = pytest.mark.anyio


def test_every_backend_module_is_registered_under_its_own_name() -> None:
    modules = {m.name for m in pkgutil.iter_modules(tools_sandbox.backends.__path__)}
    assert modules == {path.split(":")[0].rsplit(".", 1)[1] for path in BACKENDS.values()}
    for name in BACKENDS:
        assert load(name).name == name  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(BACKENDS))
async def test_the_factory_builds_the_configured_backend(name: str) -> None:
    backend = backend_or_skip(name)
    try:
        assert isinstance(backend, SandboxBackend) and backend.name == name
        assert type(backend) is load(name)
    finally:
        await backend.aclose()


def test_an_unknown_backend_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as e:
        make_backend(sandbox_config("firecracker"))
    assert str(e.value) == (
        "sandbox.backend = 'firecracker' is not a sandbox backend: use one of bwrap, docker, rlimit"
    )
