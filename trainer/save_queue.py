"""The results queue of megatron's checkpoint writer, served by a process that dies with ours.

`dist_checkpointing.save` collects its writers' results through a queue from a
`multiprocessing` manager that megatron starts ("spawn") on the first save and never stops
(megatron.core.dist_checkpointing.strategies.filesystem_async). A trainer that exits normally
shuts it down; a SIGKILLed one (a preempted job, a test killing a rank) leaves it running forever,
an orphan holding a fresh interpreter's worth of memory (300-560 MB seen with torch imported).
`install` puts a queue from our own manager in its place before megatron makes one: the same
kind of manager, whose server process also watches its parent and exits once it is gone.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from multiprocessing.managers import SyncManager

WATCH_INTERVAL_S = 1.0

_manager: SyncManager | None = None


def install() -> None:
    """Give megatron's checkpoint writer a results queue that cannot outlive this process.
    Idempotent; a no-op where megatron keeps no such queue."""
    global _manager
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if _manager is not None or getattr(filesystem_async, "_results_queue", False) is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=_exit_with_parent, initargs=(os.getpid(),))
    _manager = manager
    filesystem_async._results_queue = manager.Queue()


def _exit_with_parent(parent: int) -> None:
    """In the manager's server process: exit once `parent` is gone (adopted by another)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_INTERVAL_S)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
