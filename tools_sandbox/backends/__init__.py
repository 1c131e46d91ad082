"""The sandbox backends, one module each, and the one table that names them.

A backend is a class implementing `agent_rl.sdk.sandbox.SandboxBackend`, constructed with the
`[sandbox]` config. `BACKENDS` maps the name `sandbox.backend` takes to the class's
"module:Class" path; `load` imports only the chosen one, so, for example, the docker SDK is
needed only when the Docker backend is chosen. Adding a backend is a module in this folder and
a line here (docs/sandbox.md, "Adding a backend").
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from agent_rl.config import SandboxConfig
from agent_rl.kernel.errors import ConfigError
from agent_rl.sdk.sandbox import SandboxBackend

BACKENDS: dict[str, str] = {
    "bwrap": "tools_sandbox.backends.bwrap:BwrapBackend",
    "docker": "tools_sandbox.backends.docker:DockerBackend",
    "rlimit": "tools_sandbox.backends.rlimit:RlimitBackend",
}
"""`sandbox.backend` name -> "module:Class" of its backend."""


def load(name: str) -> Callable[[SandboxConfig], SandboxBackend]:
    """The backend class registered as `name`; ConfigError naming the known ones if none is."""
    if name not in BACKENDS:
        known = ", ".join(sorted(BACKENDS))
        raise ConfigError(f"sandbox.backend = {name!r} is not a sandbox backend: use one of {known}")
    module, cls = BACKENDS[name].split(":")
    backend: Callable[[SandboxConfig], SandboxBackend] = getattr(
        importlib.import_module(module), cls
    )
    return backend
