"""The quickstart's supervisor with real OS processes: a SIGKILLed process is started again, a
stopped or cleanly finished one is not; and the recipe's one-line errors."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import anyio
import pytest

from agent_rl.kernel.errors import ConfigError
from agent_rl.app.quickstart.processes import Supervisor

pytestmark = pytest.mark.anyio

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _until(condition, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await anyio.sleep(0.05)


async def test_killed_process_is_restarted_and_stopped_one_is_not(tmp_path: Path) -> None:
    events: list[str] = []
    sup = Supervisor(tmp_path, on_event=events.append)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.watch, 0.05)
        m = sup.add("sleeper", SLEEPER, log_path=tmp_path / "logs" / "sleeper.log")
        first = m.pid
        assert first is not None and m.running
        assert sup.kill("sleeper") == first
        await _until(lambda: m.starts == 2 and m.running)
        assert m.pid != first and m.deaths == [-signal.SIGKILL]
        assert events == ["sleeper exited (killed by SIGKILL); restarting it"]
        await sup.stop("sleeper", grace_s=5)
        await anyio.sleep(0.3)
        assert not m.running and m.starts == 2
        done = sup.add("once", [sys.executable, "-c", "print('hi')"], log_path=tmp_path / "once.log")
        assert await sup.wait("once", timeout_s=30) == 0
        await anyio.sleep(0.3)
        assert done.starts == 1
        failing = sup.add("bad", [sys.executable, "-c", "raise SystemExit(3)"],
                          log_path=tmp_path / "bad.log", restart=False)
        assert await sup.wait("bad", timeout_s=30) == 3
        assert sup.failed() == [failing]
        tg.cancel_scope.cancel()
    assert "start:" in (tmp_path / "logs" / "sleeper.log").read_text()


async def test_stop_escalates_to_sigkill_for_a_process_that_ignores_sigterm(tmp_path: Path) -> None:
    stubborn = [sys.executable, "-c",
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('arm' + 'ed', flush=True); time.sleep(600)"]
    events: list[str] = []
    sup = Supervisor(tmp_path, on_event=events.append)
    m = sup.add("stubborn", stubborn, log_path=tmp_path / "s.log")
    await _until(lambda: "armed" in (tmp_path / "s.log").read_text())  # handler installed
    t0 = time.monotonic()
    await sup.stop("stubborn", grace_s=0.5)
    assert not m.running and time.monotonic() - t0 < 10
    assert events and "killing it" in events[0]
    with pytest.raises(ProcessLookupError):
        os.kill(m.pid, 0)  # type: ignore[arg-type]


async def test_cluster_mode_refuses_sqlite(tmp_path: Path) -> None:
    from rich.console import Console

    from agent_rl.app.quickstart import Options
    from agent_rl.app.quickstart.pipeline import Quickstart

    cwd = os.getcwd()
    try:
        qs = Quickstart(Options(cluster=True), tmp_path / "qs", Console())
        with pytest.raises(ConfigError, match="postgresql"):
            await qs.prepare()
    finally:
        os.chdir(cwd)
    toml = (tmp_path / "qs" / "agent-rl.toml").read_text()
    assert 'env = "calculator"' in toml and "admin_token" in toml
    assert oct((tmp_path / "qs" / "agent-rl.toml").stat().st_mode & 0o777) == "0o600"


async def test_kill_reaches_descendants_in_their_own_session(tmp_path: Path) -> None:
    # `agent-rl engine start` runs SGLang in a session of its own; killing the wrapper's
    # group alone left the server serving on its port (seen in the chaos run).
    pidfile = tmp_path / "child.pid"
    parent = [sys.executable, "-c",
              "import subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
              "start_new_session=True); "
              f"open({str(pidfile)!r}, 'w').write(str(c.pid)); time.sleep(600)"]
    sup = Supervisor(tmp_path)
    m = sup.add("wrapper", parent, log_path=tmp_path / "w.log", restart=False)
    await _until(lambda: pidfile.is_file() and pidfile.read_text())
    child = int(pidfile.read_text())
    sup.kill("wrapper")
    await _until(lambda: not m.running)

    def gone() -> bool:
        try:
            with open(f"/proc/{child}/stat") as f:
                return f.read().split()[2] == "Z"  # a zombie awaiting its reaper is dead
        except FileNotFoundError:
            return True

    await _until(gone)
