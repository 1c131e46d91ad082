"""The engine environment: a clear one-line error when missing, idempotent install."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_rl.engine import install
from agent_rl.engine.install import STAMP_FILE, engine_env, engine_python, install_engine, requirements_file
from agent_rl.kernel.errors import EngineError


def test_missing_environment_names_the_install_command(tmp_path: Path) -> None:
    with pytest.raises(EngineError) as e:
        engine_python(tmp_path / "nowhere")
    assert "agent-rl engine install" in str(e.value) and "\n" not in str(e.value)


def test_outdated_environment_names_the_install_command(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    (venv / STAMP_FILE).write_text(json.dumps({"digest": "old", "device": "cpu"}))
    with pytest.raises(EngineError, match="out of date.*agent-rl engine install"):
        engine_python(venv)


def test_requirements_are_all_pinned() -> None:
    lines = [ln.strip() for ln in requirements_file().read_text().splitlines()]
    reqs = [ln for ln in lines if ln and not ln.startswith("#")]
    assert all("==" in r for r in reqs), [r for r in reqs if "==" not in r]
    names = {r.split("==")[0].lower() for r in reqs}
    assert {"sglang", "torch", "torchvision", "transformers"} <= names
    # No CUDA-only kernel wheels: they neither install nor run on CPU.
    assert not names & {
        "flashinfer-python",
        "sglang-kernel",
        "sgl-kernel",
        "flash-attn-4",
        "sgl-deep-ep",
    }


def test_install_is_idempotent(engine_venv: Path) -> None:
    t0 = time.monotonic()
    assert install_engine(engine_venv, "cpu", echo=lambda _: None) is False
    assert time.monotonic() - t0 < 5
    assert engine_python(engine_venv).exists()


def test_engine_is_built_from_cpython_311_whatever_the_main_interpreter() -> None:
    # The lock is for 3.11; a main venv on 3.12+ finds python3.11 on PATH (this machine has one).
    base = install._base_python()
    out = subprocess.run([base, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True)
    assert out.stdout.decode().strip() == "(3, 11)"


def test_no_python311_on_path_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    # A pyenv-style shim that exists but does not run must not be taken for an interpreter.
    shim = tmp_path / "python3.11"
    shim.write_text("#!/bin/sh\nexit 127\n")
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "version_info", (3, 12, 0, "final", 0))
    with pytest.raises(EngineError, match="needs CPython 3.11.*--python"):
        install._base_python()


def test_no_engine_start_compiles_the_engines_modules_from_source(engine_venv: Path) -> None:
    """The install leaves bytecode for every module an engine imports: where
    PYTHONDONTWRITEBYTECODE is set (CI images, many containers) an engine process never writes
    it, so without it each start compiled SGLang, transformers and torch from source again (an
    install without pip's compile step once made every engine test 1.5-2x slower)."""
    code = (
        "import importlib._bootstrap_external as b, sys\n"
        "compiled = []\n"
        "source_to_code = b.SourceLoader.source_to_code\n"
        "def counting(self, data, path, *, _optimize=-1):\n"
        "    compiled.append(path)\n"
        "    return source_to_code(self, data, path, _optimize=_optimize)\n"
        "b.SourceLoader.source_to_code = counting\n"
        "import sglang.launch_server, sglang.srt.managers.scheduler\n"
        "print('\\n'.join(p for p in compiled if p.startswith(sys.prefix)))\n"
    )
    env = {**engine_env("cpu"), "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([str(engine_python(engine_venv)), "-c", code], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    from_source = out.stdout.split()
    assert not from_source, f"{len(from_source)} modules compiled from source, e.g. {from_source[:3]}"
