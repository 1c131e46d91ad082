"""A local multi-node Ray cluster for the tests and benches (`ray.cluster_utils.Cluster`: one
raylet per node on this machine), losing one of its nodes as when a machine dies (fault
injection), and stopping it as `ray stop` does."""

from __future__ import annotations

from typing import Any

HEAD = {"include_dashboard": False, "_system_config": {
    "health_check_initial_delay_ms": 0, "health_check_period_ms": 1000,
    "health_check_failure_threshold": 3}}  # fmt: skip
"""A head node's arguments: a lost node is declared dead within ~3 s (Ray's default: ~15 s)."""


def local_cluster(head_cpus: float, nodes: list[dict[str, Any]], namespace: str,
                  head_resources: dict[str, float] | None = None) -> tuple[Any, list[Any]]:
    """A head with `head_cpus` (and `head_resources`) and one node per entry of `nodes`
    (Cluster.add_node's keywords), this process connected to it; the cluster and those nodes."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": head_cpus, "resources": head_resources or {}, **HEAD})
    added = [c.add_node(**node) for node in nodes]
    c.connect(namespace=namespace)
    return c, added


def lose_node(c: Any, node: Any) -> None:
    """Fault injection: `node` goes away with everything on it (its raylet, Ray's workers and the
    processes they started), as when a machine dies; Ray is told nothing."""
    import psutil

    raylet = node.all_processes["raylet"][0].process.pid
    doomed = psutil.Process(raylet).children(recursive=True)
    c.remove_node(node, allow_graceful=False)
    for p in doomed:
        try:
            p.kill()
        except psutil.Error:
            pass


def ray_stop(grace_period: int = 16) -> None:
    """What `ray stop` does on a machine, done by Ray's own routine (SIGTERM to the raylets, then
    to Ray's workers and agents, then to the GCS, each followed by a SIGKILL of what is left
    after a third of `grace_period`), to the Ray processes this process started only (a local
    cluster's): other Ray clusters on the machine are left alone, and so is the file that
    `address="auto"` reads."""
    from unittest import mock

    import psutil
    import ray._common.utils
    from ray.scripts import scripts

    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    every = psutil.process_iter

    def process_iter(*args: Any, **kwargs: Any) -> Any:
        return (p for p in every(*args, **kwargs) if p.pid in ours)

    with mock.patch.object(scripts.psutil, "process_iter", process_iter), \
            mock.patch.object(ray._common.utils, "reset_ray_address", lambda: None):
        scripts.stop.callback(force=False, grace_period=grace_period)
