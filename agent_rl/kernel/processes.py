"""Signalling a process tree: the one place that knows a group signal is not enough."""

from __future__ import annotations

import os


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
