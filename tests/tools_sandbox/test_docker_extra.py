"""The Docker backend's SDK is an install extra (`pip install 'agent-rl[docker]'`, also in the
test extra so CI has it): without it, choosing the backend is a SandboxError of one line saying
what to install (the CLI prints such an error as that line)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agent_rl.config import SandboxConfig
from agent_rl.kernel.errors import SandboxError
from tools_sandbox.factory import make_backend


def test_a_missing_docker_sdk_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # Fault injection: the installed SDK is hidden (None in sys.modules makes `import docker`
    # raise ImportError), as on an install without the extra.
    monkeypatch.setitem(sys.modules, "docker", None)
    with pytest.raises(SandboxError) as e:
        make_backend(SandboxConfig(backend="docker"))
    assert str(e.value) == "the docker backend needs the docker SDK: pip install 'agent-rl[docker]'"


def test_the_extra_is_declared() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    sdk = [d for d in extras["docker"] if d.startswith("docker")]
    assert sdk and set(sdk) <= set(extras["test"])  # CI's test extra keeps it
    assert not any(d.startswith("docker") for d in project["dependencies"])
