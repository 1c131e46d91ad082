"""A router killed between two turns of an episode: the serve sends the next generation again
until the restarted router has its engine back, and the episode completes.

What `agent-rl launch` does when the router dies (docs/cluster.md): the router process is
SIGKILLed, started again at the same address with no workers, and the supervisor adds the
engines a moment later. A generation the serve starts meanwhile first finds nothing listening
(the connection is refused), then a router that answers 503 (no worker); no engine received it
either time, so the serve retries it (bounded by the episode's deadline). A generation in
flight through the router when it dies is not sent again: the engine had it and may have
sampled tokens. Real parts only: an `agent-rl router` process, the session's SGLang server on
CPU, `serve` in this process with a SQLite store.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest

from agent_rl import Env, StepResult
from agent_rl.app.serve import serve
from agent_rl.kernel.errors import EngineError, EngineUnavailableError
from agent_rl.sdk.messages import AssistantTurn, Message, user
from agent_rl.sdk.registry import register
from agent_rl.sdk.tasks import ListTasks, Task, TaskSource
from agent_rl.sglang.client import EngineClient
from agent_rl.store import Store
from tests.rollout.conftest import serve_config

pytestmark = pytest.mark.anyio

ADMIN = {"Authorization": "Bearer secret"}
RESTART_DELAY_S = 2.0
"""Nothing listens at least this long after the kill (`agent-rl launch`'s `restart_delay_s`)."""

_after_first_turn: Callable[[], Awaitable[None]] | None = None


class RouterDiesEnv(Env):
    """Two turns; after the first one's completion, `_after_first_turn` kills the router."""

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        return ListTasks([Task(id="t0", data={"q": "hello"})])

    def initial_messages(self, task: Task) -> list[Message]:
        return [user(task["q"])]

    async def score(self, answer: str) -> float:
        return 1.0

    async def step(self, turn: AssistantTurn) -> StepResult:
        self.turns += 1
        if self.turns == 1:
            assert _after_first_turn is not None
            await _after_first_turn()
            return StepResult(observations=[user("go on")])
        return StepResult(reward=1.0, terminated=True)


class RouterProcess:
    """`agent-rl router` on a fixed loopback port, as a process that can be SIGKILLed."""

    def __init__(self, port: int, cwd: Path) -> None:
        self.port, self.cwd = port, cwd
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self, *workers: str) -> None:
        args = [a for w in workers for a in ("--worker", w)]
        env = dict(os.environ, AGENT_RL_ROUTER__ADMIN_TOKEN="secret")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from agent_rl.app.cli import main; main()", "router",
             "--port", str(self.port), *args],
            cwd=self.cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        async with aiohttp.ClientSession() as http:
            while True:  # any answer will do: with no worker, /health is a 503
                assert self.proc.poll() is None, "the router exited"
                assert time.monotonic() < deadline, "the router did not answer within 60 s"
                try:
                    async with http.get(self.url + "/health"):
                        return
                except aiohttp.ClientConnectionError:
                    await anyio.sleep(0.1)

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await anyio.to_thread.run_sync(self.proc.wait)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class _Retries(logging.Handler):
    """The runner's lines about generations it sends again; sets `refused` at the first."""

    def __init__(self, refused: anyio.Event) -> None:
        super().__init__(logging.INFO)
        self.refused = refused
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "no engine received the generation" in message:
            self.messages.append(message)
            self.refused.set()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _metric(url: str, name: str, *labels: str) -> float:
    """The sum of a router metric's samples that carry every one of `labels`."""
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(label in line for label in labels))


async def _generate_503s(url: str) -> float:
    return await _metric(url, "agent_rl_router_requests_total", 'code="503"', 'route="/generate"')


async def test_generation_during_a_router_restart_is_sent_again(
    tmp_path: Path, sglang_moe_server: Any, tiny_moe_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    global _after_first_turn
    register("test-router-dies", RouterDiesEnv)
    router = RouterProcess(_free_port(), tmp_path)
    killed, refused = anyio.Event(), anyio.Event()
    timeline: dict[str, float] = {}
    retries = _Retries(refused)
    caplog.set_level(logging.INFO, logger="agent_rl.rollout.runner")
    logging.getLogger("agent_rl.rollout.runner").addHandler(retries)

    async def kill_router() -> None:
        # A generation in flight through the router when it dies reached the engine, which may
        # have sampled tokens for it: its caller gets an error that is not sent again.
        async with EngineClient(router.url) as client, anyio.create_task_group() as tg:
            async def long_generation() -> None:
                with pytest.raises(EngineError) as lost:
                    await client.generate([5, 6, 7], {"max_new_tokens": 2048, "ignore_eos": True})
                assert "UpstreamFailed" in str(lost.value)
                assert not isinstance(lost.value, EngineUnavailableError)
                timeline["in_flight_lost"] = time.monotonic()

            tg.start_soon(long_generation)
            with anyio.fail_after(30):
                while await _metric(router.url, "agent_rl_router_in_flight") < 1:
                    await anyio.sleep(0.05)
            await router.kill()
        timeline["killed"] = time.monotonic()
        killed.set()

    async def restart_router() -> None:
        await killed.wait()
        await anyio.sleep(RESTART_DELAY_S)
        with anyio.fail_after(30):  # the runner said its generation found no router
            await refused.wait()
        await router.start()  # as `agent-rl launch` restarts it: no workers yet
        with anyio.fail_after(30):  # the generation, sent again, found no engine behind it
            while await _generate_503s(router.url) < 1:
                await anyio.sleep(0.1)
        async with aiohttp.ClientSession(headers=ADMIN) as http, http.post(
                router.url + "/workers", json={"url": sglang_moe_server.url}) as r:
            assert r.status == 201, await r.text()
        timeline["engine_added"] = time.monotonic()

    _after_first_turn = kill_router
    # A random model rarely ends its turn before max_new_tokens (which would end the episode
    # there, truncated); a stop string makes it.
    cfg = serve_config(f"sqlite:///{tmp_path / 'store.db'}", router.url, tiny_moe_model,
                       env="test-router-dies", group_size=1, stop=["e"])
    try:
        await router.start(sglang_moe_server.url)
        async with anyio.create_task_group() as tg:
            tg.start_soon(restart_router)
            summary = await serve(cfg, max_episodes=1)
            tg.cancel_scope.cancel()  # done already unless the episode ended without the engine
        store = await Store.open(cfg.store)
        async with store:
            [episode] = await store.list_episodes(run_id=summary.run_id)
            assert episode.status == "completed", (episode.status, episode.error_cause)
            assert episode.reward_details.get("terminated") is True, episode.reward_details
            assert episode.reward == 1.0 and episode.num_turns == 2
            detail = await store.get_episode(episode.id)
            assert [t.index for t in detail.turns] == [0, 1]
        # Its second turn was generated once the engine was back: it first found no router
        # (the connection refused: nothing sent), then the restarted router's 503s.
        assert "unreachable (/generate): NotSent" in retries.messages[0], retries.messages
        assert "in_flight_lost" in timeline
        assert timeline["engine_added"] - timeline["killed"] >= RESTART_DELAY_S
        assert await _generate_503s(router.url) >= 1
    finally:
        logging.getLogger("agent_rl.rollout.runner").removeHandler(retries)
        _after_first_turn = None
        router.stop()
