"""`agent-rl launch` on a local multi-node Ray cluster (`ray.cluster_utils.Cluster`: one raylet
per node on this machine, a custom resource `accel` standing for each node's accelerator), with
the real roles: SGLang engines on CPU, the router, serves and the Megatron-core trainer, sharing
a PostgreSQL store.

- the router alone: SIGKILLed, it is started again at the same address, with the reason in the
  status; its actor killed on a live node, its process goes too and it is started again; a
  third death past `max_restarts` leaves it failed, with that reason;
- a role's process does not outlive its Ray cluster (a `ray stop`): it dies with its actor;
- a quickstart-sized run reaches several policy versions; then the node that hosts an engine and
  a serve is lost (fault injection: the node's raylet and every process under it are killed, as
  if the machine went away), its roles are placed again on a node that joins, versions keep
  advancing (the re-placed engine joins the router on the current weights), `agent-rl launch
  stop` drains and checkpoints, and `agent-rl db audit` is clean;
- SQLite is refused in one line when the cluster has more than one node.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from agent_rl.config import Config, load_config
from agent_rl.engine.launcher import free_port
from agent_rl.kernel.encoding import policy_version
from agent_rl.kernel.processes import alive
from tests._databases import fresh_postgres

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from agent_rl.cluster import launch as cluster  # noqa: E402
from agent_rl.testing.ray_cluster import local_cluster, lose_node, ray_stop  # noqa: E402

# Tests that start a Ray cluster run one at a time (tests/conftest.py): two clusters started side
# by side took each other's ports (a client reached the other cluster's GCS and was refused).
pytestmark = pytest.mark.one_at_a_time("fleet")

ACCEL = "accel"
WORKER = {"num_cpus": 1, "resources": {ACCEL: 1, "serve_slot": 1}}
"""A GPU node of the test: one engine (its `accel`) and one serve (its CPU)."""
TRAINER_NODE = {"num_cpus": 1, "resources": {"trainer_slot": 1}}
"""A node for one trainer rank (the head is another)."""


@pytest.fixture
def ray_cluster() -> Iterator[Cluster]:
    """One test's own cluster (Ray tests run one at a time): a head (the launch's supervisor, the
    router and the trainer) and two worker nodes; node deaths noticed within ~3 s."""
    c, _ = local_cluster(1, [WORKER, WORKER], "agent-rl-tests", head_resources={"trainer_slot": 1})
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with fresh_postgres() as url:
        yield url


def _write_config(workdir: Path, **sections: Any) -> Path:
    path = workdir / "agent-rl.toml"
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(sections))
    return path


def _until(what: str, condition: Callable[[], Any], timeout_s: float, poll_s: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"not reached within {timeout_s:.0f}s: {what}"
        time.sleep(poll_s)


def _by_name(status: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in status}


def _cli(config: Path, *args: str, **kwargs: Any) -> subprocess.Popen[str]:
    """`agent-rl --config CONFIG ARGS` as a user runs it (none of the tests' AGENT_RL_*)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_RL_")}
    return subprocess.Popen([sys.executable, "-m", "agent_rl.app.cli", "--config", str(config),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, **kwargs)  # fmt: skip


class Lines:
    """The output of a running process, line by line as it comes (a reader thread)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line)

    def has(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))

    def text(self) -> str:
        self.thread.join(timeout=30)
        return "".join(self.lines)


def _run_cli(config: Path, *args: str, timeout_s: float = 120) -> tuple[int, str]:
    proc = _cli(config, *args)
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, out


@pytest.mark.postgres
def test_a_killed_router_is_restarted_until_max_restarts(
    ray_cluster: Cluster, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`agent-rl launch` in the foreground, with only a router: killed, it is started again at
    the same address; when its Ray actor dies on a live node, its process is killed too (no
    orphan) and it is started again; a third death is past max_restarts, so it is left failed
    with the reason, and the launch, with nothing left running, stops the run and exits 1."""
    import psutil

    config = _write_config(
        tmp_path, run={"name": "router-only"}, store={"url": pg_url},
        router={"port": free_port(), "admin_token": secrets.token_urlsafe(16)},
        cluster={"address": ray_cluster.address, "engines": 0, "serves": 0, "trainer_ranks": 0,
                 "max_restarts": 2, "restart_delay_s": 0.2},
    )  # fmt: skip
    monkeypatch.chdir(tmp_path)
    cfg = load_config(config)
    launch = _cli(config, "launch", cwd=tmp_path)
    output = Lines(launch)
    try:
        router = _until("the router running", lambda: next(
            (s for s in _status_or_none(cfg) if s["state"] == "running"), None), 120)
        assert router["starts"] == 1 and router["node_id"] == _head_id(), router
        os.kill(router["pid"], signal.SIGKILL)
        again = _until("the router restarted", lambda: next(
            (s for s in cluster.status(cfg) if s["state"] == "running" and s["starts"] == 2),
            None), 60)  # fmt: skip
        assert again["restarts"] == 1 and again["reason"] == "killed by SIGKILL"
        assert again["url"] == router["url"] and again["pid"] != router["pid"]  # same address
        with pytest.raises(cluster.ClusterError, match="no role 'engine-9'.*router"):
            cluster.logs(cfg, "engine-9")
        assert cluster.logs(cfg, "router").count("start on") == 2  # read on its node
        _until("the launch reported the restart",
               lambda: output.has("router: restart 1 (killed by SIGKILL)"), 30, poll_s=0.2)
        # Fault injection: the Ray worker process of the router's actor (its parent) dies.
        orphan = psutil.Process(again["pid"])
        orphan.parent().kill()  # type: ignore[union-attr]
        third = _until("the router restarted after its actor died", lambda: next(
            (s for s in cluster.status(cfg) if s["state"] == "running" and s["starts"] == 3),
            None), 60)  # fmt: skip
        assert third["reason"].startswith("its Ray actor died"), third
        assert not alive(orphan)
        os.kill(third["pid"], signal.SIGTERM)  # a clean exit of a router is a death too
        launch.wait(timeout=120)
    finally:
        if launch.poll() is None:
            launch.send_signal(signal.SIGINT)
            launch.wait(timeout=120)
    out = output.text()
    assert launch.returncode == 1, out
    assert "router: failed (exited cleanly; not restarted: max_restarts=2 reached)" in out
    with pytest.raises(cluster.ClusterError, match="no launch of run 'router-only'"):
        cluster.status(cfg)


@pytest.mark.postgres
@pytest.mark.parametrize("goes", ["shutdown", "ray stop"])
def test_a_role_process_dies_with_its_ray_cluster(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, goes: str
) -> None:
    """A run launched detached, then its Ray cluster goes away under it, supervisor included
    (what `ray stop` does: Ray's processes end, and nothing of the launch is left to stop the
    roles): the router's process, started by its role's actor, dies with it instead of serving
    on as an orphan. Before, it was left running, in a session of its own. The cluster goes
    by `Cluster.shutdown` (SIGKILLs), or by `ray stop`'s own routine (raylets first, with
    SIGTERM, then Ray's workers, then the GCS) on this cluster's processes."""
    import psutil

    c, _ = local_cluster(1, [], "agent-rl-tests")
    try:
        config = _write_config(
            tmp_path, run={"name": "ray-stopped"}, store={"url": pg_url},
            router={"port": free_port(), "admin_token": secrets.token_urlsafe(16)},
            cluster={"address": c.address, "engines": 0, "serves": 0, "trainer_ranks": 0},
        )  # fmt: skip
        monkeypatch.chdir(tmp_path)
        status = cluster.launch(load_config(config), config, wait_s=120, echo=lambda line: None)
        (router,) = status
        assert router["state"] == "running", status
        process = psutil.Process(router["pid"])
        assert "agent_rl.app.cli" in process.cmdline()
    finally:
        ray.shutdown()
        try:
            if goes == "ray stop":
                ray_stop()
        finally:
            c.shutdown()
    _until("the router's process gone with its cluster",
           lambda: not alive(process), 30,
           poll_s=0.2)  # fmt: skip


def _status_or_none(cfg: Config) -> list[dict[str, Any]]:
    try:
        return cluster.status(cfg)
    except cluster.ClusterError:  # not launched yet
        return []


def _head_id() -> str:
    return cluster.head_node(ray)


def test_sqlite_is_refused_in_one_line_when_roles_span_nodes(
    ray_cluster: Cluster, tmp_path: Path
) -> None:
    config = _write_config(tmp_path, store={"url": f"sqlite:///{tmp_path / 's.db'}"},
                           router={"admin_token": "t"}, cluster={"address": ray_cluster.address})
    code, out = _run_cli(config, "launch")
    assert code == 1 and "Traceback" not in out, out
    assert out.strip().splitlines()[-1] == (
        "error: store.url is SQLite and the Ray cluster has 3 nodes: roles on different nodes "
        "share one store, set store.url = postgresql://..."), out


# ----- a whole run ---------------------------------------------------------------------------


def _run_config(workdir: Path, model: Path, store_url: str, address: str) -> Path:
    return _write_config(
        workdir,
        run={"name": "launched"},
        store={"url": store_url},
        engine={"model": str(model), "log_dir": "runs/logs"},
        router={"port": free_port(), "admin_token": secrets.token_urlsafe(16)},
        rollout={
            "env": "calculator", "env_kwargs": {"min_terms": 2, "max_terms": 2, "max_digits": 1,
                                                "max_turns": 2, "tools_in_prompt": False},
            "group_size": 4, "max_concurrent_episodes": 8, "max_turns": 2, "max_tokens": 256,
            "max_new_tokens": 16, "temperature": 1.0, "heartbeat_s": 1.0, "stale_after_s": 6.0,
            "filter_zero_variance": False,
        },  # a random model's rewards are mostly 0: its groups still train
        trainer={
            "model": str(model), "groups_per_step": 2, "micro_batch_size": 8, "max_staleness": 2,
            "export_every": 1, "checkpoint_every": 1, "claim_lease_s": 10.0, "data_poll_s": 0.5,
            "checkpoint_dir": "runs/checkpoints", "keep_checkpoints": 2,
            "export_dir": "runs/exports", "tensorboard_dir": "runs/tensorboard",
        },
        cluster={
            "address": address, "accelerator": ACCEL, "engines": 2, "serves": 2,
            "trainer_ranks": 2, "trainer_strategy": "STRICT_SPREAD", "restart_delay_s": 0.5,
            "serve_drain_s": 30.0,
            "engine_resources": {"cpus": 0, "accelerators": 1},
            "serve_resources": {"cpus": 1, "resources": {"serve_slot": 1}},
            "trainer_resources": {"cpus": 1, "resources": {"trainer_slot": 1}},
        },
    )  # fmt: skip


def _version(cfg: Config) -> int:
    from agent_rl.store import Store

    async def read() -> int:
        async with await Store.open(cfg.store) as store:
            return await store.latest_version(await store.ensure_run(cfg.run.name))

    return asyncio.run(read())


def _router_workers(cfg: Config, router_url: str) -> dict[str, str | None]:
    """The router's healthy workers and their weight versions."""
    import httpx

    token = cfg.router.admin_token.get_secret_value()  # type: ignore[union-attr]
    listed = httpx.get(router_url + "/workers", headers={"Authorization": f"Bearer {token}"})
    return {w["url"]: w["weight_version"] for w in listed.json()["workers"] if w["healthy"]}


def _running_on(cfg: Config, node_id: str, count: int) -> list[dict[str, Any]] | None:
    there = [s for s in cluster.status(cfg) if s["node_id"] == node_id and s["state"] == "running"]
    return there if len(there) == count else None


LOST = re.compile(r"(train-\d )?node \S+ \(\w{8}\) lost")


@pytest.mark.slow
@pytest.mark.postgres
def test_a_launched_run_trains_and_survives_losing_nodes(
    ray_cluster: Cluster, engine_venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two engines, the router, two serves and a 2-rank trainer gang over two nodes; the node of
    an engine and a serve is lost, then the node of a trainer rank; the run goes on through
    both, and its store is audited clean after `agent-rl launch stop`."""
    from agent_rl.models import init_model

    model = init_model(tmp_path / "model", "quickstart", seed=0)
    trainer_node = ray_cluster.add_node(**TRAINER_NODE)
    names = ("router", "engine-0", "engine-1", "serve-0", "serve-1", "train-0", "train-1")
    with fresh_postgres() as url:
        config = _run_config(tmp_path, model, url, ray_cluster.address)
        monkeypatch.chdir(tmp_path)
        cfg = load_config(config)
        code, out = _run_cli(config, "launch", "--detach", "--wait", "600", timeout_s=700)
        try:
            assert code == 0, out
            roles = _by_name(cluster.status(cfg))
            assert list(roles) == list(names), roles
            assert {s["state"] for s in roles.values()} == {"running"}, roles
            # The gang spans two nodes: the head and the trainer node (STRICT_SPREAD).
            assert {roles["train-0"]["node_id"], roles["train-1"]["node_id"]} == {
                _head_id(), trainer_node.node_id}
            _until("policy version 3", lambda: _version(cfg) >= 3, 420)

            # 1. The node of engine-0 and a serve (each worker node holds one of each) is lost.
            victim_id = roles["engine-0"]["node_id"]
            assert [n for n, s in roles.items() if s["node_id"] == victim_id] in (
                ["engine-0", "serve-0"], ["engine-0", "serve-1"])
            victim = next(n for n in ray_cluster.worker_nodes if n.node_id == victim_id)
            spare = ray_cluster.add_node(**WORKER)
            lost_at = _version(cfg)
            lose_node(ray_cluster, victim)
            moved = _until("engine-0 and its serve running on the spare node",
                           lambda: _running_on(cfg, spare.node_id, 2), 400)
            for s in moved:
                assert s["restarts"] == 1 and LOST.fullmatch(s["reason"]), s
            now = _by_name(cluster.status(cfg))
            engines = {now["engine-0"]["url"], now["engine-1"]["url"]}
            _until("the router's workers: the engines that run (the lost one's address left)",
                   lambda: set(_router_workers(cfg, now["router"]["url"])) == engines, 30)
            # The re-placed engine (started on its launch weights) joined on current ones.
            joined = _router_workers(cfg, now["router"]["url"])[now["engine-0"]["url"]]
            assert policy_version(joined) >= lost_at - 1 > 0, (joined, lost_at)
            after = _version(cfg)
            _until("two more versions", lambda: _version(cfg) >= after + 2, 420)
            assert all(now[n]["restarts"] == 0 for n in ("router", "engine-1", "train-0"))

            # 2. The node of a trainer rank is lost: the gang starts again from its checkpoint.
            spare_trainer = ray_cluster.add_node(**TRAINER_NODE)
            lose_node(ray_cluster, trainer_node)
            ranks = _until("the trainer's gang running again", lambda: [
                s for s in cluster.status(cfg) if s["name"].startswith("train-")
                and s["state"] == "running" and s["restarts"] == 1] or None, 400)  # fmt: skip
            assert len(ranks) == 2 and {s["node_id"] for s in ranks} == {
                _head_id(), spare_trainer.node_id}, ranks
            assert all(LOST.fullmatch(s["reason"]) for s in ranks), ranks
            after = _version(cfg)
            _until("two more versions", lambda: _version(cfg) >= after + 2, 420)
            assert "resumed from checkpoint" in (tmp_path / "runs/logs/train-0.log").read_text()
        finally:
            code, out = _run_cli(config, "launch", "stop", timeout_s=400)
        assert code == 0, out
        rows = [line.split()[:2] for line in out.splitlines() if line.partition(" ")[0] in names]
        assert rows == [[n, "stopped"] for n in names], out
        # The trainer stopped at a step's end (its checkpoint written) and printed its summary.
        assert "now policy version" in (tmp_path / "runs/logs/train-0.log").read_text()
        # A checkpoint every step, the two newest kept (resumed from above, the last at the stop).
        kept = sorted(p.name for p in (tmp_path / "runs/checkpoints").iterdir())
        assert len(kept) == 2 and not any(n.endswith(".tmp") for n in kept), kept
        code, out = _run_cli(config, "db", "audit", "--finished")
        assert code == 0, out
        assert "lost=0" in out and "1 runs audited, 0 with problems" in out, out
