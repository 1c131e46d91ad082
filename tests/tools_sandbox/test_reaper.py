"""Kill the server while its sandboxes run, start again: nothing may be left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from .conftest import BACKENDS, backend_or_skip
from .helpers import leftovers, uid_processes

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.mark.parametrize("name", BACKENDS)
async def test_reaper_removes_what_a_killed_server_left(name: str) -> None:
    backend_or_skip(name)  # skip (or fail in CI) before starting the server
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.tools_sandbox._crashing_server", name],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        line = server.stdout.readline() if server.stdout else ""
        assert line, f"the server did not start its sandboxes (exit {server.poll()})"
        started = json.loads(line)
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait()
    uids = {u for u in started["uids"] if u is not None}
    if name == "bwrap":
        # the parent-death signal and the pid namespace take every process down with the server
        # (rlimit has no pid namespace: detached processes live on until the reaper kills them)
        deadline = time.monotonic() + 5
        while uid_processes(uids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert uid_processes(uids) == []
    restarted = backend_or_skip(name)
    reaped = await restarted.reap()
    assert reaped >= len(started["ids"])
    assert leftovers(restarted) == [] and uid_processes(uids) == []
    if name == "docker":
        left = restarted.client.containers.list(all=True)  # type: ignore[attr-defined]
        assert not [c for c in left if c.labels.get("agent-rl.sandbox") in started["ids"]]
    await restarted.aclose()
