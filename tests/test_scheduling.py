"""tests/conftest.py's xdist scheduler, run on a throwaway suite under `-n 2`: a
`one_at_a_time` group's tests all run on one worker, one after another, and the run ends
whatever the mix (a worker holding one test while the rest pending were the other worker's
group once never started it, and the run hung with no test running)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

GROUPED = '''
import os, time
import pytest

pytestmark = pytest.mark.one_at_a_time("fleet")


@pytest.mark.parametrize("i", range(3))
def test_grouped(i):
    with open(os.environ["RUN_LOG"], "a") as log:
        log.write(f"{os.environ['PYTEST_XDIST_WORKER']} {time.monotonic()} start\\n")
    time.sleep(0.3)
    with open(os.environ["RUN_LOG"], "a") as log:
        log.write(f"{os.environ['PYTEST_XDIST_WORKER']} {time.monotonic()} end\\n")
'''

PLAIN = '''
import pytest


@pytest.mark.parametrize("i", range(12))
def test_plain(i):
    pass
'''


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    """A suite under tests/ with this repository's conftest, whose "fleet" group is
    tests/test_grouped.py."""
    (tmp_path / "tests").mkdir()
    for name in ("conftest.py", "_databases.py", "_own_postgres.py", "__init__.py"):
        shutil.copy(TESTS / name, tmp_path / "tests" / name)
    with open(tmp_path / "tests" / "conftest.py", "a") as conftest:
        conftest.write('\nONE_AT_A_TIME["fleet"] = ("tests/test_grouped.py",)\n')
    (tmp_path / "tests" / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "tests" / "test_plain.py").write_text(PLAIN)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    one_at_a_time(group): x\n"
                                         "    cpu_exclusive: x\n")
    return tmp_path


@pytest.mark.parametrize("selection", [
    ["tests/test_grouped.py::test_grouped[0]", "tests/test_grouped.py::test_grouped[2]"],
    ["tests/test_grouped.py"],
    ["tests/test_plain.py", "tests/test_grouped.py"],
    ["tests/test_grouped.py", "tests/test_plain.py"],
], ids=["two-grouped", "grouped", "grouped-last", "grouped-first"])  # fmt: skip
def test_a_group_runs_on_one_worker_and_the_run_ends(suite: Path, selection: list[str]) -> None:
    log = suite / "run.log"
    # xdist alone among the installed plugins: the others only add each process's start-up.
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "xdist", "-n", "2", "-q", "-p", "no:cacheprovider",
         *selection],
        cwd=suite, env={"PATH": "/usr/bin:/bin", "RUN_LOG": str(log), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    events = sorted((float(t), worker, what) for worker, t, what in
                    (line.split() for line in log.read_text().splitlines()))  # fmt: skip
    assert len({worker for _, worker, _ in events}) == 1, events  # one worker ran the group
    assert [what for _, _, what in events] == ["start", "end"] * (len(events) // 2), events
