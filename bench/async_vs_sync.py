"""Asynchronous vs synchronous training on CPU: trainer idle fraction and step throughput.

Real pieces: one SGLang engine (tiny-dense), `agent_rl.app.serve.serve` writing episodes into a
SQLite store, the Megatron trainer loop (trainer/loop.py) claiming groups, stepping, exporting
and syncing weights to the engine every step. The environment makes episode durations
heavy-tailed: its first turn always calls a tool that sleeps a lognormal time (sigma 1, capped at
20x the median), its second turn is scored by the answer's length (so groups carry signal).

- sync: per step, serve generates exactly one batch (B groups), the trainer (`sync_mode`: data
  of the current policy only) waits for all of it, trains, exports, syncs; repeat.
- async: serve runs continuously with staleness bound eta = 4; the trainer trains whatever is
  ready.
The first step of each phase (filling the pipeline) is not measured. From the sync phase:
rho = the rollout share of a sync step (its idle fraction) and kappa = E[max over the batch of
L] / E[L] (episode wall times from the store); the closed-form bound of
../shared/notes/perf/REPORT.md section 4 is S = 1 / ((1 - rho) + rho / kappa).

Run: `python bench/async_vs_sync.py [--weight-sync disk|distributed|tensor]` (about 3-4 minutes;
needs `agent-rl engine install`).
Last line: RESULT {"async_idle", "sync_idle", "speedup", "bound", "bound_fraction", ...}.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl import Env, tool  # noqa: E402
from agent_rl.config import (  # noqa: E402
    Config,
    EngineConfig,
    RolloutConfig,
    StoreConfig,
    TrainerConfig,
)
from agent_rl.sdk.messages import AssistantTurn, Message, ToolCall, user  # noqa: E402
from agent_rl.sdk.registry import register  # noqa: E402
from agent_rl.sdk.tasks import ListTasks, Task, TaskSource  # noqa: E402
from bench._serving import ServeThread  # noqa: E402

ENV_ID = "bench-lognormal-tool"
MEDIAN_S = 0.5  # median tool time; sigma 1 gives p99/median ~ 10
SIGMA = 1.0
GROUPS_PER_STEP, GROUP_SIZE, ETA = 4, 2, 4
STEPS = 7  # per phase; the first is warm-up
STOP = ["e", "a"]  # a random model rarely ends turns itself


@tool
async def wait(seconds: float = 0.0) -> str:
    """Wait, like a slow tool call.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "done"


class LognormalToolEnv(Env):
    tools = (wait,)

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        return ListTasks([Task(id=f"t{i}", data={"q": f"task {i}"}) for i in range(10_000)])

    def initial_messages(self, task: Task) -> list[Message]:
        return [user(task["q"])]

    async def step(self, turn: AssistantTurn):  # type: ignore[no-untyped-def]
        if self.turns == 0:
            seconds = min(MEDIAN_S * math.exp(SIGMA * self.rng.gauss(0, 1)), 20 * MEDIAN_S)
            call = ToolCall(id="call_0", name="wait", arguments={"seconds": seconds})
            return await super().step(AssistantTurn(text=turn.text, content="", calls=[call]))
        return await super().step(AssistantTurn(text=turn.text, content=turn.text))

    async def score(self, answer: str) -> float:
        return (len(answer) % 5) / 4


def config(work: Path, url: str, model: Path, run: str, weight_sync: str = "disk",
           token: str | None = None) -> Config:
    return Config(
        run={"name": run},
        router={"admin_token": token},
        store=StoreConfig(url=f"sqlite:///{work / 'store.db'}"),
        engine=EngineConfig(model=model),
        rollout=RolloutConfig(env=ENV_ID, router_url=url, group_size=GROUP_SIZE, max_turns=3,
                              max_new_tokens=32, max_tokens=1024, stop=STOP,
                              filter_zero_variance=False, max_concurrent_episodes=64,
                              heartbeat_s=1.0),
        trainer=TrainerConfig(groups_per_step=GROUPS_PER_STEP, micro_batch_size=8,
                              optim={"lr": 3e-5}, max_staleness=ETA, data_poll_s=0.05,
                              checkpoint_every=10_000, export_every=1,
                              checkpoint_dir=work / run / "ckpt", export_dir=work / run / "exports",
                              tensorboard_dir=None,
                              weight_sync={"mode": weight_sync, "router_url": url}),
    )


def phase(cfg: Config, model: Path, sync: bool) -> dict[str, Any]:
    """Run STEPS steps; measured over steps 2..STEPS."""
    from trainer.learner import learner
    from trainer.loop import TrainLoop

    quiet = lambda line: None  # noqa: E731
    stamps: list[float] = []
    idle: list[float] = []
    with learner(model, cfg.trainer) as e:
        loop = TrainLoop(cfg, e, sync_mode=sync, log=quiet)
        loop.open()
        server = None if sync else ServeThread(cfg, None)
        if server is not None:
            server.start()
        try:
            stamps.append(time.monotonic())
            for _ in range(STEPS):
                batch_server = ServeThread(cfg, GROUPS_PER_STEP * GROUP_SIZE) if sync else None
                if batch_server is not None:
                    batch_server.start()
                metrics = loop.step_once() or {}
                if batch_server is not None:
                    batch_server.join()
                    if batch_server.error:
                        raise batch_server.error
                stamps.append(time.monotonic())
                idle.append(float(metrics.get("idle_s", 0.0)))
        finally:
            if server is not None:
                server.stop()
            loop.close()
    wall = stamps[-1] - stamps[1]
    return {"idle": sum(idle[1:]) / wall, "steps_per_s": (STEPS - 1) / wall, "wall_s": wall,
            "staleness": [h.get("staleness_mean") for h in loop.stats.history[1:]]}


def kappa(cfg: Config) -> float:
    """E[max over a step's episodes of L] / E[L], L = episode wall time, from the sync run."""
    from agent_rl.store import Store

    async def go() -> float:
        async with await Store.open(cfg.store) as store:
            run = await store.run_id(cfg.run.name)
            episodes = [e for e in await store.list_episodes(run_id=run, limit=10_000)
                        if e.started_at and e.finished_at]
        by_step: dict[int, list[float]] = {}
        for e in episodes:
            if e.trained_step is not None:
                by_step.setdefault(e.trained_step, []).append(e.finished_at - e.started_at)
        steps = [v for k, v in sorted(by_step.items())][1:]
        durations = [d for v in steps for d in v]
        return (sum(max(v) for v in steps) / len(steps)) / (sum(durations) / len(durations))

    return asyncio.run(go())


def main() -> None:
    import argparse

    import torch

    from agent_rl.config import load_config
    from agent_rl.sglang.client import EngineClient
    from agent_rl.engine.launcher import EngineServer
    from agent_rl.models import init_model
    from agent_rl.store.migrate import upgrade

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weight-sync", choices=("disk", "distributed", "tensor"), default="disk",
                        help="trainer.weight_sync.mode of both phases (in memory: through a router)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    register(ENV_ID, LognormalToolEnv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = init_model(work / "tiny-dense", "tiny-dense", seed=0)
        server = EngineServer(model, venv=load_config().engine.venv, log_dir=work / "logs",
                              startup_timeout_s=240.0).start()
        router = None
        url, token = server.url, None
        if args.weight_sync != "disk":  # in-memory syncs ask the router for its workers
            from agent_rl.config import RouterConfig
            from bench._serving import RouterThread

            router = RouterThread([server.url], RouterConfig(port=0))
            router.start()
            router.ready.wait(60)
            url, token = router.url, router.token
        try:
            sync_cfg = config(work, url, model, "sync", args.weight_sync, token)
            asyncio.run(upgrade(sync_cfg.store))  # the schema, before the trainer opens it
            sync = phase(sync_cfg, model, sync=True)
            print(f"sync : {json.dumps(sync)}", flush=True)

            async def reset() -> None:
                async with EngineClient(server.url) as c:
                    await c.update_weights_from_disk(model, weight_version="default")

            asyncio.run(reset())
            asyn = phase(config(work, url, model, "async", args.weight_sync, token), model, sync=False)
            print(f"async: {json.dumps(asyn)}", flush=True)
            k = kappa(sync_cfg)
        finally:
            if router is not None:
                router.stop()
            server.stop()
    rho = sync["idle"]
    bound = 1.0 / ((1.0 - rho) + rho / k)
    speedup = asyn["steps_per_s"] / sync["steps_per_s"]
    print(f"rho {rho:.3f} kappa {k:.2f} (batch of {GROUPS_PER_STEP * GROUP_SIZE} episodes, "
          f"lognormal sigma {SIGMA}), eta {ETA}")
    result = {"async_idle": round(asyn["idle"], 4), "sync_idle": round(sync["idle"], 4),
              "speedup": round(speedup, 3), "bound": round(bound, 3),
              "bound_fraction": round(speedup / bound, 3), "rho": round(rho, 3),
              "kappa": round(k, 2), "async_steps_per_s": round(asyn["steps_per_s"], 3),
              "sync_steps_per_s": round(sync["steps_per_s"], 3), "weight_sync": args.weight_sync,
              "load_avg_1m": round(os.getloadavg()[0], 2)}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
