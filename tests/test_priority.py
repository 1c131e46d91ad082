"""agent_rl/kernel/priority.py: a process started in a session of its own at lowered priority takes
its session's scheduling group down with it (Linux autogroups), or a niced / SCHED_IDLE
evaluation would still compete with training at full weight as a group of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent_rl.kernel.priority import IDLE_GROUP_NICE, group_nice, spare_cpu_only

AUTOGROUPS = Path("/proc/self/autogroup").exists()


@pytest.mark.skipif(not AUTOGROUPS, reason="this kernel schedules no autogroups")
@pytest.mark.parametrize(("nice", "idle", "expected"), [(10, True, IDLE_GROUP_NICE), (7, False, 7)])
def test_a_lowered_process_lowers_its_new_session(nice: int, idle: bool, expected: int) -> None:
    own, ours = os.getpriority(os.PRIO_PROCESS, 0), group_nice(os.getpid())
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True,
                            preexec_fn=lambda: spare_cpu_only(nice, idle))
    try:
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == min(19, own + nice)
        assert (os.sched_getscheduler(proc.pid) == os.SCHED_IDLE) == idle
        assert group_nice(proc.pid) == expected
        assert group_nice(os.getpid()) == ours  # ours is untouched
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not AUTOGROUPS, reason="this kernel schedules no autogroups")
def test_a_lowered_process_in_its_starters_session_leaves_the_session_alone() -> None:
    """Without a session of its own, lowering a process must not lower its starter's group (and
    with it everything else the starter's session runs)."""
    ours = group_nice(os.getpid())
    proc = subprocess.Popen(["sleep", "30"], preexec_fn=lambda: spare_cpu_only(10, True))
    try:
        assert os.sched_getscheduler(proc.pid) == os.SCHED_IDLE
        assert group_nice(proc.pid) == group_nice(os.getpid()) == ours
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not AUTOGROUPS, reason="this kernel schedules no autogroups")
def test_what_a_lowered_process_starts_in_a_new_session_stays_lowered() -> None:
    """As the evaluator's own engine: started by a SCHED_IDLE process in a session of its own
    (EngineServer.launch passes the priority on), its group gets the idle niceness. Started by a
    process that is niced but competes in its starter's group (`nice agent-rl serve` in a shell),
    the new group gets that group's niceness, not the process's own."""
    ours = group_nice(os.getpid())
    starter = (
        "import os, subprocess, sys\n"
        "from agent_rl.kernel.priority import pass_priority_on\n"
        "p = subprocess.Popen(['sleep', '30'], start_new_session=True)\n"
        "pass_priority_on(p.pid)\n"
        "print(open(f'/proc/{p.pid}/autogroup').read().split()[-1], flush=True)\n"
        "p.kill(); p.wait()\n"
    )
    idle = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True,
                          check=True, start_new_session=True,
                          preexec_fn=lambda: spare_cpu_only(0, True))
    full = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True,
                          check=True, preexec_fn=lambda: os.nice(5))
    assert int(idle.stdout) == IDLE_GROUP_NICE
    assert int(full.stdout) == ours  # the starter's group's (a new group's 0 if ours is)
    assert group_nice(os.getpid()) == ours
