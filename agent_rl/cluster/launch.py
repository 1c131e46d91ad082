"""`agent-rl launch` as library functions: connect to the Ray cluster, check the run can span
its nodes, start the supervisor (supervisor.py) as a detached actor named after the run, and
reach it again for `status`, `logs` and `stop` from any node.

The supervisor is detached: the launch returns once the roles are up, and the run outlives the
shell that launched it (as a `ray job` does); `agent-rl launch stop` ends it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent_rl.cluster.plan import Plan, make_plan
from agent_rl.config import Config, resolve_config_path
from agent_rl.kernel.errors import ClusterError, ConfigError

ACTOR_PREFIX = "agent-rl-launch:"


def connect(cfg: Config, address: str | None = None) -> Any:
    """ray, initialised against the configured (or given) cluster."""
    try:
        import ray
    except ImportError as e:
        raise ConfigError("agent-rl launch needs Ray: pip install 'agent-rl[cluster]'") from e
    if not ray.is_initialized():
        try:
            ray.init(address=address or cfg.cluster.address, namespace=cfg.cluster.namespace,
                     log_to_driver=False, logging_level="WARNING")  # fmt: skip
        except ConnectionError as e:
            where = address or cfg.cluster.address
            raise ClusterError(f"no Ray cluster at {where}: start one (`ray start --head` on "
                               f"this node) or set [cluster] address ({e})") from e
    return ray


def check_store(cfg: Config, nodes: int) -> None:
    """SQLite is a file on one node: refused when the cluster has more than one."""
    from agent_rl.store.db import database_url

    if nodes > 1 and database_url(cfg.store.url).drivername == "sqlite":
        raise ConfigError(f"store.url is SQLite and the Ray cluster has {nodes} nodes: roles on "
                          "different nodes share one store, set store.url = postgresql://...")


def launch(cfg: Config, config_path: Path | None, *, address: str | None = None,
           until_version: int | None = None, wait_s: float = 900.0,
           echo: Callable[[str], None] = print) -> list[dict[str, Any]]:  # fmt: skip
    """Place the run's roles on the cluster and return once all are running (or `wait_s` has
    passed); the status then. The roles stay up after this returns."""
    ray = connect(cfg, address)
    nodes = sum(1 for n in ray.nodes() if n["Alive"])
    check_store(cfg, nodes)
    plan = make_plan(cfg, resolve_config_path(config_path), until_version=until_version)
    from agent_rl.store.migrate import upgrade  # the schema before any role opens the store

    import anyio

    anyio.run(upgrade, cfg.store)
    supervisor = _start_supervisor(ray, cfg, plan)
    router_url = ray.get(supervisor.run.remote())
    echo(f"launched run {plan.run!r} on {nodes} Ray node(s); router at {router_url}")
    deadline = time.monotonic() + wait_s
    while True:
        status = ray.get(supervisor.status.remote())
        if all(s["state"] in ("running", "done") for s in status):
            return status
        if any(s["state"] == "failed" for s in status) or time.monotonic() > deadline:
            return status
        time.sleep(1.0)


def follow(cfg: Config, address: str | None = None, *, echo: Callable[[str], None] = print,
           poll_s: float = 2.0) -> list[dict[str, Any]]:  # fmt: skip
    """Echo every change of a role's state (a restart and its reason, a failure) until the run
    is over: its trainer done or failed, or every role failed. The status then."""
    seen: dict[str, tuple[str, int]] = {}
    while True:
        now = status(cfg, address)
        for s in now:
            state, restarts = seen.get(s["name"], ("", 0))
            if s["restarts"] > restarts:
                echo(f"{s['name']}: restart {s['restarts']} ({s['reason']})")
            if s["state"] != state:
                why = f" ({s['reason']})" if s["reason"] and s["state"] == "failed" else ""
                echo(f"{s['name']}: {s['state']}{why}")
            seen[s["name"]] = (s["state"], s["restarts"])
        trainer = [s for s in now if s["kind"] == "train"]
        if trainer and all(s["state"] in ("done", "failed") for s in trainer):
            return now
        if all(s["state"] == "failed" for s in now):
            return now
        time.sleep(poll_s)


def _start_supervisor(ray: Any, cfg: Config, plan: Plan) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from agent_rl.cluster.supervisor import Supervisor

    name = ACTOR_PREFIX + plan.run
    try:
        ray.get_actor(name, namespace=cfg.cluster.namespace)
    except ValueError:
        pass
    else:
        raise ClusterError(f"run {plan.run!r} is already launched on this cluster: "
                          "`agent-rl launch status`, or `agent-rl launch stop` first")
    actor = ray.remote(Supervisor).options(
        name=name, namespace=cfg.cluster.namespace, lifetime="detached", num_cpus=0,
        max_concurrency=64, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(head_node(ray), soft=False),
    )  # fmt: skip
    return actor.remote(plan)


def head_node(ray: Any) -> str:
    """The Ray id of the cluster's head node (where its GCS runs: the cluster does not outlive
    it, so the supervisor and the router, whose address must not move, live there too)."""
    for n in ray.nodes():
        if n["Alive"] and "node:__internal_head__" in n["Resources"]:
            return n["NodeID"]
    return ray.get_runtime_context().get_node_id()


def supervisor_of(cfg: Config, address: str | None = None) -> Any:
    """The running launch of `cfg.run.name` (ClusterError if there is none)."""
    ray = connect(cfg, address)
    try:
        return ray.get_actor(ACTOR_PREFIX + cfg.run.name, namespace=cfg.cluster.namespace)
    except ValueError as e:
        raise ClusterError(
            f"no launch of run {cfg.run.name!r} on this cluster (namespace "
            f"{cfg.cluster.namespace!r}): `agent-rl launch` starts one") from e


def status(cfg: Config, address: str | None = None) -> list[dict[str, Any]]:
    ray = connect(cfg, address)
    return ray.get(supervisor_of(cfg, address).status.remote())


def logs(cfg: Config, role: str, lines: int = 50, address: str | None = None) -> str:
    ray = connect(cfg, address)
    try:
        return ray.get(supervisor_of(cfg, address).logs.remote(role, lines))
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, KeyError):
            raise ClusterError(str(e.cause.args[0])) from e
        raise


def stop(cfg: Config, address: str | None = None) -> list[dict[str, Any]]:
    """Stop the launch (serves drain, the trainer checkpoints, then engines and router) and end
    its supervisor; the final status."""
    ray = connect(cfg, address)
    supervisor = supervisor_of(cfg, address)
    final = ray.get(supervisor.stop.remote())
    ray.kill(supervisor)
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:  # its name is free again: a new launch may take it
        try:
            ray.get_actor(ACTOR_PREFIX + cfg.run.name, namespace=cfg.cluster.namespace)
        except ValueError:
            break
        time.sleep(0.2)
    return final
