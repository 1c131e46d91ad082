"""verifiers v1 environments trained as agent-rl episodes (`--env verifiers:<taskset>`), out of
process: verifiers 0.4.0 runs in a virtual environment of its own (it pins `openai<3`) and
every model call of its harness reaches serve's gateway, which generates on the session's real
SGLang engine (tiny-moe, routing replay on) through a recording tap (`gateway_helpers.Tap`).

The environment under test, `verifiers_modules/vf_tiny_echo.py`, is written against verifiers'
public API only: two prompts, a harness that calls the model twice, rewards computed by
verifiers from the usage it was given and the task's data. Each stored episode is checked
token for token against what the engine itself saw and produced, and its reward against what
verifiers computed.

The verifiers environment is `AGENT_RL_VERIFIERS_PYTHON`, else the repository's
`.venv-verifiers` (`python -m venv .venv-verifiers && .venv-verifiers/bin/pip install
verifiers==0.4.0`); without it these tests skip locally and fail in CI (CI=true).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_rl.app.serve import serve
from agent_rl.kernel.errors import EnvError
from agent_rl.rollout.render import ChatRenderer
from agent_rl.sdk.registry import make
from agent_rl.store import Store
from envs.verifiers_env.env import PYTHON_VAR
from tests.rollout.conftest import serve_config
from tests.rollout.gateway_helpers import Tap, check_agent_episode

MODULES = Path(__file__).with_name("verifiers_modules")
BASES = {"Say hi.": 0.0, "Count to three.": 0.25}
"""Each task's base reward, by its prompt (as `vf_tiny_echo.PROMPTS` has them)."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def env_kwargs(python: str, **more: Any) -> dict[str, Any]:
    return {"python": python, "paths": [str(MODULES)], **more}


def test_a_family_id_needs_its_argument() -> None:
    with pytest.raises(EnvError, match=r"names no env: write verifiers:<env>"):
        make("verifiers:")


def test_the_verifiers_python_must_be_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PYTHON_VAR, raising=False)
    with pytest.raises(EnvError, match=PYTHON_VAR):
        make("verifiers:vf_tiny_echo")


def test_config_is_merged_table_by_table(verifiers_python: str) -> None:
    env = make("verifiers:vf_tiny_echo", **env_kwargs(verifiers_python, config={
        "taskset": {"task": {"rewards": []}}, "agent": {"max_turns": 4}}))  # fmt: skip
    assert env.env_config == {"taskset": {"id": "vf_tiny_echo", "task": {"rewards": []}},  # type: ignore[attr-defined]
                              "agent": {"max_turns": 4}}  # fmt: skip


def test_a_remote_runtime_is_refused_in_one_line(verifiers_python: str) -> None:
    env = make("verifiers:vf_tiny_echo",
               **env_kwargs(verifiers_python, config={"agent": {"runtime": {"type": "prime"}}}))  # fmt: skip
    with pytest.raises(EnvError, match=r"runtime 'prime' runs off this host"):
        env.task_source()


def test_a_harbor_taskset_is_refused_in_one_line_without_its_cli(verifiers_python: str) -> None:
    env = make("verifiers:harbor", python=verifiers_python)
    with pytest.raises(EnvError, match=r"the verifiers harbor taskset needs the Harbor CLI .*"
                                       r"Python >= 3\.12.* a docker runtime to run them in"):  # fmt: skip
        env.task_source()


@pytest.mark.anyio
@pytest.mark.slow
async def test_verifiers_episodes_are_recorded_token_for_token(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path, verifiers_python: str  # type: ignore[no-untyped-def]
) -> None:
    """Two long-lived env servers back the serve (the least loaded, ties in turn, gets each
    episode): each runs one of the two episodes."""
    env_id = "verifiers:vf_tiny_echo"
    env = make(env_id, **env_kwargs(verifiers_python, servers=2))
    tasks = env.task_source().tasks  # type: ignore[attr-defined]
    assert [(t.id, t["verifiers_task"]["prompt"]) for t in tasks] == [("echo-0", "Say hi."),
                                                                     ("echo-1", "Count to three.")]
    async with Tap(sglang_moe_server.url).running() as tap:
        cfg = serve_config(f"sqlite:///{tmp_path / 'vf.db'}", tap.url, tiny_moe_model, env=env_id,
                           env_kwargs=env_kwargs(verifiers_python, servers=2), max_new_tokens=48)  # fmt: skip
        summary = await serve(cfg, max_episodes=2)
    servers = env.pool.servers  # type: ignore[attr-defined]
    assert [s.request({"op": "health"})["episodes"] for s in servers] == [1, 1]
    assert summary.admitted == 2 and summary.run_ledger.balances()
    assert summary.run_ledger.running == summary.run_ledger.waiting == 0
    renderer = ChatRenderer(tiny_moe_model)
    async with await Store.open(cfg.store) as store:
        episodes = await store.list_episodes(run_id=summary.run_id)
        assert len(episodes) == 2
        for e in episodes:
            assert e.status in ("completed", "filtered"), e.error_cause
            # Both calls of the harness are turns of the engine's own tokens, one segment.
            await check_agent_episode(store, renderer, tap, e.id, [])
            detail = await store.get_episode(e.id)
            assert e.num_turns == 2 and e.reward_details["segments"] == 1
            assert [m["content"] for m in detail.messages if m["role"] == "user"][1] == "Again."
            # verifiers' reward: its completion tokens (the usage the gateway returned) / 100,
            # plus the task's base (x2, weight 0.5).
            completion = sum(t.num_tokens - t.num_prompt_tokens for t in detail.turns)
            base = BASES[next(m["content"] for m in detail.messages if m["role"] == "user")]
            assert e.reward == pytest.approx(completion / 100 + base)
            parts = e.reward_details["reward"]["components"]
            assert parts == pytest.approx({"tokens": completion / 100, "base": base})


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_verifiers_error_fails_the_episode_with_its_cause(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path, verifiers_python: str  # type: ignore[no-untyped-def]
) -> None:
    """A reward function that raises is an error verifiers records on the trace: the episode
    ends failed with it as the cause, its calls kept as turns, and is never scored. Run in the
    process-per-episode mode (servers=0)."""
    cfg = serve_config(f"sqlite:///{tmp_path / 'vf.db'}", sglang_moe_server.url, tiny_moe_model,
                       env="verifiers:vf_tiny_broken",
                       env_kwargs=env_kwargs(verifiers_python, servers=0), group_size=1)  # fmt: skip
    summary = await serve(cfg, max_episodes=1)
    assert summary.admitted == 1 and summary.run_ledger.balances()
    assert summary.run_ledger.running == summary.run_ledger.waiting == 0
    async with await Store.open(cfg.store) as store:
        (e,) = await store.list_episodes(run_id=summary.run_id)
        assert e.status == "failed" and e.reward is None
        assert "the verifier broke" in (e.error_cause or ""), e.error_cause
        assert e.num_turns == 2


def wait_tasks(tmp_path: Path, env: Any, task_id: str) -> str:
    """A task file holding only `task_id` of `vf_tiny_wait`'s listed rows."""
    (row,) = [t for t in env.task_source().tasks if t.id == task_id]
    path = tmp_path / f"{task_id}.jsonl"
    path.write_text(json.dumps({"id": row.id, **row.data}) + "\n")
    return str(path)


async def until_running(server: Any) -> None:
    """Until the env server runs an episode (its health is the only view into it)."""
    with anyio.fail_after(120):
        while (await anyio.to_thread.run_sync(server.request, {"op": "health"}))["running"] == 0:
            await anyio.sleep(0.05)


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_killed_env_server_fails_its_episode_and_is_restarted(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path, verifiers_python: str  # type: ignore[no-untyped-def]
) -> None:
    """A real fault: the env server is SIGKILLed while it runs an episode. The episode ends
    failed with a cause naming the server and its signal, none is left running, and the next
    episode restarts the server and completes."""
    kwargs = env_kwargs(verifiers_python, servers=1)
    env = make("verifiers:vf_tiny_wait", **kwargs)
    server = env.pool.servers[0]  # type: ignore[attr-defined]
    wait = wait_tasks(tmp_path, env, "wait")
    once = wait_tasks(tmp_path, env, "once")

    def config(name: str, tasks: str):  # type: ignore[no-untyped-def]
        return serve_config(f"sqlite:///{tmp_path / name}", sglang_moe_server.url, tiny_moe_model,
                            env="verifiers:vf_tiny_wait", env_kwargs={**kwargs, "tasks": tasks},
                            group_size=1)  # fmt: skip

    cfg = config("killed.db", wait)
    summaries = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: _append(summaries, serve(cfg, max_episodes=1)))
        await until_running(server)
        pid = server.life.process.pid
        os.kill(pid, signal.SIGKILL)
    (summary,) = summaries
    assert summary.run_ledger.balances() and summary.run_ledger.running == 0
    async with await Store.open(cfg.store) as store:
        (e,) = await store.list_episodes(run_id=summary.run_id)
        assert e.status == "failed" and e.reward is None
        assert f"verifiers env server 1/1 (pid {pid})" in (e.error_cause or ""), e.error_cause
        assert "died during the episode: killed by signal 9" in (e.error_cause or "")

    cfg = config("after.db", once)
    summary = await serve(cfg, max_episodes=1)
    assert server.life.process.pid != pid
    async with await Store.open(cfg.store) as store:
        (e,) = await store.list_episodes(run_id=summary.run_id)
        assert e.status in ("completed", "filtered"), e.error_cause
        detail = await store.get_episode(e.id)
        (turn,) = detail.turns
        assert e.reward == pytest.approx((turn.num_tokens - turn.num_prompt_tokens) / 100)


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_sigterm_drains_the_env_server(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path, verifiers_python: str  # type: ignore[no-untyped-def]
) -> None:
    """A SIGTERM to the env server while it runs an episode (a supervisor stopping serve
    signals every process under it) lets the episode finish: it completes with its reward, and
    the server leaves (exit status 0) once it has ended."""
    kwargs = env_kwargs(verifiers_python, servers=1)
    env = make("verifiers:vf_tiny_wait", **kwargs)
    server = env.pool.servers[0]  # type: ignore[attr-defined]
    cfg = serve_config(f"sqlite:///{tmp_path / 'drain.db'}", sglang_moe_server.url,
                       tiny_moe_model, env="verifiers:vf_tiny_wait", group_size=1,
                       env_kwargs={**kwargs, "tasks": wait_tasks(tmp_path, env, "pause")})  # fmt: skip
    summaries = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: _append(summaries, serve(cfg, max_episodes=1)))
        await until_running(server)
        process = server.life.process
        process.send_signal(signal.SIGTERM)
    (summary,) = summaries
    assert summary.run_ledger.balances() and summary.run_ledger.running == 0
    assert await anyio.to_thread.run_sync(lambda: process.wait(timeout=30)) == 0
    async with await Store.open(cfg.store) as store:
        (e,) = await store.list_episodes(run_id=summary.run_id)
        assert e.status in ("completed", "filtered"), e.error_cause
        (turn,) = (await store.get_episode(e.id)).turns
        assert e.reward == pytest.approx((turn.num_tokens - turn.num_prompt_tokens) / 100)


@pytest.mark.anyio
@pytest.mark.slow
async def test_the_deadline_cancels_the_episode_in_the_env_server(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path, verifiers_python: str  # type: ignore[no-untyped-def]
) -> None:
    """An episode past its deadline is cancelled in the env server too (it closes the
    connection): the server counts it cancelled and runs nothing after."""
    kwargs = env_kwargs(verifiers_python, servers=1)
    env = make("verifiers:vf_tiny_wait", **kwargs)
    server = env.pool.servers[0]  # type: ignore[attr-defined]
    before = server.request({"op": "health"})["cancelled"]
    cfg = serve_config(f"sqlite:///{tmp_path / 'deadline.db'}", sglang_moe_server.url,
                       tiny_moe_model, env="verifiers:vf_tiny_wait", group_size=1,
                       env_kwargs={**kwargs, "tasks": wait_tasks(tmp_path, env, "wait")},
                       episode_timeout_s=10.0)  # fmt: skip
    summary = await serve(cfg, max_episodes=1)
    assert summary.run_ledger.balances() and summary.run_ledger.running == 0
    with anyio.fail_after(30):
        while (health := server.request({"op": "health"}))["running"]:
            await anyio.sleep(0.05)
    assert health["cancelled"] == before + 1
    async with await Store.open(cfg.store) as store:
        (e,) = await store.list_episodes(run_id=summary.run_id)
        assert e.status == "completed", e.error_cause
        assert e.reward_details["truncated"] == "deadline"


async def _append(into: list[Any], job: Any) -> None:
    into.append(await job)


@pytest.mark.slow
def test_an_env_server_started_elsewhere_is_reached_by_address(verifiers_python: str) -> None:
    """`runner.py serve` started by hand on loopback TCP (stdin not a pipe: it stays up); an
    env with only its address (servers=0) lists the tasks through it."""
    from envs.verifiers_env.env import RUNNER

    environ = {**os.environ, "PYTHONPATH": str(MODULES), "HF_HUB_OFFLINE": "1"}
    config = json.dumps({"taskset": {"id": "vf_tiny_echo"}})
    with subprocess.Popen([verifiers_python, "-P", str(RUNNER), "serve", config, "127.0.0.1:0"],
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=environ) as server:  # fmt: skip
        try:
            assert server.stdout is not None
            address = json.loads(server.stdout.readline())["listening"]
            env = make("verifiers:vf_tiny_echo",
                       **env_kwargs(verifiers_python, servers=0, addresses=[address]))  # fmt: skip
            assert [t.id for t in env.task_source().tasks] == ["echo-0", "echo-1"]  # type: ignore[attr-defined]
            (reached,) = env.pool.servers  # type: ignore[attr-defined]
            assert reached.request({"op": "health"})["pid"] == server.pid
        finally:
            server.terminate()
    assert server.returncode == 0


def test_a_bad_env_server_address_is_refused_in_one_line(verifiers_python: str) -> None:
    with pytest.raises(EnvError, match=r"address 'nowhere': write unix:PATH or HOST:PORT"):
        make("verifiers:vf_tiny_echo", **env_kwargs(verifiers_python, addresses=["nowhere"]))
