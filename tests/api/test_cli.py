"""`agent-rl api`: serves the filled store on loopback until SIGINT; refuses to expose reads
on another address without a token."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import httpx

from tests._databases import fresh_database
from tests.api.conftest import fill_database

AGENT_RL = str(Path(sys.executable).parent / "agent-rl")


def test_api_command_serves_and_stops_on_sigint(tmp_path: Path, tokenizer_dir: Path) -> None:
    with fresh_database("sqlite", tmp_path) as url:
        fill_database(url, tokenizer_dir)
        env = {**os.environ, "AGENT_RL_STORE__URL": url, "AGENT_RL_API__TOKEN": "t0ken"}
        proc = subprocess.Popen(
            [AGENT_RL, "api", "--port", "0"],
            env=env,
            cwd=tmp_path,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            line = proc.stderr.readline()  # type: ignore[union-attr]
            match = re.search(r"agent-rl api on (http://127\.0\.0\.1:\d+)/", line)
            assert match, line + proc.stderr.read()  # type: ignore[union-attr]
            assert "t0ken" not in line
            runs = httpx.get(f"{match[1]}/api/v1/runs", timeout=30).json()
            assert [r["name"] for r in runs] == ["demo"]
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("token", [None, "", "   "], ids=["unset", "empty", "blank"])
def test_api_command_refuses_a_public_address_without_a_token(tmp_path: Path, token: str | None) -> None:
    env = {**os.environ, "AGENT_RL_STORE__URL": f"sqlite:///{tmp_path / 'x.db'}"}
    env.pop("AGENT_RL_API__TOKEN", None)
    if token is not None:
        env["AGENT_RL_API__TOKEN"] = token
    start = time.monotonic()
    r = subprocess.run(
        [AGENT_RL, "api", "--host", "0.0.0.0", "--port", "0"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 1 and "not loopback" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - start < 60
