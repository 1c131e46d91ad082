"""How the README's `pytest -n 2` hands tests to its two workers (tests/conftest.py installs it
for pytest-xdist's default `--dist load`).

pytest-xdist's own `load` scheduling sends runs of consecutive tests to whichever worker asks, so
a module's tests (and its module-scoped engines and databases) are often split between the two
workers and set up twice, the heaviest modules come last (collection is alphabetical, and
tests/trainer sorts late), and the Ray tests, which must not run side by side, leave a worker
idle while it waits for another's cluster to go. Here a work unit is a whole test file, handed
out heaviest first, and the files of a `one_at_a_time` group form one unit, so one worker runs
them one after another and the other never waits for them.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

GROUPS = {
    "tests/cluster/test_launch.py": "ray",
    "tests/cluster/test_slurm.py": "ray",
    "tests/quickstart/test_on_ray.py": "ray",
}
"""Files holding `one_at_a_time(GROUP)` tests, and their group (checked at collection)."""

HEAVIEST_FIRST = [
    "ray",
    "tests/quickstart/test_quickstart.py",
    "tests/quickstart/test_quickstart_agent.py",
    "tests/trainer/test_parallel.py",
    "tests/rollout/test_serve_cli.py",
    "tests/trainer/test_weight_sync.py",
    "tests/trainer/test_glm4_moe.py",
    "tests/trainer/test_torchrun.py",
    "tests/trainer/test_mtp.py",
    "tests/trainer/test_deepseek_v3.py",
    "tests/store/test_state_machine.py",
    "tests/ecosystems/test_verifiers.py",
    "tests/router/test_real_sglang.py",
    "tests/engine/test_launcher.py",
    "tests/trainer/test_loop.py",
    "tests/trainer/test_llama.py",
]
"""Units measured at over 45 s of worker time in CI (`.ci/run` prints the slowest tests),
heaviest first; every other file follows in collection order. Longest first keeps one long
unit from starting last while the other worker has nothing left to run."""


def unit_of(nodeid: str) -> str:
    """The work unit of a test: its file, or its file's group."""
    path = nodeid.split("::", 1)[0]
    return GROUPS.get(path, path)


class FileUnits(LoadScopeScheduling):
    """pytest-xdist's scope scheduling with files (or groups of files) as scopes, queued
    heaviest first."""

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _assign_work_unit(self, node) -> None:  # type: ignore[no-untyped-def]
        # The base class hands out the queue's first unit: put the heaviest one left there.
        for unit in HEAVIEST_FIRST:
            if unit in self.workqueue:
                self.workqueue.move_to_end(unit, last=False)
                break
        super()._assign_work_unit(node)
