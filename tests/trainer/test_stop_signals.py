"""`agent-rl train`'s stop on SIGINT/SIGTERM (agent_rl/app/cli/train.py) is the trainer's own,
not that of a child forked with its handler: megatron's checkpoint writers are forked from the
trainer, and a launch's stop signals the trainer's whole process tree. Such a child finishes its
work (the trainer waits for it); before, it ran the handler, and a writer could block for good
printing on a lock held at the fork, leaving the trainer stuck in its last checkpoint."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, signal, time
    from agent_rl.app.cli.train import _stop_on_signals

    class Loop:  # the one call the handler makes on the trainer's TrainLoop
        def request_stop(self):
            print(f"stop requested in {os.getpid()}", flush=True)

    _stop_on_signals(Loop())
    child = os.fork()
    if child == 0:  # as a checkpoint writer: busy when the stop comes
        time.sleep(1.0)
        print("child finished", flush=True)
        os._exit(0)
    time.sleep(0.3)
    os.kill(child, signal.SIGTERM)
    _, status = os.waitpid(child, 0)
    print("child status", os.waitstatus_to_exitcode(status), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    print("trainer", os.getpid(), flush=True)
""")


def test_a_stop_signal_stops_the_trainer_and_not_a_child_forked_from_it() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    trainer = lines[-1].split()[1]
    assert "child finished" in lines and "child status 0" in lines, done.stdout
    assert [line for line in lines if line.startswith("stop requested")] == [
        f"stop requested in {trainer}"], done.stdout
    assert done.stderr.count("stopping after the current step") == 1, done.stderr
