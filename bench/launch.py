"""`agent-rl launch` on a Ray cluster against the quickstart's own multi-process supervisor, one
run each, in one process: seconds to the first trained step, and seconds from a lost node to
the next trained step.

The fleet is the same in both: two SGLang engines (CPU), the router, two `agent-rl serve`, one
`agent-rl train`, a fresh PostgreSQL database each, the same config (a random-init quickstart
model, the calculator env, every group trained). Without Ray, the quickstart's `Supervisor`
starts the same CLI commands as plain processes (engines first, then the router, then serves
and the trainer once the router answers, as `agent-rl quickstart --cluster` does). With Ray, a
local multi-node cluster (`ray.cluster_utils.Cluster`: a head, two nodes with an `accel`
resource for an engine and a serve each, a trainer node) and `agent-rl launch --detach`'s
library call; then the trainer's node is lost (its raylet and every process under it killed),
a spare trainer node joins, and the time until the store's next policy version is the
recovery. The Ray run is stopped with `agent-rl launch stop` and audited.

Run: `python bench/launch.py [--store-url postgresql://...]` (needs `agent-rl engine install`;
default URL: $AGENT_RL_TEST_POSTGRES_URL or postgres@127.0.0.1:5432/test). Last line: RESULT
{"first_step_s", "first_step_s_without_ray", "ratio", "recovery_s", "lost", "trained_twice",
"left_running_after_stop"} (role processes, and what they started, still running 10 s after
`agent-rl launch stop`); targets: ratio <= 1.3, recovery_s < 60, lost 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg  # noqa: E402
import tomli_w  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from agent_rl.config import Config, load_config  # noqa: E402
from agent_rl.engine.launcher import free_port  # noqa: E402
from agent_rl.kernel.processes import alive  # noqa: E402
from agent_rl.store import Store  # noqa: E402

TIMEOUT_S = 900.0


def fresh_database(base_url: str, tag: str) -> tuple[str, str]:
    name = f"agent_rl_launch_{tag}_{os.getpid()}_{int(time.time())}"
    url = make_url(base_url)
    with psycopg.connect(url.set(drivername="postgresql").render_as_string(hide_password=False),
                         autocommit=True) as conn:  # fmt: skip
        conn.execute(f'CREATE DATABASE "{name}"')
    return url.set(database=name).render_as_string(hide_password=False), name


def drop_database(base_url: str, name: str) -> None:
    url = make_url(base_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def write_config(workdir: Path, model: Path, store_url: str, **cluster: Any) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "agent-rl.toml"
    path.write_text(tomli_w.dumps({
        "run": {"name": "bench-launch"},
        "store": {"url": store_url},
        "engine": {"model": str(model), "log_dir": "runs/logs"},
        "router": {"port": free_port(), "admin_token": secrets.token_urlsafe(16)},
        "rollout": {
            "env": "calculator", "env_kwargs": {"min_terms": 2, "max_terms": 2, "max_digits": 1,
                                                "max_turns": 2, "tools_in_prompt": False},
            "group_size": 4, "max_concurrent_episodes": 8, "max_turns": 2, "max_tokens": 256,
            "max_new_tokens": 16, "heartbeat_s": 1.0, "stale_after_s": 6.0,
            "filter_zero_variance": False,
        },
        "trainer": {
            "model": str(model), "groups_per_step": 2, "micro_batch_size": 8, "max_staleness": 2,
            "export_every": 1, "checkpoint_every": 1, "claim_lease_s": 10.0, "data_poll_s": 0.5,
            "checkpoint_dir": "runs/checkpoints", "export_dir": "runs/exports",
            "tensorboard_dir": "runs/tensorboard",
        },
        "cluster": cluster,
    }))  # fmt: skip
    return path


async def latest_version(cfg: Config) -> int:
    async with await Store.open(cfg.store) as store:
        return await store.latest_version(await store.ensure_run(cfg.run.name))


async def wait_version(cfg: Config, at_least: int, timeout_s: float = TIMEOUT_S) -> float:
    """Monotonic time at which the run's policy version reached `at_least`."""
    deadline = time.monotonic() + timeout_s
    while await latest_version(cfg) < at_least:
        if time.monotonic() > deadline:
            raise TimeoutError(f"policy version {at_least} not reached in {timeout_s:.0f}s")
        await asyncio.sleep(0.25)
    return time.monotonic()


async def without_ray(workdir: Path, model: Path, store_url: str) -> float:
    """Seconds from starting the fleet as plain processes to the first trained step."""
    import aiohttp

    from agent_rl.app.quickstart.processes import Supervisor, agent_rl_command
    from agent_rl.store.migrate import upgrade

    config = write_config(workdir, model, store_url)
    cfg = load_config(config)
    head = ["--config", str(config)]
    sup = Supervisor(workdir)
    t0 = time.monotonic()
    await upgrade(cfg.store)
    try:
        engines = []
        for i in range(2):
            port = free_port()
            sup.add(f"engine-{i}", agent_rl_command(*head, "engine", "start", "--port", str(port)),
                    log_path=workdir / f"runs/logs/engine-{i}.log")  # fmt: skip
            engines.append(f"http://127.0.0.1:{port}")
        router = f"http://127.0.0.1:{cfg.router.port}"
        workers = [a for url in engines for a in ("--worker", url)]
        sup.add("router", agent_rl_command(*head, "router", *workers),
                log_path=workdir / "runs/logs/router.log")
        async with aiohttp.ClientSession() as s:
            # Serves and the trainer once an engine answers and the router runs, as launch does.
            for url in (engines[0] + "/health", router + "/health"):
                while True:
                    try:
                        async with s.get(url) as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.5)
        for i in range(2):
            serve = agent_rl_command(*head, "serve", "--router-url", router, "--no-api")
            sup.add(f"serve-{i}", serve, log_path=workdir / f"runs/logs/serve-{i}.log")
        sup.add("train", agent_rl_command(*head, "train", "--router-url", router),
                log_path=workdir / "runs/logs/train.log")
        watch = asyncio.create_task(sup.watch())  # restarts, as the quickstart's supervisor does
        try:
            return await wait_version(cfg, 1) - t0
        finally:
            watch.cancel()
    finally:
        await sup.stop_all(["train", "serve-0", "serve-1", "router", "engine-0", "engine-1"],
                           grace_s=30)  # fmt: skip


def role_processes(status: list[dict[str, Any]]) -> list[Any]:
    """Every role's process and what it started (an engine's SGLang server and its children)."""
    import psutil

    procs = []
    for s in status:
        try:
            root = psutil.Process(s["pid"])
            procs += [root, *root.children(recursive=True)]
        except (psutil.Error, TypeError):
            pass
    return procs


def left_running(procs: list[Any], within_s: float = 10.0) -> list[str]:
    """Of `procs`, those still running `within_s` after the launch was stopped."""
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [f"{p.pid} {' '.join(p.cmdline())[:80]}" for p in procs if alive(p)]


def with_ray(workdir: Path, model: Path, store_url: str) -> dict[str, Any]:
    """`agent-rl launch` on a local Ray cluster: first step, then the trainer's node lost."""
    import ray

    from agent_rl.cluster import launch as cluster
    from agent_rl.testing.ray_cluster import local_cluster, lose_node

    worker = {"num_cpus": 1, "resources": {"accel": 1, "serve_slot": 1}}
    trainer_node = {"num_cpus": 1, "resources": {"trainer_slot": 1}}
    c, (*_, doomed_node) = local_cluster(1, [worker, worker, trainer_node], "agent-rl-bench")
    config = write_config(
        workdir, model, store_url, address=c.address, accelerator="accel", engines=2, serves=2,
        trainer_ranks=1, restart_delay_s=0.5, serve_drain_s=30.0,
        engine_resources={"cpus": 0, "accelerators": 1},
        serve_resources={"cpus": 1, "resources": {"serve_slot": 1}},
        trainer_resources={"cpus": 1, "resources": {"trainer_slot": 1}},
    )  # fmt: skip
    cfg = load_config(config)
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        t0 = time.monotonic()
        cluster.launch(cfg, config, wait_s=TIMEOUT_S, echo=lambda line: None)
        first = asyncio.run(wait_version(cfg, 1)) - t0
        asyncio.run(wait_version(cfg, 3))
        c.add_node(**trainer_node)  # where the trainer goes next
        version = asyncio.run(latest_version(cfg))
        lost_at = time.monotonic()
        lose_node(c, doomed_node)
        recovery = asyncio.run(wait_version(cfg, version + 1)) - lost_at
        started = role_processes(cluster.status(cfg))
        cluster.stop(cfg)
        left = left_running(started)

        async def audit() -> Any:
            async with await Store.open(cfg.store) as store:
                return await store.audit(await store.ensure_run(cfg.run.name))

        result = asyncio.run(audit())
        return {"first_step_s": round(first, 1), "recovery_s": round(recovery, 1),
                "lost": result.lost, "trained_twice": result.trained_twice,
                "left_running_after_stop": left}  # fmt: skip
    finally:
        os.chdir(cwd)
        ray.shutdown()
        c.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store-url", default=os.environ.get(
        "AGENT_RL_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"))
    args = ap.parse_args()
    from agent_rl.models import init_model

    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        root = Path(tmp)
        model = init_model(root / "model", "quickstart", seed=0)
        url, name = fresh_database(args.store_url, "plain")
        try:
            plain = asyncio.run(without_ray(root / "plain", model, url))
        finally:
            drop_database(args.store_url, name)
        print(f"without Ray: first step after {plain:.1f}s", flush=True)
        url, name = fresh_database(args.store_url, "ray")
        try:
            ray_run = with_ray(root / "ray", model, url)
        finally:
            drop_database(args.store_url, name)
    result = {"first_step_s": ray_run["first_step_s"], "first_step_s_without_ray": round(plain, 1),
              "ratio": round(ray_run["first_step_s"] / plain, 2),
              "recovery_s": ray_run["recovery_s"], "lost": ray_run["lost"],
              "trained_twice": ray_run["trained_twice"],
              "left_running_after_stop": len(ray_run["left_running_after_stop"]),
              "load": Path("/proc/loadavg").read_text().split()[:3]}  # fmt: skip
    for line in ray_run["left_running_after_stop"]:
        print(f"left running after `agent-rl launch stop`: {line}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
