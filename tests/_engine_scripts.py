"""Scripts for the engine environment's python, run as `subprocess.run` would run them, but
forked from one process per test worker that imported SGLang and its model classes once
(tests/_engine_forkserver.py): a script costs its own work, not SGLang's ~10 s import. For the
tests that check SGLang's side of something in its own classes (a draft loading an export, the
engine's argument parser), with the environment of a CPU engine (`engine_env("cpu")`)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
from pathlib import Path
from typing import Any

from agent_rl.engine.install import engine_env, engine_python

FORKSERVER = Path(__file__).with_name("_engine_forkserver.py")


class EngineScripts:
    def __init__(self, venv: Path, workdir: Path) -> None:
        self.venv, self.workdir = venv, workdir
        self.server: subprocess.Popen[str] | None = None
        self.runs = 0

    def run(self, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """`python *argv` in the engine environment (a script's path, or "-c" and code, then
        its arguments); its exit status and output. A run past `timeout` raises TimeoutError
        and takes the fork server down with it (the next run starts another)."""
        server = self._started()
        self.runs += 1
        out, err = self.workdir / f"run-{self.runs}.out", self.workdir / f"run-{self.runs}.err"
        assert server.stdin is not None
        server.stdin.write(json.dumps({"argv": list(argv), "stdout": str(out), "stderr": str(err)}) + "\n")
        server.stdin.flush()
        code = self._reply(timeout)["returncode"]
        return subprocess.CompletedProcess(list(argv), code, out.read_text(), err.read_text())

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait()
        self.server = None

    def _started(self) -> subprocess.Popen[str]:
        if self.server is None or self.server.poll() is not None:
            log = open(self.workdir / "forkserver.log", "a")  # noqa: SIM115 (the server's, kept open)
            self.server = subprocess.Popen(
                [str(engine_python(self.venv)), str(FORKSERVER)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, env=engine_env("cpu"), text=True,
                start_new_session=True)  # fmt: skip
            log.close()
            self._reply(300)  # ready: SGLang imported
        return self.server

    def _reply(self, timeout: float) -> dict[str, Any]:
        assert self.server is not None and self.server.stdout is not None
        ready, _, _ = select.select([self.server.stdout], [], [], timeout)
        line = self.server.stdout.readline() if ready else ""
        if not line:
            log = (self.workdir / "forkserver.log").read_text()[-3000:]
            self.close()
            if not ready:
                raise TimeoutError(f"the engine environment's script ran past {timeout} s")
            raise RuntimeError(f"the engine environment's fork server exited; its log:\n{log}")
        return json.loads(line)
