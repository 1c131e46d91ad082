"""The dedicated engine environment: a venv holding SGLang and its torch, made by
`agent-rl engine install`, used by the launcher.

SGLang 0.5.23 pins torch 2.14.1 and CUDA-only kernel wheels; the trainer's environment holds
torch 2.13.0 and megatron-core. Two environments keep those pins apart, as SGLang's own
container does in production. Contract:

- `install_engine(venv)` is idempotent: a stamp file records the digest of the requirements it
  installed, and a venv whose stamp matches is left alone (`force=True` reinstalls).
- On CPU it installs `requirements-engine.txt` (every version pinned) with `--no-deps`; on a GPU
  host (`device="cuda"`) it installs stock `sglang==0.5.23` with its own CUDA dependencies.
- `engine_python(venv)` returns the interpreter to launch, or raises `EngineError` with one line
  naming `agent-rl engine install` when the environment is missing or out of date.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path
from typing import Literal

from agent_rl.kernel.errors import EngineError

SGLANG_VERSION = "0.5.23"
STAMP_FILE = "agent-rl-engine.json"
INSTALL_HINT = "run `agent-rl engine install` (or point engine.venv / AGENT_RL_ENGINE__VENV at one)"
Device = Literal["cpu", "cuda"]


def requirements_file() -> Path:
    """The pinned requirements of the CPU engine environment, shipped with the package."""
    return Path(str(files("agent_rl.engine").joinpath("requirements-engine.txt")))


def compat_dir() -> Path:
    """The directory put first on a CPU engine's PYTHONPATH (its sitecustomize applies shims)."""
    return Path(str(files("agent_rl.engine").joinpath("sglang_cpu")))


def _digest(device: Device) -> str:
    spec = (
        requirements_file().read_bytes()
        if device == "cpu"
        else f"sglang=={SGLANG_VERSION}".encode()
    )
    return hashlib.sha256(device.encode() + b"\0" + spec).hexdigest()


def _read_stamp(venv: Path) -> dict | None:
    try:
        return json.loads((venv / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


def engine_python(venv: Path) -> Path:
    """The engine environment's interpreter; EngineError if it is missing or out of date."""
    python = venv / "bin" / "python"
    if not python.exists():
        raise EngineError(f"no engine environment at {venv}: {INSTALL_HINT}")
    stamp = _read_stamp(venv)
    if stamp is None or stamp.get("digest") != _digest(stamp.get("device", "cpu")):
        raise EngineError(
            f"the engine environment at {venv} is incomplete or out of date: {INSTALL_HINT}"
        )
    return python


def is_installed(venv: Path) -> bool:
    try:
        engine_python(venv)
    except EngineError:
        return False
    return True


def install_engine(
    venv: Path,
    device: Device = "cpu",
    *,
    python: str | None = None,
    force: bool = False,
    echo: Callable[[str], None] = print,
) -> bool:
    """Create or complete the engine venv; return False if it was already up to date."""
    venv = venv.expanduser().absolute()
    stamp = _read_stamp(venv)
    if not force and stamp is not None and stamp.get("digest") == _digest(device):
        echo(f"engine environment at {venv} is up to date (sglang {SGLANG_VERSION}, {device})")
        return False

    base = python or _base_python()
    if not (venv / "bin" / "python").exists():
        echo(f"creating the engine environment at {venv} (python: {base})")
        _run([base, "-m", "venv", str(venv)], "create the venv")
    py = str(venv / "bin" / "python")
    (venv / STAMP_FILE).unlink(missing_ok=True)  # an interrupted install must not look complete

    # Bytecode is compiled afterwards on every core (`_compile_bytecode`), not by pip.
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off", "-q",
           "--no-compile"]  # fmt: skip
    if device == "cpu":
        echo("installing SGLang and its pinned dependencies (CPU; a few minutes on first install)")
        _run([*pip, "--no-deps", "-r", str(requirements_file())], "install the engine requirements")
    else:
        echo(f"installing stock sglang=={SGLANG_VERSION} with its CUDA dependencies")
        _run([*pip, f"sglang=={SGLANG_VERSION}"], "install sglang")
    echo("compiling its bytecode")
    _compile_bytecode(py, venv / "lib")

    echo("checking that the engine imports")
    _smoke_test(py, device)
    (venv / STAMP_FILE).write_text(
        json.dumps({"digest": _digest(device), "device": device, "sglang": SGLANG_VERSION}) + "\n"
    )
    echo(f"engine environment ready at {venv}")
    return True


def engine_env(device: Device, cpu_threads: int = 1) -> dict[str, str]:
    """Environment variables for an engine process (CPU: SGLang's CPU engine + our shims)."""
    env = dict(os.environ)
    # The main venv's packages must not leak into the engine's interpreter.
    env.pop("PYTHONHOME", None)
    env.pop("VIRTUAL_ENV", None)
    # Models are local directories (the launcher checks): never reach for the Hugging Face Hub,
    # e.g. when a weight update names a path that does not exist.
    env["HF_HUB_OFFLINE"] = "1"
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["PYTHONPATH"] = str(compat_dir())
        env["OMP_NUM_THREADS"] = str(cpu_threads)
        env["CUDA_VISIBLE_DEVICES"] = ""
        # torch backs its CPU allocations of 2 MB and more with transparent huge pages. An
        # in-memory weight update receives each bucket into fresh memory, and faulting in 4 KB
        # pages was most of that: allocating and filling 420 MB took 0.11-0.12 s, 0.03 s on
        # huge pages once warm (bench/weight_sync.py in the README for the end-to-end figures).
        env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
        # When a child exits (as each does when stop() signals the group), SGLang's server slept
        # 5 s "to let GPU activity settle" before a py-spy dump of the schedulers and a CUDA
        # core dump: on CPU there is no GPU activity or core to dump, and py-spy is not in the
        # engine environment, so the sleep was all it did; stopping an engine took ~6 s.
        env.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0")
        env.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0")
    else:
        env.pop("PYTHONPATH", None)
        env.pop("SGLANG_USE_CPU_ENGINE", None)
    return env


def _compile_bytecode(py: str, lib: Path) -> None:
    """Compile every module under the environment's `lib` to bytecode, on every core.

    pip compiles what it installs one file at a time (about a minute of the install for torch,
    transformers and SGLang); `compileall -j 0` does the same work in parallel. The bytecode
    must be there: where PYTHONDONTWRITEBYTECODE is set (CI images, many containers), an engine
    process never writes it, so each start would compile SGLang, transformers and torch from
    source again. A file that does not compile (test data shipped as .py) is left as it is, as
    pip leaves it."""
    try:
        proc = subprocess.run([py, "-m", "compileall", "-q", "-q", "-j", "0", str(lib)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    except OSError as e:
        raise EngineError(f"could not compile the engine environment's bytecode: {e}") from e
    if proc.returncode not in (0, 1):  # 1: some file did not compile (see above)
        raise EngineError(f"could not compile the engine environment's bytecode (exit "
                          f"{proc.returncode}): {proc.stdout.strip()[-2000:]}")  # fmt: skip


def _smoke_test(py: str, device: Device) -> None:
    code = (
        "import torch, sglang, sglang.launch_server, sglang.srt.managers.scheduler\n"
        f"assert sglang.__version__ == {SGLANG_VERSION!r}, sglang.__version__\n"
    )
    if device == "cpu":
        code += (
            "import sglang.srt.mem_cache.pool_host.common as c\n"
            "assert c._cuda_host_register.__module__ == 'sitecustomize', 'compat not applied'\n"
        )
    _run([py, "-c", code], "import SGLang in the engine environment", env=engine_env(device))


def _base_python() -> str:
    # A venv's python creates new venvs from its base interpreter; the lock is for CPython 3.11.
    # The main venv may be on 3.12+ (the trainer runs there): then python3.11 from PATH.
    if sys.version_info[:2] == (3, 11):
        return sys.executable
    found = shutil.which("python3.11")
    if found is not None and _is_python311(found):
        return found
    raise EngineError(
        "the engine environment needs CPython 3.11 and none is on PATH: "
        "install python3.11 or pass --python /path/to/python3.11"
    )


def _is_python311(python: str) -> bool:
    # A pyenv shim exists for every installed version but fails unless that version is active.
    code = "import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)"
    try:
        return subprocess.run([python, "-c", code], capture_output=True).returncode == 0
    except OSError:
        return False


def _run(cmd: list[str], what: str, env: dict[str, str] | None = None) -> None:
    try:
        proc = subprocess.run(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    except OSError as e:
        raise EngineError(f"could not {what}: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        raise EngineError(f"could not {what} (exit {proc.returncode}); last output:\n{tail}")
