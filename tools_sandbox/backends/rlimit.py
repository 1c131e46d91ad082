"""The insecure fallback backend: a worker under rlimits and its own uid, and no isolation.

For machines with neither bubblewrap nor Docker, and only when chosen explicitly
(`sandbox.backend = "rlimit"`); it logs a warning when it starts. Tool code sees the host's
whole filesystem (whatever its uid may read), the host's network and the host's processes.
What it does bound: CPU time, address space, processes (RLIMIT_NPROC counts the sandbox's own
uid), file size and descriptors, wall time and output (the worker), and, as root, a sized tmpfs
work dir and uids of its own (the worker's, and tool code's, which cannot signal the worker) so
the sandbox cannot signal the server. Without root it runs as the server's uid, so it cannot
even stop tool code from killing the server. There is no seccomp filter.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time

import anyio
from anyio.abc import Process

from agent_rl.config import SandboxConfig
from agent_rl.kernel.errors import SandboxError
from agent_rl.sdk.sandbox import SandboxSpec
from tools_sandbox import hostfs
from tools_sandbox.backend import (
    HERE,
    PreparedSandbox,
    WorkerBackend,
    compact_json,
    stop_process,
)
from tools_sandbox.ids import UidPool, new_id, owner_alive, owner_tag
from tools_sandbox.session import Channel, process_stderr, worker_config

log = logging.getLogger(__name__)
PREFIX = "rl-"


def real_uid(pid: str) -> int | None:
    """A process's real uid (the owner of /proc/<pid> is its effective uid: the worker's is
    tool code's)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
    except (OSError, StopIteration, ValueError):
        return None


def kill_uid(uids: set[int], wait_s: float = 5.0) -> bool:
    """SIGKILL every process whose real uid is in `uids` until none is left; True if none is."""
    deadline = time.monotonic() + wait_s
    while True:
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit() or real_uid(name) not in uids:
                continue
            try:
                os.kill(int(name), signal.SIGKILL)
                found = True
            except OSError:
                continue
        if not found:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)


class RlimitSandbox(PreparedSandbox):
    def __init__(self, backend: RlimitBackend, sandbox_id: str, spec: SandboxSpec,
                 uid: int | None) -> None:
        super().__init__(backend, sandbox_id, spec, uid)
        self.backend = backend
        self.work = self.dir / "work"
        self.proc: Process | None = None

    def prepare(self) -> None:
        self.dir.mkdir()
        (self.dir / "owner").write_text(owner_tag())
        if self.uid is not None:
            self.dir.chmod(0o711)
            hostfs.mount_tmpfs(self.work, self.spec.limits.disk_mb, self.tool_uid, self.tool_uid)
        else:
            self.work.mkdir(mode=0o700)

    async def _spawn(self) -> Channel:
        lim = self.spec.limits
        extra: dict[str, object] = {}
        launch: dict[str, object] = {}
        if self.uid is not None:
            tool = self.tool_uid
            extra["ids"] = {"worker": [self.uid, self.uid], "tool": [tool, tool]}
            launch.update(uid=self.uid, gid=self.uid, euid=tool, egid=tool)
        conf = worker_config(self.spec, str(self.work), as_bytes=lim.memory_mb << 20,
                             nproc=lim.pids, sweep=self.uid is not None, **extra)
        launch["env"] = conf["env"]
        python = self.backend.python
        self.proc = await anyio.open_process(
            [sys.executable, "-I", "-S", str(HERE / "launcher.py"), compact_json(launch), "--",
             python, "-I", str(self.backend.worker), compact_json(conf)],
            env={}, stderr=-1, cwd=str(self.work),
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        return Channel(self.proc.stdin, self.proc.stdout)

    async def _kill(self) -> None:
        ok = True
        if self.uid is not None:
            ok = await anyio.to_thread.run_sync(kill_uid, {self.uid, self.tool_uid})
        proc, self.proc = self.proc, None
        await stop_process(proc)
        if not ok:
            raise SandboxError(f"sandbox {self.id}: processes of uid {self.uid} survived SIGKILL")

    async def _diagnostics(self) -> str:
        return await process_stderr(self.proc)

    def _oom_kills(self) -> int:
        return 0  # no cgroup: the worker reports MemoryError (RLIMIT_AS) itself

    async def _destroy(self) -> None:
        await anyio.to_thread.run_sync(hostfs.remove_tree, self.dir)
        if self.uid is not None:
            self.backend.uids.give_back(self.uid)


class RlimitBackend(WorkerBackend[RlimitSandbox]):
    """Creates rlimit-only sandboxes. NOT isolation: see the module docstring."""

    name = "rlimit"

    def __init__(self, config: SandboxConfig) -> None:
        log.warning(
            "sandbox backend 'rlimit' is NOT a sandbox: tool code can read the host's files, use "
            "its network and see its processes. Use it only for trusted code on machines without "
            "bubblewrap or Docker; choose sandbox.backend = 'bwrap' or 'docker' otherwise."
        )
        super().__init__(config)
        self.worker = self.install_worker()
        # the system's interpreter, not the server's venv (maybe in a home dir others cannot read)
        python = shutil.which(config.python, path="/usr/local/bin:/usr/bin:/bin")
        if python is None:
            raise SandboxError(f"no {config.python!r} on PATH for the rlimit backend's worker")
        self.python = python
        self.as_root = os.geteuid() == 0
        self.uids = UidPool(config.uid_base + 100_000)

    def _new(self, spec: SandboxSpec) -> RlimitSandbox:
        if spec.mounts:
            raise SandboxError("the rlimit backend cannot mount paths: it shares the host's files")
        if spec.rootfs:
            raise SandboxError(
                "spec.rootfs is for the bwrap backend; rlimit sandboxes share the host's files")
        uid = self.uids.take() if self.as_root else None
        return RlimitSandbox(self, new_id(PREFIX), spec, uid)

    async def reap(self) -> int:
        """Remove work dirs of rlimit sandboxes whose server is gone; their processes died with
        it (parent-death signal) or are killed by uid below."""
        def sync() -> int:
            n = 0
            for d in self.root.iterdir():
                if not (d.is_dir() and d.name.startswith(PREFIX)) or d.name in self._live:
                    continue
                try:
                    if owner_alive((d / "owner").read_text()):
                        continue
                except OSError:
                    pass
                work = d / "work"
                if self.as_root and work.exists():
                    owner = work.stat().st_uid  # tool code's; the worker's is the one below
                    if owner > self.config.uid_base:
                        kill_uid({owner - 1, owner})
                hostfs.remove_tree(d)
                n += 1
            return n

        return await anyio.to_thread.run_sync(sync)
