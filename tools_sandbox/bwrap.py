"""The default backend: one bubblewrap sandbox per episode, served by a persistent worker.

Each sandbox gets every namespace (user, pid, net, ipc, uts, cgroup; no nested user
namespaces), `--die-with-parent`, an empty environment, read-only system dirs (/usr and a few
files of /etc; never /etc/shadow, /root or the server's files), a private sized /tmp, and a
work dir that is a sized tmpfs mounted on the host (so it survives a respawn). Its processes run
as a host uid of its own (as root, an unmapped sandbox would be host root inside its user
namespace), in memory and pids cgroups, under a seccomp filter. A watchdog of last resort: the
launcher gives bwrap a parent-death signal, bwrap gives one to the sandbox, and pid 1 of a pid
namespace takes every process with it, so a server that dies leaves no process behind; the
reaper removes the cgroups and mounts at the next start.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import anyio
from anyio.abc import Process

from agent_rl.config import SandboxConfig
from agent_rl.errors import SandboxError
from tools_sandbox import hostfs, seccomp
from tools_sandbox.backend import (
    HERE,
    PreparedSandbox,
    WorkerBackend,
    compact_json,
    stop_process,
)
from tools_sandbox.base import WORK_DIR, SandboxSpec
from tools_sandbox.cgroups import CgroupLayout, SandboxCgroup
from tools_sandbox.ids import UidPool, new_id, owner_alive, owner_tag
from tools_sandbox.session import Channel, process_stderr, worker_config

PREFIX = "bw-"
WORKER_IN_SANDBOX = "/.agent-rl/worker.py"  # on bwrap's own root: never inside a rootfs
INNER_UID = 1000
# what of /etc a Python needs, and nothing that holds secrets
ETC_FILES = ("/etc/alternatives", "/etc/ld.so.cache", "/etc/localtime", "/etc/ssl/certs",
             "/etc/mime.types")


class BwrapSandbox(PreparedSandbox):
    def __init__(self, backend: BwrapBackend, sandbox_id: str, spec: SandboxSpec, uid: int) -> None:
        super().__init__(sandbox_id, spec, backend._forget)
        self.backend = backend
        self.uid = uid
        self.dir = backend.root / sandbox_id
        self.work = self.dir / "work"
        self.cgroup = SandboxCgroup(backend.layout, sandbox_id)
        self.proc: Process | None = None

    def prepare(self) -> None:
        """Host resources that outlive respawns: the cgroups and the work dir tmpfs."""
        lim = self.spec.limits
        self.dir.mkdir()
        self.dir.chmod(0o711)
        (self.dir / "owner").write_text(owner_tag())  # lets reapers tell ours from orphans
        self.cgroup.create(lim.memory_mb << 20, lim.pids, lim.cpus)
        hostfs.mount_tmpfs(self.work, lim.disk_mb, self.uid, self.uid)

    def bwrap_argv(self, seccomp_fd: int) -> list[str]:
        lim, spec = self.spec.limits, self.spec
        argv = [self.backend.bwrap, "--unshare-all", "--unshare-user", "--disable-userns",
                "--die-with-parent", "--new-session", "--hostname", "sandbox"]
        argv += _root_binds(spec.rootfs) if spec.rootfs else _host_binds()
        if spec.network:
            argv += ["--share-net", "--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf"]
        for m in spec.mounts:
            argv += ["--ro-bind" if m.read_only else "--bind", m.source, m.target]
        argv += ["--ro-bind", str(self.backend.worker), WORKER_IN_SANDBOX,
                 "--proc", "/proc", "--dev", "/dev",
                 "--size", str(lim.tmp_mb << 20), "--tmpfs", "/tmp",
                 "--bind", str(self.work), WORK_DIR, "--chdir", WORK_DIR,
                 "--remount-ro", "/",  # the root is bwrap's tmpfs: nothing may be added to it
                 "--uid", str(INNER_UID), "--gid", str(INNER_UID), "--cap-drop", "ALL",
                 "--clearenv", "--seccomp", str(seccomp_fd)]
        conf = worker_config(spec, WORK_DIR)
        for key, value in conf["env"].items():
            argv += ["--setenv", key, value]
        return argv + ["--", self.backend.config.python, "-I", WORKER_IN_SANDBOX,
                       compact_json(conf)]

    async def _spawn(self) -> Channel:
        launch = {"cgroups": self.cgroup.procs_files, "uid": self.uid, "gid": self.uid,
                  "env": {"PATH": "/usr/local/bin:/usr/bin:/bin"}}
        fd = os.open(self.backend.filter_path(self.spec.network), os.O_RDONLY)
        try:
            self.proc = await anyio.open_process(
                [sys.executable, "-I", "-S", str(HERE / "launcher.py"), compact_json(launch), "--",
                 *self.bwrap_argv(fd)],
                pass_fds=(fd,), env={}, stderr=-1,
            )
        finally:
            os.close(fd)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        return Channel(self.proc.stdin, self.proc.stdout)

    async def _kill(self) -> None:
        ok = await anyio.to_thread.run_sync(self.cgroup.kill_all)
        proc, self.proc = self.proc, None
        await stop_process(proc)  # the launcher may not have joined the cgroups yet
        if not ok:
            raise SandboxError(f"sandbox {self.id}: processes survived SIGKILL for 5 s")

    async def _diagnostics(self) -> str:
        return await process_stderr(self.proc)

    def _oom_kills(self) -> int:
        return self.cgroup.oom_kills()

    async def _destroy(self) -> None:
        await anyio.to_thread.run_sync(self._remove_host_state)
        self.backend.uids.give_back(self.uid)

    def _remove_host_state(self) -> None:
        self.cgroup.remove()
        hostfs.remove_tree(self.dir)


class BwrapBackend(WorkerBackend[BwrapSandbox]):
    """Creates bubblewrap sandboxes; one per process. Needs root, bwrap, cgroups, libseccomp."""

    name = "bwrap"

    def __init__(self, config: SandboxConfig) -> None:
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxError("bubblewrap is not installed: apt-get install bubblewrap")
        self.bwrap = bwrap
        if os.geteuid() != 0:
            raise SandboxError("the bwrap backend needs root (cgroups, uids, work-dir mounts)")
        super().__init__(config)
        self.worker = self.install_worker()
        self.layout = CgroupLayout.detect(config.cgroup_parent)
        self.layout.prepare()
        self.uids = UidPool(config.uid_base)
        self._filters = {
            net: seccomp.write_filter(self.root / f"seccomp{'-net' * net}.bpf", network=net)
            for net in (False, True)
        }

    def filter_path(self, network: bool) -> Path:
        return self._filters[network]

    def _new(self, spec: SandboxSpec) -> BwrapSandbox:
        return BwrapSandbox(self, new_id(PREFIX), spec, self.uids.take())

    async def reap(self) -> int:
        """Remove cgroups, mounts and dirs of bwrap sandboxes whose server process is gone."""
        return await anyio.to_thread.run_sync(self._reap_sync)

    def _reap_sync(self) -> int:
        ids = {i for i in self.layout.sandbox_ids() if i.startswith(PREFIX)}
        ids |= {p.name for p in self.root.iterdir() if p.name.startswith(PREFIX) and p.is_dir()}
        ids = {i for i in ids - set(self._live) if not _owned_by_live_server(self.root / i)}
        for sandbox_id in ids:
            cgroup = SandboxCgroup(self.layout, sandbox_id)
            cgroup.kill_all()
            cgroup.remove()
            hostfs.remove_tree(self.root / sandbox_id)
        return len(ids)


def _host_binds() -> list[str]:
    """The host's /usr (and merged-/usr links) and the harmless part of /etc, read-only."""
    argv = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "lib", "lib64", "sbin", "lib32", "libx32"):
        if os.path.islink(f"/{name}"):
            argv += ["--symlink", os.readlink(f"/{name}"), f"/{name}"]
        elif os.path.isdir(f"/{name}"):
            argv += ["--ro-bind", f"/{name}", f"/{name}"]
    for path in ETC_FILES:
        argv += ["--ro-bind-try", path, path]
    return argv


def _root_binds(rootfs: str) -> list[str]:
    """Each top-level entry of `rootfs`, read-only, onto bwrap's own root, so that the mount
    points bwrap still has to create (/opt, /work, /tmp) land on its tmpfs, not on rootfs."""
    if not os.path.isdir(rootfs):
        raise SandboxError(f"rootfs {rootfs!r} is not a directory")
    argv: list[str] = []
    for name in sorted(os.listdir(rootfs)):
        path = os.path.join(rootfs, name)
        if name in ("proc", "dev", "tmp", "work", "sys"):
            continue
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), f"/{name}"]
        else:
            argv += ["--ro-bind", path, f"/{name}"]
    return argv


def _owned_by_live_server(sandbox_dir: Path) -> bool:
    try:
        return owner_alive((sandbox_dir / "owner").read_text())
    except OSError:
        return False
