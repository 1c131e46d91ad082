"""CPU priority of the processes agent-rl starts beside training: niceness, SCHED_IDLE, and the
scheduler's group of a new session.

Linux with autogroups (CONFIG_SCHED_AUTOGROUP, on by default on most distributions; it applies to
processes in the root CPU cgroup) schedules each session as one group: the CPU is shared fairly
between the groups first, and only within a group by its tasks' niceness and policy. The engines
and the evaluator start sessions of their own (so that one signal stops each with its children),
so without more a niced or SCHED_IDLE evaluation still competed with training at full weight:
beside a quickstart-sized run even a SCHED_IDLE busy loop in a session of its own took CPU from
the trainer. A session's group has a niceness of its own (`/proc/PID/autogroup`): a process that
lowers itself in a session of its own lowers its group to match (19 under SCHED_IDLE, the least
there is), and a session it starts gets its group's niceness. Where there are no autogroups the
file is absent and nothing more is done.
"""

from __future__ import annotations

import os

IDLE_GROUP_NICE = 19
"""The niceness of a SCHED_IDLE process's session group: the lowest weight a group can have."""


def spare_cpu_only(nice: int, idle: bool) -> None:
    """Lower this process's CPU priority: `nice` more, SCHED_IDLE where the platform has it, and
    its session's group to match. A preexec_fn after `start_new_session` (the process's own
    session then; what it starts inherits all of it)."""
    if nice:
        os.nice(nice)
    idle = idle and hasattr(os, "SCHED_IDLE")
    if idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    if idle or nice:
        set_group_nice(os.getpid(),
                       IDLE_GROUP_NICE if idle else os.getpriority(os.PRIO_PROCESS, 0))


def pass_priority_on(pid: int) -> None:
    """Give the session group of process `pid` (one this process started in a session of its
    own) the niceness of this process's own group: a child in a new session then competes for
    the CPU as its starter does (the evaluator's engine at the evaluator's 19). A starter in a
    group at full weight (whatever its own niceness: a `nice agent-rl serve` competes inside
    its shell's group) leaves the child's group as it is."""
    nice = group_nice(os.getpid())
    if nice:
        set_group_nice(pid, nice)


def group_nice(pid: int) -> int:
    """The niceness of the session group of process `pid`; 0 where Linux has no autogroups."""
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            return int(f.read().split()[-1])  # "/autogroup-N nice K"
    except (OSError, ValueError, IndexError):
        return 0


def set_group_nice(pid: int, nice: int) -> None:
    """Set the niceness of the session group of process `pid`, where Linux has autogroups, if
    `pid` leads its session: a process in its starter's session would take its starter (and
    everything else in that session) down with it."""
    try:
        if os.getsid(pid) != pid:
            return
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroups here (or the process is gone): niceness per task only
        pass
