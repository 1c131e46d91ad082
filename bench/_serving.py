"""Pieces the end-to-end benchmarks share: `serve` and the router, each on an event loop of its
own in a thread, beside a trainer loop in the main thread (as separate processes would be)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent_rl.config import Config, RouterConfig
from agent_rl.sglang.client import EngineClient
from agent_rl.sglang.generation import Generation


class LoopThread(threading.Thread):
    """Runs `main()` on its own event loop until it returns or `stop()` cancels it."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.ready = threading.Event()
        self.error: BaseException | None = None

    async def main(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self.loop, self.task = asyncio.get_running_loop(), asyncio.current_task()
        try:
            await self.main()
        except asyncio.CancelledError:
            pass
        except BaseException as e:  # reported by the main thread
            self.error = e
        finally:
            self.ready.set()

    def stop(self) -> None:
        self.ready.wait(120)
        if self.is_alive():
            self.loop.call_soon_threadsafe(self.task.cancel)  # type: ignore[union-attr]
        self.join(60)


class ServeThread(LoopThread):
    """`serve(cfg, max_episodes)`; `stop()` cancels it (running episodes end as interrupted)."""

    def __init__(self, cfg: Config, max_episodes: int | None) -> None:
        super().__init__()
        self.cfg, self.max_episodes = cfg, max_episodes
        self.summary: Any = None

    async def main(self) -> None:
        from agent_rl.app.serve import serve

        self.ready.set()
        self.summary = await serve(self.cfg, max_episodes=self.max_episodes)


class RouterThread(LoopThread):
    """A router in front of `workers` (its URL and admin token once `ready`)."""

    def __init__(self, workers: list[str], config: RouterConfig | None = None) -> None:
        super().__init__()
        self.workers, self.config = workers, config or RouterConfig(port=0)
        self.url, self.token = "", ""

    async def main(self) -> None:
        from router.app import Router

        async with Router(self.config, workers=self.workers) as router:
            self.url, self.token = router.url, router.admin_token
            self.ready.set()
            await asyncio.Event().wait()


class RouterProcess:
    """`agent-rl router` in a process of its own in front of `workers`, with `token` as its
    admin token (None: one it generates): a router whose work does not share the bench's
    interpreter with what it measures, as a deployed router's does not."""

    def __init__(self, workers: list[str], token: str | None, log: Path) -> None:
        self.workers, self.token, self.log = workers, token, log
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout_s: float = 60.0) -> None:
        cmd = [sys.executable, "-m", "agent_rl.app.cli", "router", "--port", "0"]
        for worker in self.workers:
            cmd += ["--worker", worker]
        env = dict(os.environ)
        if self.token is not None:
            env["AGENT_RL_ROUTER__ADMIN_TOKEN"] = self.token
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log.open("wb"),
                                     env=env, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(r"router on (http://\S+):", self.log.read_text())
            if found:
                self.url = found.group(1)
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the router did not start: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_router(engine_url: str) -> None:
    """A router in front of `engine_url` until the process is killed, its URL printed first
    (the `--role router` process of bench/rollout.py and bench/serve_ceiling.py)."""
    import anyio

    from router.app import Router

    async def run() -> None:
        async with Router(RouterConfig(port=0), workers=[engine_url]) as r:
            print(r.url, flush=True)
            await anyio.sleep_forever()

    anyio.run(run)


def quickstart_run(work: Path, model: Path, router: RouterThread, run: str, *,
                   store_url: str | None = None, **trainer: Any) -> Config:
    """The quickstart's recipe as one named run of a benchmark: its store a file in `work`
    (or `store_url`),
    rollouts and weight syncs through `router`, checkpoints and exports under `work / run`,
    no TensorBoard, and `trainer` on top of the recipe's trainer settings (a section's
    settings as a dict: `mtp={"layers": 1}`). Every group trains,
    equal rewards or not, so a short run's pace does not depend on how many have signal."""
    from agent_rl.app.quickstart.recipe import Options, recipe

    raw = recipe(Options())
    raw["run"] = {"name": run}
    raw["store"] = {"url": store_url or f"sqlite:///{work / 'bench.db'}"}
    raw["engine"] = {"model": str(model), "log_dir": str(work / "logs")}
    raw["router"] = {"admin_token": router.token}
    raw["rollout"]["router_url"] = router.url
    raw["rollout"]["filter_zero_variance"] = False
    raw["trainer"].update(
        model=str(model), checkpoint_every=10_000, tensorboard_dir=None,
        checkpoint_dir=str(work / run / "ckpt"), export_dir=str(work / run / "exports"),
    )
    raw["trainer"].setdefault("weight_sync", {})["router_url"] = router.url
    for key, value in trainer.items():  # a section's settings join the recipe's
        if isinstance(value, dict):
            raw["trainer"].setdefault(key, {}).update(value)
        else:
            raw["trainer"][key] = value
    return Config(**raw)


def on_generate(record: Callable[[float, float, Generation], None]) -> None:
    """Call `record(sent, returned, generation)` (monotonic seconds) after every /generate call
    of this process: the benchmarks' drivers and serve's runner and gateway alike."""
    original = EngineClient.generate

    async def generate(self: EngineClient, *args: Any, **kwargs: Any) -> Generation:
        t0 = time.monotonic()
        gen = await original(self, *args, **kwargs)
        record(t0, time.monotonic(), gen)
        return gen

    EngineClient.generate = generate  # type: ignore[method-assign]


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` (with these label values) in a Prometheus /metrics
    text: one per label set, e.g. per worker or per scheduler."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())
