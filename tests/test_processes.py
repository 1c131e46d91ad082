"""agent_rl/kernel/processes.py: a process started with `die_with_parent()` does not outlive
its parent, even in a session of its own (as a launch's role processes and SGLang servers run);
one started without it does, which is what a `ray stop` used to leave behind."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from agent_rl.kernel.processes import alive

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")

PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from agent_rl.kernel.processes import die_with_parent
    tied = sys.argv[1] == "tied"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             start_new_session=True, preexec_fn=die_with_parent() if tied else None)
    print(child.pid, flush=True)
    time.sleep(600)
""")


def _orphan_after_parent_killed(mode: str) -> psutil.Process:
    """Start a parent that starts a child (`mode`: tied with die_with_parent() or not), SIGKILL
    the parent; the child."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE,
                              text=True)
    assert parent.stdout is not None
    child = psutil.Process(int(parent.stdout.readline()))
    assert child.is_running() and child.ppid() == parent.pid
    parent.kill()
    parent.wait(timeout=30)
    return child


def test_a_child_started_with_die_with_parent_dies_with_its_parent() -> None:
    tied = _orphan_after_parent_killed("tied")
    deadline = time.monotonic() + 10
    while alive(tied):
        assert time.monotonic() < deadline, "the child outlived its parent by 10 s"
        time.sleep(0.05)


def test_a_child_started_without_it_is_left_running() -> None:
    """The control: the same tree without it leaves the child running as an orphan."""
    loose = _orphan_after_parent_killed("loose")
    try:
        time.sleep(1.0)
        assert alive(loose)
    finally:
        loose.kill()
