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
from tests.api.conftest import LOOPBACK
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
        # Long enough turns that the kill lands mid-run: at 48 tokens the engine finished all
        # 16 episodes between seeing the first 4 end and the kill.
        max_new_tokens = 256
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
from agent_rl.sdk.messages import user
from agent_rl.sdk.tasks import ListTasks, Task


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


@pytest.mark.slow
def test_budget_truncations_are_reported_everywhere(tmp_path: Path, sglang_moe_server, tiny_moe_model: Path) -> None:
    """Tried as a new user would: a config whose max_turns binds. Serve's summary (read from the
    store), `agent-rl episodes list`, `/api/v1/stats` and the viewer all say how many episodes
    were truncated and why, and every episode ended."""
    from fastapi.testclient import TestClient

    from agent_rl.app.api import create_app
    from agent_rl.config import load_config

    (tmp_path / "agent-rl.toml").write_text(textwrap.dedent(f"""
        [engine]
        model = "{tiny_moe_model}"
        [rollout]
        env = "long-tail"
        env_kwargs = {{ turns_median = 4.0, length_median = 4.0 }}
        max_turns = 1
        group_size = 2
        filter_zero_variance = false
    """))
    served = subprocess.run(
        [AGENT_RL, "serve", "--max-episodes", "6", "--router-url", sglang_moe_server.url, "--no-api"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert served.returncode == 0, served.stdout[-2000:] + served.stderr[-2000:]
    summary = served.stdout.replace(" ", "")
    assert "truncated:max_turns=" in summary and "admitted=6" in summary, served.stdout[-2000:]
    listed = subprocess.run([AGENT_RL, "episodes", "list"], cwd=tmp_path, env=_env(),
                            capture_output=True, text=True, timeout=120)
    assert "truncated: max_turns" in listed.stdout, listed.stdout

    cfg = load_config(tmp_path / "agent-rl.toml", store={"url": f"sqlite:///{tmp_path / 'agent_rl.db'}"})
    with TestClient(create_app(cfg), base_url=LOOPBACK) as c:
        stats = c.get("/api/v1/stats", params={"run": "default"}).json()
        truncated = stats["endings"]["truncated"].get("max_turns", 0)
        assert truncated >= 1
        assert stats["ledger"]["running"] == stats["ledger"]["waiting"] == 0
        assert f"<td>max_turns</td><td class=\"n\">{truncated}</td>" in c.get("/stats").text
    # The summary's count is the store's.
    assert f"truncated:max_turns={truncated}" in summary


def _plugin(tmp_path: Path, name: str, module: str, entry: str) -> dict[str, str]:
    """Install a one-module env package (its entry point `entry`) offline; its PYTHONPATH."""
    src = tmp_path / f"src-{name}"
    (src / name).mkdir(parents=True)
    (src / name / "__init__.py").write_text(module)
    (src / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"

        [project]
        name = "{name.replace('_', '-')}"
        version = "1.0.0"

        [project.entry-points."agent_rl.envs"]
        {entry}
    """))
    site = tmp_path / f"site-{name}"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(site), str(src)], check=True, timeout=120)
    return _env(PYTHONPATH=str(site))


@pytest.mark.parametrize("case", ["unknown", "broken-import", "bad-kwarg"])
def test_a_bad_env_is_one_line_before_anything_starts(tmp_path: Path, case: str) -> None:
    """No engine starts (it would take half a minute) and no traceback: one line, rc 1."""
    env, args = _env(), ["--env", "no-such-env"]
    if case == "broken-import":
        env = _plugin(tmp_path, "broken_env_pkg", "import no_such_module_anywhere\n",
                      'broken = "broken_env_pkg:Env"')
        args = ["--env", "broken"]
    elif case == "bad-kwarg":
        (tmp_path / "agent-rl.toml").write_text('[rollout]\nenv = "calculator"\nenv_kwargs = { no_such_option = 1 }\n')
        args = []
    t0 = time.monotonic()
    out = subprocess.run([AGENT_RL, "serve", "--max-episodes", "1", *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert "Traceback" not in out.stderr + out.stdout and "SGLang" not in out.stdout + out.stderr
    expected = {"unknown": "unknown environment 'no-such-env'",
                "broken-import": "No module named 'no_such_module_anywhere'",
                "bad-kwarg": "no_such_option"}[case]
    assert expected in lines[0], lines[0]
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "runs" / "model").exists()  # not even the tiny model was made
