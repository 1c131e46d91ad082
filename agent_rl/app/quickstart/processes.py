"""A small process supervisor: the quickstart's engines, router, serves and trainer are ordinary
`agent-rl` commands, each an OS process with its own log, restarted when it dies.

That is the deployment the quickstart mirrors (one process per role, as on a cluster), and what
lets the chaos run SIGKILL any of them: `Supervisor.watch` notices the death, records it and
starts the same command again. `stop` ends a process the way an operator would (SIGTERM, then
SIGKILL after a grace period), and a stopped process is not restarted.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from agent_rl.kernel.processes import signal_tree

log = logging.getLogger(__name__)


def agent_rl_command(*args: str) -> list[str]:
    """`agent-rl ARGS...` with this interpreter (so a venv need not be on PATH)."""
    return [sys.executable, "-m", "agent_rl.app.cli", *args]


@dataclass
class Managed:
    """One supervised process."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    restart: bool = True
    """Start it again when it dies (not after `stop`, nor after a clean exit)."""
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    deaths: list[int] = field(default_factory=list)
    """Exit statuses of unexpected ends (negative: killed by that signal)."""
    stopped: bool = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    def __init__(self, cwd: Path, on_event: Callable[[str], None] | None = None) -> None:
        self.cwd = cwd
        self.procs: dict[str, Managed] = {}
        self.on_event = on_event or (lambda line: log.info("%s", line))

    def add(self, name: str, argv: list[str], *, log_path: Path, env: dict[str, str] | None = None,
            restart: bool = True) -> Managed:  # fmt: skip
        m = Managed(name, argv, log_path, env or {}, restart)
        self.procs[name] = m
        self.start(m)
        return m

    def start(self, m: Managed) -> None:
        m.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(m.log_path, "ab")  # noqa: SIM115 - handed to the child
        out.write(f"\n===== {time.strftime('%H:%M:%S')} start: {' '.join(m.argv)}\n".encode())
        out.flush()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **m.env}
        # Its own session: a Ctrl-C on the terminal reaches the quickstart, which stops the
        # children in order, instead of every process at once.
        m.proc = subprocess.Popen(m.argv, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        out.close()
        m.starts += 1
        m.stopped = False

    def __getitem__(self, name: str) -> Managed:
        return self.procs[name]

    async def watch(self, poll_s: float = 0.5) -> None:
        """Restart processes that die (run as a background task until cancelled)."""
        while True:
            for m in list(self.procs.values()):
                if m.proc is None or m.stopped or m.proc.poll() is None:
                    continue
                code = m.proc.returncode
                if code == 0 or not m.restart:
                    continue
                m.deaths.append(code)
                self.on_event(f"{m.name} exited ({_describe(code)}); restarting it")
                self.start(m)
            await anyio.sleep(poll_s)

    def failed(self) -> list[Managed]:
        """Processes that ended with an error and are not restarted."""
        return [m for m in self.procs.values()
                if m.proc is not None and not m.stopped and not m.restart
                and m.proc.poll() not in (None, 0)]  # fmt: skip

    async def wait(self, name: str, timeout_s: float | None = None) -> int:
        """Wait until `name` exits on its own; its exit status."""
        m = self.procs[name]
        assert m.proc is not None
        with anyio.fail_after(timeout_s):
            while m.proc.poll() is None:
                await anyio.sleep(0.2)
        return m.proc.returncode

    async def stop(self, name: str, *, grace_s: float = 30.0, sig: int = signal.SIGTERM) -> None:
        """Signal `name` (SIGTERM by default), SIGKILL its process group after `grace_s`."""
        m = self.procs[name]
        m.stopped = True
        if m.proc is None or m.proc.poll() is not None:
            return
        signal_tree(m.proc.pid, sig)
        deadline = time.monotonic() + grace_s
        while m.proc.poll() is None and time.monotonic() < deadline:
            await anyio.sleep(0.1)
        if m.proc.poll() is None:
            self.on_event(f"{m.name} did not stop within {grace_s:.0f}s; killing it")
            signal_tree(m.proc.pid, signal.SIGKILL)
            m.proc.wait()
        # Whatever it started (an engine's scheduler processes) goes with it.
        signal_tree(m.proc.pid, signal.SIGKILL)

    async def stop_all(self, order: list[str] | None = None, grace_s: float = 30.0) -> None:
        for name in order or list(reversed(self.procs)):
            if name in self.procs:
                await self.stop(name, grace_s=grace_s)

    def kill(self, name: str) -> int:
        """SIGKILL `name` and its process group (the chaos run); the watcher restarts it."""
        m = self.procs[name]
        assert m.proc is not None and m.proc.poll() is None, f"{name} is not running"
        pid = m.proc.pid
        signal_tree(m.proc.pid, signal.SIGKILL)
        return pid


def _describe(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"
