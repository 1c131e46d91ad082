"""Names and host uids for sandboxes.

Every sandbox id starts with its backend's prefix and is used verbatim for its cgroups,
containers and directories, which is how the reaper recognizes them. Each live sandbox of a
process gets its own pair of unprivileged host uids, one for its worker and the one above it for
its tool code, so sandboxes cannot signal or read each other even where namespaces do not
separate them (the rlimit backend), and tool code cannot signal or trace its own worker.
"""

from __future__ import annotations

import os
import random
import uuid

UID_SPAN = 100_000
"""Uids handed out per backend, starting at the configured base."""


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:12]}"


def tool_uid(uid: int) -> int:
    """The uid tool code runs under in the sandbox whose worker has `uid` (also its gid)."""
    return uid + 1


class UidPool:
    """Unique uid pairs for the live sandboxes of this process; random so that two processes
    sharing a host are unlikely to collide (and namespaces separate them when they do)."""

    def __init__(self, base: int) -> None:
        self.base = base
        self._used: set[int] = set()
        self.history: set[int] = set()
        """Every uid ever handed out, tool code's included (to find what a sandbox left)."""
        self._rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "big"))

    def take(self) -> int:
        """A worker's uid; `tool_uid(uid)` comes with it."""
        while True:
            uid = self.base + 2 * self._rng.randrange(UID_SPAN // 2)
            if uid not in self._used:
                self._used.add(uid)
                self.history |= {uid, tool_uid(uid)}
                return uid

    def give_back(self, uid: int) -> None:
        self._used.discard(uid)


def owner_tag() -> str:
    """Identifies this server process across pid reuse: '<pid>:<start time in ticks>'."""
    return f"{os.getpid()}:{_start_time(os.getpid())}"


def owner_alive(tag: str) -> bool:
    """Whether the process that wrote `tag` (with owner_tag) still runs."""
    try:
        pid, start = tag.strip().split(":")
        return _start_time(int(pid)) == start
    except (ValueError, OSError):
        return False


def _start_time(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        # field 22, counted after the parenthesized command name (which may contain spaces)
        return f.read().rsplit(")", 1)[1].split()[19]
