"""One role's OS process on the node Ray placed it on.

A `RoleProcess` is a Ray actor (made remote in supervisor.py, so importing this module needs no
Ray) that owns exactly one `agent-rl ...` process: the command a user would type on that node,
with its output appended to the role's log. The process is the role; the actor only starts it,
reports where it runs, waits for its end, signals it and reads its log. Ray holds the actor's
resources (accelerators, CPUs) for as long as the actor lives, which is as long as the process.

The process also dies with the actor's: a `ray stop`, a raylet that goes away, or an actor
killed by Ray take the process down at once (Linux's PR_SET_PDEATHSIG; an engine's SGLang and
a serve's sandboxes are tied to it the same way), instead of leaving it serving on as an orphan
that holds its port, its memory and its accelerators.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agent_rl.kernel.processes import die_with_parent, signal_tree


class RoleProcess:
    def __init__(self, name: str, cwd: str, log_path: str) -> None:
        self.name, self.cwd = name, cwd
        self.log_path = Path(cwd) / log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._started = threading.Event()
        # The one thread that starts the process. PR_SET_PDEATHSIG fires when the thread that
        # forked ends, not its process: this one lives as long as the actor (an executor's
        # worker ends only at its shutdown), unlike whichever of Ray's threads calls start().
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-spawn")

    def where(self) -> dict[str, str]:
        """This node's Ray id and address."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address()}  # fmt: skip

    def free_port(self) -> int:
        """A TCP port free on this node now (for the engine's server, the trainer's rendezvous)."""
        return free_port()

    def start(self, args: list[str], env: dict[str, str]) -> int:
        """Start `agent-rl ARGS` (this node's interpreter) in the run's directory; its pid."""
        return self._spawner.submit(self._spawn, args, env).result()

    def _spawn(self, args: list[str], env: dict[str, str]) -> int:
        argv = [sys.executable, "-m", "agent_rl.app.cli", *args]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            out.write(f"\n===== {time.strftime('%H:%M:%S')} start on {socket.gethostname()}: "
                      f"agent-rl {' '.join(args)}\n".encode())  # fmt: skip
            out.flush()
            # Its own session: a signal meant for it (stop) reaches what it started too.
            self.proc = subprocess.Popen(
                argv, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                start_new_session=True, preexec_fn=die_with_parent(),
            )  # fmt: skip
        self._started.set()
        return self.proc.pid

    def wait(self) -> int:
        """Block until the process ends; its exit status (negative: the signal that ended it)."""
        self._started.wait()
        assert self.proc is not None
        return self.proc.wait()

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 30.0) -> int | None:
        """Send `sig` to the process; SIGKILL it and everything it started after `grace_s`.
        Its exit status (None if it never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            signal_tree(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Whatever it started (an engine's SGLang, in a session of its own) goes with it.
        signal_tree(self.proc.pid, signal.SIGKILL)
        return self.proc.wait()

    def tail(self, lines: int = 50) -> str:
        """The last `lines` lines of the role's log on this node."""
        return tail_file(self.log_path, lines)


def kill_orphan(pid: int) -> bool:
    """SIGKILL the role process `pid` on this node and everything it started, if it still runs
    an `agent-rl` command (its actor died without stopping it); whether it did."""
    import psutil

    try:
        if "agent_rl.app.cli" not in psutil.Process(pid).cmdline():
            return False
    except psutil.Error:
        return False
    signal_tree(pid, signal.SIGKILL)
    return True


def free_port() -> int:
    """A port free on this node, outside the kernel's range for outgoing connections: a server
    binds it only after loading (an engine: 20 s and more), and a port from that range could be
    taken by a connection meanwhile (as agent_rl/engine/launcher.py picks its own)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32_768, 60_999
    ports = [p for a, b in ((10_000, low - 1), (high + 1, 65_535)) for p in range(a, b + 1)]
    for _ in range(64):
        with socket.socket() as s:
            try:
                s.bind(("", random.choice(ports) if ports else 0))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError("no free port on this node")


def tail_file(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 200 * lines - 4096))
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"(no log at {path}: {e.strerror})\n"
    return "\n".join(text.splitlines()[-lines:]) + "\n"
