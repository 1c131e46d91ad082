"""Signalling a process tree (the one place that knows a group signal is not enough), and tying
a child's life to its parent's."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1


def alive(process: Any) -> bool:
    """Whether the `psutil.Process` still runs: False once it has exited, even while its parent
    has not reaped it yet (a zombie), or when it is gone."""
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def signal_tree(pid: int, sig: int) -> None:
    """Signal the process `pid`, its process group and every descendant (an `agent-rl engine
    start` runs SGLang in a session of its own, which a group signal would miss)."""
    import psutil

    try:
        family = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        family = []
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for child in family:
        try:
            child.send_signal(sig)
        except psutil.Error:
            pass


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` (Linux; None elsewhere): the child is SIGKILLed when the thread that
    started it ends, so a process whose parent is killed (a `ray stop`, a killed test runner)
    does not live on as an orphan holding its port, its memory and its accelerators. Only for a
    thread that lives as long as the child should: the kernel ties the signal to the forking
    thread, not to its process. SIGKILL, not SIGTERM: an orphaned SGLang server was seen to
    outlive a SIGTERM by minutes, still serving."""
    if sys.platform != "linux":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the signal was set
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec
