"""The default backend: one bubblewrap sandbox per episode, served by a persistent worker.

Each sandbox gets every namespace (user, pid, net, ipc, uts, cgroup), `--die-with-parent`, an
empty environment, read-only system dirs (/usr and a few files of /etc; never /etc/shadow, /root
or the server's files), a private sized /tmp and /dev/shm, and a work dir that is a sized tmpfs
with an inode limit, mounted on the host (so it survives a respawn). Its processes run in memory
and pids cgroups, under a seccomp filter (which also refuses nested user namespaces), as host
uids of its own (as root, an unmapped sandbox would be host root inside its user namespace):
two of them, the worker's and tool code's, mapped by the server into the user namespace
(bwrap, unprivileged, could map only one), so tool code can neither signal nor trace the worker.

Nothing of the host's paths reaches the sandbox's /proc: bwrap reads its arguments, the worker
and the seccomp filter from descriptors (not argv or bind mounts of the state dir), and
/proc/cmdline (the host's boot arguments) is empty. A watchdog of last resort: the launcher gives
bwrap a parent-death signal, bwrap gives one to the sandbox, and pid 1 of a pid namespace takes
every process with it, so a server that dies leaves no process behind; the reaper removes the
cgroups and mounts at the next start.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import anyio
from anyio.abc import Process

from agent_rl.config import SandboxConfig
from agent_rl.kernel.errors import SandboxError
from agent_rl.sdk.sandbox import WORK_DIR, SandboxSpec
from tools_sandbox import hostfs, seccomp
from tools_sandbox.backend import (
    HERE,
    PreparedSandbox,
    WorkerBackend,
    compact_json,
    stop_process,
)
from tools_sandbox.cgroups import CgroupLayout, SandboxCgroup
from tools_sandbox.ids import UidPool, new_id, owner_alive, owner_tag
from tools_sandbox.session import Channel, process_stderr, worker_config

PREFIX = "bw-"
WORKER_IN_SANDBOX = "/.agent-rl/worker.py"  # on bwrap's own root: never inside a rootfs
INNER_UID = 1000
"""The worker's uid and gid inside the sandbox."""
TOOL_INNER_UID = 1001
"""Tool code's uid and gid inside the sandbox."""
# what of /etc a Python needs, and nothing that holds secrets
ETC_FILES = ("/etc/alternatives", "/etc/ld.so.cache", "/etc/localtime", "/etc/ssl/certs",
             "/etc/mime.types")


class BwrapSandbox(PreparedSandbox):
    def __init__(self, backend: BwrapBackend, sandbox_id: str, spec: SandboxSpec, uid: int) -> None:
        super().__init__(backend, sandbox_id, spec, uid)
        self.backend = backend
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
        hostfs.mount_tmpfs(self.work, lim.disk_mb, self.tool_uid, self.tool_uid)

    def bwrap_args(self, fds: _Fds) -> tuple[list[str], list[str]]:
        """bwrap's options, read from a descriptor so that they (the host paths among them)
        stay out of /proc/1/cmdline, and the command, which bwrap takes only from argv."""
        lim, spec = self.spec.limits, self.spec
        # nested user namespaces: refused by the seccomp filter (bwrap's --disable-userns
        # cannot be combined with a uid map written from outside)
        argv = ["--unshare-all", "--unshare-user", "--userns-block-fd", str(fds.block),
                "--info-fd", str(fds.info), "--die-with-parent", "--new-session",
                "--hostname", "sandbox"]
        argv += _root_binds(spec.rootfs) if spec.rootfs else _host_binds()
        if spec.network:
            argv += ["--share-net", "--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf"]
        for m in spec.mounts:
            argv += ["--ro-bind" if m.read_only else "--bind", m.source, m.target]
        argv += ["--perms", "0444", "--ro-bind-data", str(fds.worker), WORKER_IN_SANDBOX,
                 "--proc", "/proc", "--ro-bind-data", str(fds.empty), "/proc/cmdline",
                 "--dev", "/dev",
                 "--perms", "1777", "--size", str(lim.tmp_mb << 20), "--tmpfs", "/dev/shm",
                 "--perms", "1777", "--size", str(lim.tmp_mb << 20), "--tmpfs", "/tmp",
                 "--bind", str(self.work), WORK_DIR, "--chdir", "/",
                 "--remount-ro", "/",  # the root is bwrap's tmpfs: nothing may be added to it
                 "--uid", str(INNER_UID), "--gid", str(INNER_UID), "--cap-drop", "ALL",
                 # for the worker to take its ids once (worker.py `become`), then it drops them
                 "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                 "--clearenv", "--seccomp", str(fds.seccomp)]
        ids = {"worker": [INNER_UID, INNER_UID], "tool": [TOOL_INNER_UID, TOOL_INNER_UID]}
        conf = worker_config(spec, WORK_DIR, ids=ids)
        for key, value in conf["env"].items():
            argv += ["--setenv", key, value]
        return argv, [self.backend.config.python, "-I", WORKER_IN_SANDBOX, compact_json(conf)]

    async def _spawn(self) -> Channel:
        launch = {"cgroups": self.cgroup.procs_files, "uid": self.uid, "gid": self.uid,
                  "env": {"PATH": "/usr/local/bin:/usr/bin:/bin"}}
        fds = _Fds(self.backend.filter_path(self.spec.sockets))
        try:
            options, command = self.bwrap_args(fds)
            args = os.memfd_create("bwrap-args")
            os.write(args, b"".join(a.encode() + b"\0" for a in options))
            os.lseek(args, 0, os.SEEK_SET)
            try:
                self.proc = await anyio.open_process(
                    [sys.executable, "-I", "-S", str(HERE / "launcher.py"), compact_json(launch),
                     "--", self.backend.bwrap, "--args", str(args), "--", *command],
                    pass_fds=(args, *fds.for_bwrap()), env={}, stderr=-1,
                )
            finally:
                os.close(args)
                fds.close_bwraps()
            await self._map_ids(fds)
        finally:
            fds.close()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        return Channel(self.proc.stdin, self.proc.stdout)

    async def _map_ids(self, fds: _Fds) -> None:
        """Map the worker's and tool code's uids (and gids) into the sandbox's user namespace,
        which bwrap has created and waits on (--userns-block-fd) until we have."""
        info = await _read_all(fds.info_r)
        proc = self.proc
        try:
            pid = int(json.loads(info)["child-pid"])
            with open(f"/proc/{pid}/status") as f:
                parent = next(int(x.split()[1]) for x in f if x.startswith("PPid:"))
        except (ValueError, KeyError, OSError, StopIteration) as e:
            why = await process_stderr(proc)
            raise SandboxError(f"bwrap did not report its sandbox ({info[:200]!r}): {why}") from e
        if proc is None or parent != proc.pid:
            raise SandboxError(f"bwrap reported pid {pid}, which is not its child")
        mapping = f"{INNER_UID} {self.uid} 1\n{TOOL_INNER_UID} {self.tool_uid} 1\n"
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(mapping)
        os.write(fds.block_w, b"1")

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

    async def _kill_tool_code(self) -> bool:
        return await anyio.to_thread.run_sync(self.cgroup.kill_uid, self.tool_uid, self.uid)

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


class _Fds:
    """The descriptors one bwrap start needs: what bwrap reads (seccomp filter, worker source,
    empty data for /proc/cmdline), its info pipe (it reports its child's pid) and its block
    pipe (it waits there until the uid map is written)."""

    def __init__(self, seccomp_filter: Path) -> None:
        self.seccomp = os.open(seccomp_filter, os.O_RDONLY)
        self.worker = os.open(HERE / "worker.py", os.O_RDONLY)
        self.empty = os.open(os.devnull, os.O_RDONLY)
        self.info_r, self.info = os.pipe()
        self.block, self.block_w = os.pipe()
        self._open = {self.seccomp, self.worker, self.empty, self.info_r, self.info, self.block,
                      self.block_w}

    def for_bwrap(self) -> tuple[int, ...]:
        return self.seccomp, self.worker, self.empty, self.info, self.block

    def close_bwraps(self) -> None:
        """Close our copies of bwrap's ends: the info pipe then ends when bwrap closes it."""
        for fd in self.for_bwrap():
            self._close(fd)

    def close(self) -> None:
        for fd in list(self._open):
            self._close(fd)

    def _close(self, fd: int) -> None:
        if fd in self._open:
            self._open.discard(fd)
            os.close(fd)


async def _read_all(fd: int) -> str:
    """Everything until EOF from a pipe, without blocking the event loop."""
    os.set_blocking(fd, False)
    data = b""
    while True:
        await anyio.wait_readable(fd)
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            continue
        if not chunk:
            return data.decode("utf-8", "replace")
        data += chunk


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
