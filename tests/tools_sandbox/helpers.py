"""Host-side inspection for the sandbox tests: what a backend left behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tools_sandbox.base import SandboxBackend


def uid_processes(uids: set[int]) -> list[str]:
    """Host processes running as one of `uids`."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                uid = os.stat(f"/proc/{name}").st_uid
            except OSError:
                continue
            if uid in uids:
                found.append(f"pid {name} uid {uid}")
    return found


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
