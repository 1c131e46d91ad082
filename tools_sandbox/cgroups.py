"""Per-sandbox cgroups: memory, pids and CPU limits, OOM accounting, killing a whole sandbox.

Two layouts are supported. cgroup v1 (what this project's machines have): one directory per
sandbox under the `memory`, `pids` and (when mounted) `cpu` hierarchies, plus one in the v2
`unified` hierarchy when it is mounted, only for its atomic `cgroup.kill`. cgroup v2: one
directory with `memory.max`, `memory.swap.max`, `pids.max`, `cpu.max` and `cgroup.kill`. All
sandbox cgroups live under one parent named by the config (`agent-rl` by default) at the top of
each hierarchy, so a restarted server finds what a crashed one left (`BwrapBackend.reap`).
Needs root.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from agent_rl.kernel.errors import SandboxError

ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000
"""CFS period of the CPU quota: the sandbox gets `cpus` times this much CPU time per period."""


def _write(path: Path, value: str) -> None:
    path.write_text(value)


@dataclass(frozen=True)
class CgroupLayout:
    """Where sandbox cgroups go on this host."""

    v2: bool
    parent: str

    @classmethod
    def detect(cls, parent: str) -> CgroupLayout:
        if (ROOT / "cgroup.controllers").exists():
            return cls(v2=True, parent=parent)
        if (ROOT / "memory").is_dir() and (ROOT / "pids").is_dir():
            return cls(v2=False, parent=parent)
        raise SandboxError(
            "no usable cgroups (need /sys/fs/cgroup/{memory,pids} or a cgroup v2 mount): run as "
            "root on a host with cgroups, or choose sandbox.backend = 'docker'"
        )

    def parents(self) -> list[Path]:
        if self.v2:
            return [ROOT / self.parent]
        dirs = [ROOT / "memory" / self.parent, ROOT / "pids" / self.parent]
        if (ROOT / "cpu" / "cpu.cfs_quota_us").exists():
            dirs.append(ROOT / "cpu" / self.parent)
        if (ROOT / "unified" / "cgroup.procs").exists():
            dirs.append(ROOT / "unified" / self.parent)
        return dirs

    def prepare(self) -> None:
        """Create the parents (and, on v2, delegate the memory, pids and cpu controllers)."""
        try:
            for d in self.parents():
                d.mkdir(exist_ok=True)
            if self.v2:
                for d in (ROOT, ROOT / self.parent):
                    _write(d / "cgroup.subtree_control", "+memory +pids +cpu")
        except OSError as e:
            raise SandboxError(
                f"cannot set up sandbox cgroups under {self.parents()[0]}: {e}; the bwrap backend "
                "needs root and writable cgroups"
            ) from e

    def sandbox_ids(self) -> set[str]:
        ids: set[str] = set()
        for d in self.parents():
            if d.is_dir():
                ids |= {p.name for p in d.iterdir() if p.is_dir()}
        return ids


class SandboxCgroup:
    """The cgroups of one sandbox."""

    def __init__(self, layout: CgroupLayout, sandbox_id: str) -> None:
        self.layout = layout
        self.dirs = [p / sandbox_id for p in layout.parents()]

    def create(self, memory_bytes: int, pids: int, cpus: float) -> None:
        quota = max(1000, int(cpus * PERIOD_US))
        try:
            for d in self.dirs:
                d.mkdir(exist_ok=True)
            if self.layout.v2:
                _write(self.dirs[0] / "memory.max", str(memory_bytes))
                _write(self.dirs[0] / "memory.swap.max", "0")
                _write(self.dirs[0] / "pids.max", str(pids))
                _write(self.dirs[0] / "cpu.max", f"{quota} {PERIOD_US}")
            else:
                mem, pid = self.dirs[0], self.dirs[1]
                _write(mem / "memory.limit_in_bytes", str(memory_bytes))
                try:  # memory+swap: absent when swap accounting is off (then no swap is used)
                    _write(mem / "memory.memsw.limit_in_bytes", str(memory_bytes))
                except OSError:
                    pass
                _write(pid / "pids.max", str(pids))
                for d in self.dirs:
                    if d.parent.parent == ROOT / "cpu":
                        _write(d / "cpu.cfs_period_us", str(PERIOD_US))
                        _write(d / "cpu.cfs_quota_us", str(quota))
        except OSError as e:
            self.remove()
            raise SandboxError(f"cannot create sandbox cgroup {self.dirs[0]}: {e}") from e

    @property
    def procs_files(self) -> list[str]:
        """The cgroup.procs files a process writes its pid to, to join this sandbox."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def oom_kills(self) -> int:
        path, key = (
            (self.dirs[0] / "memory.events", "oom_kill")
            if self.layout.v2
            else (self.dirs[0] / "memory.oom_control", "oom_kill")
        )
        try:
            for line in path.read_text().splitlines():
                if line.startswith(key + " "):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def pids(self) -> list[int]:
        out: set[int] = set()
        for d in self.dirs:
            try:
                out |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
            except OSError:
                continue
        return sorted(out)

    def kill_all(self, wait_s: float = 5.0) -> bool:
        """SIGKILL every process of the sandbox and wait until none is left; True if empty."""
        kills = [d / "cgroup.kill" for d in self.dirs if (d / "cgroup.kill").exists()]
        kill_file = kills[0] if kills else None
        deadline = time.monotonic() + wait_s
        while True:
            pids = self.pids()
            if not pids:
                return True
            if time.monotonic() > deadline:
                return False
            try:
                if kill_file is not None:
                    _write(kill_file, "1")  # atomic: a fork bomb cannot outrun it
                else:
                    for pid in pids:
                        os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
            time.sleep(0.005)

    def kill_uid(self, uid: int, keep_uid: int) -> bool:
        """`freeze_kill` on this sandbox's cgroup; False where it has no `cgroup.freeze`."""
        dirs = [d for d in self.dirs if (d / "cgroup.freeze").exists()]
        return bool(dirs) and freeze_kill(dirs[0], uid, keep_uid)

    def remove(self) -> None:
        """Remove the directories (after kill_all); missing ones are fine."""
        for d in self.dirs:
            for _ in range(100):  # rmdir fails with EBUSY while the last process is being torn down
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


def process_cgroup(pid: int) -> Path | None:
    """The v2 cgroup (v2, or v1's unified hierarchy) of a process, where it can be frozen."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            rel = next(line.split(":", 2)[2].strip() for line in f if line.startswith("0::"))
    except (OSError, StopIteration):
        return None
    for root in (ROOT, ROOT / "unified"):
        d = root / rel.lstrip("/")
        if (d / "cgroup.freeze").exists():
            return d
    return None


def freeze_kill(d: Path, uid: int, keep_uid: int, wait_s: float = 2.0) -> bool:
    """Freeze cgroup `d` (`cgroup.freeze`), SIGKILL every process in it with real uid `uid`
    (found by thread, so a zombie leader's live threads count), thaw it and wait until none is
    left. Atomic against forks: nothing forks while frozen, and a frozen process still dies of
    SIGKILL. False, having killed nothing, where no process of `keep_uid` (the worker) is in it
    (the uids seen from here are not the sandbox's: a user-namespace remap); False too where a
    process of `uid` survives. The caller then kills the whole sandbox instead."""
    deadline = time.monotonic() + wait_s
    try:
        _write(d / "cgroup.freeze", "1")
        while "frozen 1" not in (d / "cgroup.events").read_text():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        if keep_uid not in _thread_uids(d).values():
            return False
        _kill_uid_threads(d, uid)
    except OSError:
        return False
    finally:
        try:
            _write(d / "cgroup.freeze", "0")
        except OSError:
            pass
    while _kill_uid_threads(d, uid):  # (dying: gone within a few ms)
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _thread_uids(d: Path) -> dict[int, int]:
    """Real uid of every thread of cgroup `d` that is still there."""
    out = {}
    for tid in (d / "cgroup.threads").read_text().split():
        try:
            with open(f"/proc/{tid}/status") as f:
                out[int(tid)] = next(int(x.split()[1]) for x in f if x.startswith("Uid:"))
        except (OSError, StopIteration, ValueError):
            continue  # gone
    return out


def _kill_uid_threads(d: Path, uid: int) -> bool:
    """SIGKILL the processes of cgroup `d` with real uid `uid`; whether there were any."""
    found = False
    for tid, real in _thread_uids(d).items():
        if real == uid:
            found = True
            try:
                os.kill(tid, signal.SIGKILL)
            except OSError:
                pass
    return found
