"""`agent-rl serve` as a user runs it: a fresh directory, the embedded engine and router, and
an external environment package. Also: the engine killed mid-run costs only the episodes it
was serving, each recorded with its cause, and serve carries on after restarting it."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from agent_rl.config import StoreConfig
from agent_rl.rollout.render import ChatRenderer
from agent_rl.store import Store
from tests.rollout.invariants import check_episode

AGENT_RL = str(Path(sys.executable).parent / "agent-rl")
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_RL_")}
    env.update(COLUMNS="200", **extra)
    return env


def _terminal(db: Path) -> int:
    try:
        # Read-only: opening must not create the file before serve does.
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
            return conn.execute(
                "SELECT count(*) FROM episodes WHERE status NOT IN ('waiting', 'running')"
            ).fetchone()[0]
    except sqlite3.OperationalError:
        return 0


def _engine_pid(workdir: Path) -> int | None:
    out = subprocess.run(["pgrep", "-f", f"sglang.launch_server --model-path {workdir}/runs/model"],
                         capture_output=True, text=True)
    pids = [int(p) for p in out.stdout.split()]
    return min(pids) if pids else None


@pytest.mark.slow
def test_fresh_directory_serve_survives_engine_crash(tmp_path: Path, engine_venv: Path) -> None:
    (tmp_path / "agent-rl.toml").write_text(textwrap.dedent("""
        [rollout]
        max_new_tokens = 48
        max_concurrent_episodes = 4
        group_size = 4
    """))
    serve = subprocess.Popen([AGENT_RL, "serve", "--env", "calculator", "--max-episodes", "16"],
                             cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    db = tmp_path / "agent_rl.db"
    try:
        deadline = time.monotonic() + 600
        while _terminal(db) < 4:
            assert serve.poll() is None, serve.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no episodes finished in time"
            time.sleep(0.5)
        pid = _engine_pid(tmp_path)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        out, _ = serve.communicate(timeout=900)
    finally:
        if serve.poll() is None:
            serve.kill()
    assert serve.returncode == 0, out[-3000:]
    assert "restarting it" in out, out[-3000:]
    # Everything serve opened is closed on the way out (the router's session once was not).
    assert "Unclosed" not in out and "Traceback" not in out, out[-3000:]

    listed = subprocess.run([AGENT_RL, "episodes", "list"], cwd=tmp_path, env=_env(),
                            capture_output=True, text=True, timeout=120)
    assert "16 episodes" in listed.stdout

    async def check() -> None:
        async with await Store.open(StoreConfig(url=f"sqlite:///{db}")) as store:
            run = await store.run_id("default")
            ledger = await store.ledger(run)
            assert ledger.admitted == 16 and ledger.balances()
            assert ledger.waiting == ledger.running == 0
            episodes = await store.list_episodes(run_id=run)
            failed = [e for e in episodes if e.status == "failed"]
            assert all(e.error_type == "EngineError" for e in failed), [e.error_cause for e in failed]
            done = [e for e in episodes if e.status != "failed"]
            assert len(done) > len(failed)  # the run carried on after the restart
            renderer = ChatRenderer(tmp_path / "runs" / "model")
            for e in done:
                await check_episode(store, renderer, e.id, experts=False)

    anyio.run(check)


PLUGIN = '''
from agent_rl import Env
from agent_rl.messages import user
from agent_rl.tasks import ListTasks, Task


class EchoEnv(Env):
    """An environment shipped by a third-party package."""

    def builtin_tasks(self, split="train"):
        return ListTasks([Task(id="a", data={"q": "say hi"}), Task(id="b", data={"q": "say yo"})])

    def initial_messages(self, task):
        return [user(task["q"])]

    async def score(self, answer):
        return float("hi" in answer)
'''


def test_external_package_is_listed_and_served(tmp_path: Path, sglang_moe_server, tiny_moe_model: Path) -> None:
    src = tmp_path / "src"
    (src / "echo_env_pkg").mkdir(parents=True)
    assert PROJECT_ROOT not in src.parents
    (src / "echo_env_pkg" / "__init__.py").write_text(PLUGIN)
    (src / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"

        [project]
        name = "echo-env-pkg"
        version = "1.0.0"

        [project.entry-points."agent_rl.envs"]
        echo = "echo_env_pkg:EchoEnv"
    """))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(site), str(src)], check=True, timeout=120)
    env = _env(PYTHONPATH=str(site))
    listed = subprocess.run([AGENT_RL, "envs", "list"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=180)
    assert "echo" in listed.stdout and "echo-env-pkg 1.0.0" in listed.stdout
    served = subprocess.run(
        [AGENT_RL, "serve", "--env", "echo", "--max-episodes", "4", "--router-url", sglang_moe_server.url,
         "--model", str(tiny_moe_model)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert served.returncode == 0, served.stdout[-2000:] + served.stderr[-2000:]
    assert "admitted=4" in served.stdout.replace(" ", "")
    listed = subprocess.run([AGENT_RL, "episodes", "list", "--env", "echo"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert "4 episodes" in listed.stdout


@pytest.mark.slow
def test_sigterm_drains_then_a_second_one_interrupts(
    tmp_path: Path, sglang_server, tiny_moe_model: Path  # type: ignore[no-untyped-def]
) -> None:
    (tmp_path / "agent-rl.toml").write_text(textwrap.dedent(f"""
        [engine]
        model = "{tiny_moe_model}"
        [rollout]
        max_new_tokens = 48
        max_concurrent_episodes = 8
        group_size = 4
    """))
    db = tmp_path / "agent_rl.db"

    def start() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [AGENT_RL, "serve", "--env", "calculator", "--router-url", sglang_server.url, "--no-api"],
            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_terminal(proc: subprocess.Popen[str], n: int) -> None:
        deadline = time.monotonic() + 300
        while _terminal(db) < n:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no episodes finished in time"
            time.sleep(0.2)

    async def ledger():  # type: ignore[no-untyped-def]
        async with await Store.open(StoreConfig(url=f"sqlite:///{db}")) as store:
            run = await store.run_id("default")
            return await store.ledger(run), await store.list_episodes(run_id=run, limit=10_000)

    serve = start()
    try:
        wait_terminal(serve, 4)
        serve.send_signal(signal.SIGTERM)
        out, _ = serve.communicate(timeout=300)
    finally:
        if serve.poll() is None:
            serve.kill()
    assert serve.returncode == 0, out[-3000:]
    assert "admitting no new episodes" in out
    drained, episodes = anyio.run(ledger)
    # Drained: everything admitted ran to its end; nothing was cut off.
    assert drained.waiting == drained.running == 0
    assert not [e for e in episodes if e.error_type == "Interrupted"]

    serve = start()
    try:
        wait_terminal(serve, drained.admitted + 1)
        serve.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        serve.send_signal(signal.SIGTERM)
        out, _ = serve.communicate(timeout=120)
    finally:
        if serve.poll() is None:
            serve.kill()
    assert serve.returncode == 0, out[-3000:]
    after, episodes = anyio.run(ledger)
    assert after.waiting == after.running == 0 and after.balances()
    assert all(e.error_cause for e in episodes if e.status == "failed")
