"""Host-side inspection for the sandbox tests: what a backend left behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

from agent_rl.sdk.sandbox import SandboxBackend


def real_uid(pid: str) -> int | None:
    """A process's real uid; not the owner of /proc/<pid>, which is its effective uid (tool
    code's for the worker)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
    except (OSError, StopIteration):
        return None


def uid_processes(uids: set[int]) -> list[str]:
    """Host processes running as one of `uids`."""
    return [f"pid {name} uid {real_uid(name)}" for name in os.listdir("/proc")
            if name.isdigit() and real_uid(name) in uids]


def worker_pid(sandbox: object) -> int:
    """The host pid of a sandbox's worker: a Python running worker.py as the sandbox's uid."""
    uid = getattr(sandbox, "uid")  # noqa: B009 (every root-run backend's sandbox has one)
    for name in os.listdir("/proc"):
        if not name.isdigit() or real_uid(name) != uid:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
        except OSError:
            continue
        if os.path.basename(argv[0]).startswith("python") and any(
                a.endswith("worker.py") for a in argv):
            return int(name)
    raise AssertionError(f"no worker process of uid {uid}")


def leftovers(backend: SandboxBackend, settle_s: float = 3.0) -> list[str]:
    """Everything of `backend`'s sandboxes still on the host: dirs, mounts, cgroups, processes,
    containers, volumes. Empty when all its sandboxes are closed or reaped. Polls up to
    `settle_s`: killed processes linger briefly as zombies until the host's init reaps them."""
    deadline = time.monotonic() + settle_s
    while True:
        left = _leftovers(backend)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _leftovers(backend: SandboxBackend) -> list[str]:
    left: list[str] = []
    root = getattr(backend, "root", None)
    if isinstance(root, Path) and root.exists():
        left += [f"dir {p.name}" for p in root.iterdir() if p.is_dir()]
    layout = getattr(backend, "layout", None)
    if layout is not None:
        left += [f"cgroup {i}" for i in layout.sandbox_ids()]
    config = getattr(backend, "config", None)
    uid_pool = getattr(backend, "uids", None)
    if uid_pool is not None:
        left += uid_processes(uid_pool.history)
    if backend.name == "docker":
        left += backend.leftovers()  # type: ignore[attr-defined]
    state = str(getattr(config, "state_dir", "/nonexistent"))
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    left += [f"mount {p}" for p in points if p.startswith(state + "/")]
    return left
