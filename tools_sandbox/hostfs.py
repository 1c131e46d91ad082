"""Host-side directories of sandboxes: a size-limited tmpfs work dir per sandbox, and cleanup.

The work dir is a tmpfs mounted on the host (not inside the sandbox), so it survives the
sandbox being killed and respawned, has a hard size limit (the disk limit) and an inode limit
(empty files cost kernel memory the size limit does not see, and it outlives respawns), and its
pages are charged to the memory cgroup of whoever wrote them. Mounting needs root (CAP_SYS_ADMIN).
"""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

from agent_rl.kernel.errors import SandboxError

MS_NOSUID, MS_NODEV = 2, 4
MNT_DETACH = 2
INODE_BYTES = 16 << 10
"""Bytes of a tmpfs's size per inode it may hold: ext4's default ratio (256 MiB: 16384 files)."""
_libc = ctypes.CDLL(None, use_errno=True)


def inodes(size_mb: int) -> int:
    """The inode limit of a tmpfs of `size_mb`."""
    return max(256, (size_mb << 20) // INODE_BYTES)


def mount_tmpfs(path: Path, size_mb: int, uid: int, gid: int, mode: int = 0o700) -> None:
    """Mount a fresh tmpfs of `size_mb` (and `inodes(size_mb)`) at `path`, owned by uid:gid."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size_mb}m,nr_inodes={inodes(size_mb)},mode={mode:o},uid={uid},gid={gid}".encode()
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
