"""CPU seconds of processes, read from /proc: the figures the benchmarks put side by side (a
router's CPU per request, an engine start's CPU by process, the evaluation fleet's against the
trainer's)."""

from __future__ import annotations

import os
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int | str) -> tuple[str, list[str]]:
    """A process's name (comm) and the fields of /proc/PID/stat after it."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()


def cpu_s(pid: int, *, reaped: bool = False) -> float:
    """User + system CPU seconds of a live process; with `reaped`, plus its children that ended
    and were waited for."""
    fields = _stat(pid)[1]
    return sum(int(f) for f in fields[11 : 15 if reaped else 13]) / TICKS


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and every live descendant (an engine runs a few), reaped
    children included; a process that ended meanwhile counts 0."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += cpu_s(p, reaped=True)
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        todo += [int(c) for c in children]
    return total


def group_cpu_s(pgid: int) -> dict[str, float]:
    """CPU seconds (reaped children included) of each live process in a process group, keyed
    `comm:pid`."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            comm, fields = _stat(proc.name)
        except OSError:
            continue
        if int(fields[2]) == pgid:
            out[f"{comm}:{proc.name}"] = sum(int(x) for x in fields[11:15]) / TICKS
    return out
