"""`agent-rl quickstart --cluster`'s RL stage on a Ray cluster through `agent-rl launch`.

Instead of the quickstart's own supervisor (processes.py), a local one-node Ray cluster is
started in this process (`ray.init`, with a custom resource `accel` standing for each engine's
accelerator; a caller already connected to a cluster, as bench/chaos.py is, uses that one) and
the run's engines, router, serves and trainer are placed on it by agent_rl/cluster's launch, which restarts what dies. The roles read a config of their own,
`runs/ray/agent-rl.toml` (role logs in `runs/ray/logs`): the quickstart's, with a `[cluster]` section, the engines started on
the weights training resumes from (so an engine the launch restarts comes back on them until
the router hands it a newer export), and a router port of its own (the evaluation fleet's
router may still be releasing its port). The stage ends when the store's policy version
reaches the target, the trainer is done, or its time is up; `launch.stop` then drains the
serves and checkpoints the trainer, and Ray is shut down.
"""

from __future__ import annotations

import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import tomli_w

from agent_rl.config import Config, load_config
from agent_rl.kernel.errors import ClusterError

ACCELERATOR = "accel"
"""The Ray resource an engine takes one of (the local cluster has one per engine)."""
RAY_CONFIG = Path("runs/ray/agent-rl.toml")
TRAINER_FINISH_S = 180.0


def ray_config(config_path: Path, *, start_weights: Path, engines: int, serves: int) -> Path:
    """The launch's config next to the quickstart's: the same run, store and recipe, placed as
    `engines` engines, `serves` serves and one trainer on a one-node Ray cluster."""
    from agent_rl.engine.launcher import free_port  # httpx: off the CLI's import path

    data: dict[str, Any] = tomllib.loads(config_path.read_text())
    data["engine"] = {**data.get("engine", {}), "model": str(start_weights)}
    data["router"] = {**data.get("router", {}), "port": free_port()}
    data["cluster"] = {
        "accelerator": ACCELERATOR, "engines": engines, "serves": serves, "trainer_ranks": 1,
        # Every role fits the one node: the engines count `accel`, nothing reserves a CPU
        # (the machine's cores are shared as in the quickstart's own multi-process mode).
        "engine_resources": {"cpus": 0, "accelerators": 1},
        "serve_resources": {"cpus": 0}, "trainer_resources": {"cpus": 0, "accelerators": 0},
        "restart_delay_s": 1.0, "log_dir": "runs/ray/logs",
    }  # fmt: skip
    path = config_path.parent / RAY_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# Written by `agent-rl quickstart --cluster` for its RL stage.\n"
                    + tomli_w.dumps(data))  # fmt: skip
    path.chmod(0o600)  # the router's admin token
    return path


def start_local_ray(engines: int) -> Any:
    """A one-node Ray cluster owned by this process (ended by `ray.shutdown`)."""
    from agent_rl.cluster.launch import connect  # noqa: F401  (its ImportError: the extra's hint)

    import ray

    if not ray.is_initialized():
        # address="local": a new cluster even where another runs on this machine (`auto`'s).
        ray.init(address="local", num_cpus=2, resources={ACCELERATOR: engines}, include_dashboard=False,
                 log_to_driver=False, logging_level="WARNING")  # fmt: skip
    return ray


async def rl_on_ray(config_path: Path, *, start_weights: Path, rl_steps: int,
                    rl_minutes: float, engines: int, serves: int,
                    say: Callable[[str], None] = print,
                    progress: Callable[[str], None] | None = None) -> int:  # fmt: skip
    """Train from the store's policy version to `rl_steps` on a local Ray cluster; the version
    reached. The launch is stopped (serves drained, trainer checkpointed) and Ray shut down on
    the way out, a failure or cancellation included."""
    from agent_rl.cluster import launch as cluster
    from agent_rl.store import Store

    path = ray_config(config_path, start_weights=start_weights, engines=engines, serves=serves)
    cfg: Config = load_config(path)
    ray = await anyio.to_thread.run_sync(start_local_ray, engines)
    launched = False
    try:
        say(f"RL on a local Ray cluster: `agent-rl launch` of {engines} engine(s), the router, "
            f"{serves} serve(s) and the trainer ({path})")
        status = await anyio.to_thread.run_sync(lambda: cluster.launch(
            cfg, path, until_version=rl_steps, echo=say))  # fmt: skip
        launched = True
        failed = [s for s in status if s["state"] == "failed"]
        if failed:
            raise ClusterError("the launch failed: " + "; ".join(
                f"{s['name']}: {s['reason']}" for s in failed) + f" (logs in {cfg.cluster.log_dir})")
        deadline = time.monotonic() + rl_minutes * 60
        async with await Store.open(cfg.store) as store:
            run_id = await store.ensure_run(cfg.run.name)
            while True:
                version = await store.latest_version(run_id)
                status = await anyio.to_thread.run_sync(cluster.status, cfg)
                trainer = [s for s in status if s["kind"] == "train"]
                restarts = sum(s["restarts"] for s in status)
                if progress is not None:
                    progress(f"v{version}/{rl_steps} | roles: " + ", ".join(
                        f"{s['name']} {s['state']}" for s in status)
                        + (f" | restarts {restarts}" if restarts else ""))  # fmt: skip
                if version >= rl_steps or any(s["state"] in ("done", "failed") for s in trainer):
                    break
                if time.monotonic() > deadline:
                    say("RL time is up: stopping the launch (the trainer checkpoints first)")
                    break
                await anyio.sleep(1.0)
            # At the target the trainer ends by itself after its export and summary (a stop
            # meanwhile would interrupt them): it gets TRAINER_FINISH_S for that.
            finish = time.monotonic() + TRAINER_FINISH_S
            while version >= rl_steps and time.monotonic() < finish and not all(
                    s["state"] in ("done", "failed") for s in trainer):  # fmt: skip
                await anyio.sleep(1.0)
                status = await anyio.to_thread.run_sync(cluster.status, cfg)
                trainer = [s for s in status if s["kind"] == "train"]
            for s in trainer:
                if s["state"] == "failed":
                    say(f"the trainer failed: {s['reason']} (see {cfg.cluster.log_dir}/train.log)")
    finally:
        with anyio.CancelScope(shield=True):
            if launched:
                say("stopping the launch (serves drain, the trainer checkpoints)")
                await anyio.to_thread.run_sync(cluster.stop, cfg)
            await anyio.to_thread.run_sync(ray.shutdown)
    async with await Store.open(cfg.store) as store:
        run_id = await store.ensure_run(cfg.run.name)
        await store.resolve_interrupted(stale_after_s=0.0, run_id=run_id)
        return await store.latest_version(run_id)
