"""What the ecosystem tests share: the verifiers environment's Python."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from envs.verifiers_env.env import PYTHON_VAR

ROOT = Path(__file__).resolve().parents[2]
INSTALL = "python -m venv .venv-verifiers && .venv-verifiers/bin/pip install verifiers==0.4.0"


@pytest.fixture(scope="session")
def verifiers_python() -> str:
    """The Python of a virtual environment with verifiers 0.4.0 (`AGENT_RL_VERIFIERS_PYTHON`,
    else the repository's `.venv-verifiers`): skipped without it locally, failed in CI."""
    python = os.environ.get(PYTHON_VAR) or str(ROOT / ".venv-verifiers" / "bin" / "python")
    found = Path(python).is_file() and subprocess.run(
        [python, "-c", "import importlib.metadata as m; assert m.version('verifiers') == '0.4.0'"],
        capture_output=True, check=False).returncode == 0  # fmt: skip
    if not found:
        message = f"no verifiers 0.4.0 environment at {python}: set {PYTHON_VAR} or run {INSTALL}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return python
