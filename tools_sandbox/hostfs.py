"""Host-side directories of sandboxes: a size-limited tmpfs work dir per sandbox, and cleanup.

The work dir is a tmpfs mounted on the host (not inside the sandbox), so it survives the
sandbox being killed and respawned, has a hard size limit (the disk limit), and its pages are
charged to the memory cgroup of whoever wrote them. Mounting needs root (CAP_SYS_ADMIN).
"""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

from agent_rl.errors import SandboxError

MS_NOSUID, MS_NODEV = 2, 4
MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


def mount_tmpfs(path: Path, size_mb: int, uid: int, gid: int) -> None:
    """Mount a fresh tmpfs of `size_mb` at `path`, owned by uid:gid, mode 0700."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size_mb}m,mode=0700,uid={uid},gid={gid}".encode()
    if _libc.mount(b"agent-rl-sandbox", str(path).encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts):
        err = ctypes.get_errno()
        raise SandboxError(
            f"cannot mount the work dir tmpfs at {path}: {os.strerror(err)}; "
            "sandboxes need root (CAP_SYS_ADMIN) for their size-limited work dirs"
        )


def is_mount(path: Path) -> bool:
    try:
        return os.path.ismount(path)
    except OSError:
        return False


def unmount(path: Path) -> None:
    """Detach a mount at `path` if there is one (lazy: busy files do not block cleanup)."""
    while is_mount(path):
        if _libc.umount2(str(path).encode(), MNT_DETACH):
            break


def mounts_under(path: Path) -> list[Path]:
    """Mount points at or below `path`, deepest first (from /proc/self/mountinfo)."""
    root = str(path.resolve() if path.exists() else path)
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point == root or point.startswith(root + "/"):
                found.append(Path(point))
    return sorted(set(found), key=lambda p: len(p.parts), reverse=True)


def remove_tree(path: Path) -> None:
    """Unmount every mount at or below `path`, then delete it."""
    for point in mounts_under(path):
        unmount(point)
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)
