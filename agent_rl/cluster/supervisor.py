"""The launch's supervisor: a detached Ray actor that places every group of the plan, watches
it, and places it again when it dies.

One thread per group runs its life: place (actors reserving the group's resources; a trainer
gang in a placement group), start the processes, wait for the first to end, then decide: a
clean end of a `done_on_success` group is done; anything else (an exit status, a signal, the
actor gone with its node) is a restart after `restart_delay_s`, on whatever nodes Ray finds
the resources on, until `max_restarts`; then the group is left failed with the reason. A role
process whose actor died while its node stayed up is killed there first (no orphan serving on).
Engines join the router once they answer: a sync thread keeps the router's worker list equal
to the engines that are up (adding a re-placed engine, removing the address of a lost one); the
router hands a worker it adds the newest weights (router/control.py).

The supervisor lives on the cluster's head node and so does the router, whose address must not
move (the cluster does not outlive its head anyway). The CLI calls `status`, `logs` and `stop`.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agent_rl.cluster.plan import STOP_ORDER, Group, Plan, fill
from agent_rl.cluster.role import RoleProcess, free_port, kill_orphan, tail_file

log = logging.getLogger(__name__)

POLL_S = 1.0
GANG_SETTLE_S = 10.0
NODE_DEATH_WAIT_S = 40.0
"""How long a dead actor's node may still count as alive (Ray's default health checks take
~15 s to declare a silent node dead) before the death is put down to the actor itself."""


@dataclass
class ProcessStatus:
    """One process of a group, as `agent-rl launch status` shows it."""

    name: str
    kind: str
    state: str = "pending"
    """pending | starting | running | restarting | done | failed | stopped."""
    node: str = ""
    """The address of its node."""
    node_id: str = ""
    """Its node's Ray id."""
    pid: int | None = None
    url: str | None = None
    starts: int = 0
    restarts: int = 0
    reason: str = ""
    """Why it was last restarted, or why it failed."""
    waiting: str = ""
    """What it waits for while pending (the resources no node has free)."""


class Stopping(Exception):
    """The launch is being stopped: leave the group's loop."""


@dataclass
class Placed:
    actors: list[Any]
    where: list[dict[str, str]]
    pg: Any = None
    waits: list[Any] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)


class Supervisor:
    def __init__(self, plan: Plan) -> None:
        import ray

        self.plan = plan
        self.node_id = ray.get_runtime_context().get_node_id()
        self.ip = ray.util.get_node_ip_address()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.status_of: dict[str, list[ProcessStatus]] = {
            g.name: [ProcessStatus(n, g.kind) for n in g.process_names()] for g in plan.groups
        }
        self.placed: dict[str, Placed] = {}
        self.threads: list[threading.Thread] = []
        port = plan.router_port or free_port()
        self.router_port = port
        self.router_url = f"http://{plan.router_host or self.ip}:{port}"
        self.managed_urls: set[str] = set()
        self.role_actor = ray.remote(max_concurrency=4)(RoleProcess)

    # ----- the API the CLI calls -------------------------------------------------------------

    def run(self) -> str:
        """Start every group's thread (the router's first); the router's URL."""
        for g in self.plan.groups:
            t = threading.Thread(target=self._keep, args=(g,), name=g.name, daemon=True)
            t.start()
            self.threads.append(t)
        sync = threading.Thread(target=self._sync_router, name="router-sync", daemon=True)
        sync.start()
        return self.router_url

    def status(self) -> list[dict[str, Any]]:
        with self.lock:
            return [asdict(s) for g in self.plan.groups for s in self.status_of[g.name]]

    def logs(self, name: str, lines: int = 50) -> str:
        for g in self.plan.groups:
            names = g.process_names()
            if name in names:
                placed = self.placed.get(g.name)
                if placed is not None:
                    import ray

                    try:
                        actor = placed.actors[names.index(name)]
                        return ray.get(actor.tail.remote(lines), timeout=30)
                    except Exception:  # noqa: BLE001 - its node is gone: the shared file, if any
                        pass
                return tail_file(Path(self.plan.cwd) / self.plan.log_dir / f"{name}.log", lines)
        known = ", ".join(n for g in self.plan.groups for n in g.process_names())
        raise KeyError(f"no role {name!r} in this launch; its roles: {known}")

    def stop(self) -> list[dict[str, Any]]:
        """Stop every group in STOP_ORDER (serves drain, the trainer checkpoints, then the
        engines and the router) and release their resources; the final status."""
        import ray

        self.stopping.set()
        for kind in STOP_ORDER:
            calls = []
            for g in self.plan.group(kind):
                placed = self.placed.get(g.name)
                if placed is None:
                    continue
                self._set(g, state="stopping")
                calls += [a.stop.remote(g.stop_signal, g.stop_grace_s) for a in placed.actors]
            for call in calls:
                try:
                    ray.get(call, timeout=max(g.stop_grace_s for g in self.plan.groups) + 60)
                except Exception as e:  # noqa: BLE001 - a lost node's process is gone already
                    log.warning("stop: %s", e)
        for t in self.threads:
            t.join(timeout=30)
        for g in self.plan.groups:
            self._release(g)
            with self.lock:
                for s in self.status_of[g.name]:
                    if s.state not in ("done", "failed"):
                        s.state = "stopped"
        return self.status()

    # ----- a group's life --------------------------------------------------------------------

    def _keep(self, g: Group) -> None:
        restarts = 0
        while not self.stopping.is_set():
            try:
                self._wait_for_fleet(g)
                placed = self._place(g)
                self._start(g, placed)
                outcome = self._watch(g, placed)
            except Stopping:
                return
            except Exception as e:  # noqa: BLE001 - placing or starting failed: a restart
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                outcome = f"could not start: {type(e).__name__}: {first[:200]}"
            if self.stopping.is_set():
                return
            if outcome is None:
                self._set(g, state="done", reason="finished")
                self._release(g)
                return
            self._release(g)
            if restarts >= self.plan.max_restarts:
                limit = f"max_restarts={self.plan.max_restarts} reached"
                self._set(g, state="failed", reason=f"{outcome}; not restarted: {limit}")
                log.error("%s failed: %s", g.name, outcome)
                return
            restarts += 1
            self._set(g, state="restarting", reason=outcome, restarts=restarts, url=None)
            log.warning("%s: %s; restarting it (%d)", g.name, outcome, restarts)
            if self.stopping.wait(self.plan.restart_delay_s):
                return

    def _wait_for_fleet(self, g: Group) -> None:
        """Serves and the trainer start once the router runs with an engine behind it (they
        check the router when they start, and would only fail and be restarted meanwhile)."""
        if g.kind not in ("serve", "train"):
            return
        engines = [n for e in self.plan.group("engine") for n in e.process_names()]
        while not self._fleet_up(engines):
            self._set(g, state="pending", waiting="waiting for the router and an engine")
            if self.stopping.wait(POLL_S):
                raise Stopping

    def _fleet_up(self, engines: list[str]) -> bool:
        with self.lock:
            up = {s.name for ss in self.status_of.values() for s in ss if s.state == "running"}
        return "router" in up and (not engines or bool(up & set(engines)))

    def _place(self, g: Group) -> Placed:
        """Actors holding the group's resources, on the nodes Ray chose (pending: waits)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        self._set(g, state="pending", node="", node_id="", pid=None, waiting="")
        options: dict[str, Any] = {**g.resources.ray_options(), "max_restarts": 0}
        pg = None
        if g.ranks > 1:
            pg = placement_group([g.resources.bundle()] * g.ranks, strategy=g.strategy,
                                 name=f"agent-rl:{self.plan.run}:{g.name}")  # fmt: skip
            self._wait_ref(g, pg.ready(), f"waiting for {g.ranks} x {g.resources.bundle()}")
        strategies: list[Any]
        if pg is not None:
            strategies = [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)
                          for r in range(g.ranks)]  # fmt: skip
        elif g.kind == "router":  # its address must not move: the supervisor's node
            strategies = [NodeAffinitySchedulingStrategy(self.node_id, soft=False)]
        else:
            strategies = ["DEFAULT"]
        names = g.process_names()
        actors = [self.role_actor.options(**options, scheduling_strategy=s).remote(
                      name, self.plan.cwd, str(Path(self.plan.log_dir) / f"{name}.log"))
                  for name, s in zip(names, strategies, strict=True)]  # fmt: skip
        placed = Placed(actors, [], pg)
        self.placed[g.name] = placed
        placed.where = [self._wait_ref(g, a.where.remote(), f"waiting for {g.resources.bundle()}")
                        for a in actors]  # fmt: skip
        return placed

    def _start(self, g: Group, placed: Placed) -> None:
        import ray

        first = placed.actors[0]
        if g.kind == "router":
            port = self.router_port
        else:
            port = self._wait_ref(g, first.free_port.remote(), "starting")
        host = placed.where[0]["ip"] if g.kind != "router" else (self.plan.router_host or self.ip)
        args = fill(g.args, {"host": host, "port": str(port), "router_url": self.router_url})
        envs = [dict(self.plan.env) for _ in placed.actors]
        if g.ranks > 1:  # torchrun's variables; the rendezvous is at rank 0's node
            nodes = [w["node_id"] for w in placed.where]
            for rank, env in enumerate(envs):
                env.update(RANK=str(rank), WORLD_SIZE=str(g.ranks),
                           LOCAL_RANK=str(nodes[:rank].count(nodes[rank])),
                           LOCAL_WORLD_SIZE=str(nodes.count(nodes[rank])),
                           MASTER_ADDR=placed.where[0]["ip"], MASTER_PORT=str(port))  # fmt: skip
        pids = ray.get([a.start.remote(args, env)
                        for a, env in zip(placed.actors, envs, strict=True)])  # fmt: skip
        placed.waits = [a.wait.remote() for a in placed.actors]
        placed.pids = pids
        url = f"http://{host}:{port}" if g.kind in ("router", "engine") else None
        with self.lock:
            for s, w, pid in zip(self.status_of[g.name], placed.where, pids, strict=True):
                s.node, s.node_id, s.pid, s.starts = w["ip"], w["node_id"], pid, s.starts + 1
                s.waiting = ""
                s.state = "starting" if url else "running"
                s.url = url if g.kind == "router" else None
        if url:
            self._wait_ready(g, placed, url)

    def _wait_ready(self, g: Group, placed: Placed, url: str) -> None:
        """Until the server answers (engines: /health; the router: GET /workers)."""
        import ray

        path, headers = "/health", {}
        if g.kind == "router":
            path, headers = "/workers", {"Authorization": f"Bearer {self.plan.admin_token}"}
        deadline = time.monotonic() + self.plan.ready_timeout_s
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.stopping.is_set():
                    raise Stopping
                done, _ = ray.wait(placed.waits, timeout=0)
                if done:
                    return  # it ended before answering: _watch says how
                try:
                    if client.get(url + path, headers=headers).status_code == 200:
                        self._set(g, state="running", url=url)
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(POLL_S)
        raise TimeoutError(f"{url} did not answer within {self.plan.ready_timeout_s:.0f}s")

    def _watch(self, g: Group, placed: Placed) -> str | None:
        """Wait for the first process of the group to end; None if the group finished cleanly,
        else why it must be restarted (the rest of a gang is stopped first)."""
        import ray

        done: list[Any] = []
        while not done:
            done, _ = ray.wait(placed.waits, timeout=POLL_S)
        index = placed.waits.index(done[0])
        reason = self._ending(placed, index)
        if g.ranks > 1 and reason is not None and "lost" not in reason:
            # A rank that dies takes its peers' collectives down with it: the cause is the rank
            # whose node was lost, if one was, not the first to notice.
            settled, _ = ray.wait(placed.waits, num_returns=len(placed.waits),
                                  timeout=GANG_SETTLE_S)
            for ref in settled:
                other = self._ending(placed, placed.waits.index(ref))
                if other is not None and "lost" in other:
                    index, reason = placed.waits.index(ref), other
                    break
        name = g.process_names()[index]
        if reason is None and g.done_on_success:
            # One rank finished: the others finish the same last step.
            for ref in placed.waits:
                try:
                    if ray.get(ref, timeout=g.stop_grace_s + 60) != 0:
                        break
                except Exception:  # noqa: BLE001
                    break
            else:
                return None
        if self.stopping.is_set():
            raise Stopping
        what = reason or "exited cleanly"
        return f"{name} {what}" if g.ranks > 1 else what

    def _ending(self, placed: Placed, index: int) -> str | None:
        """Why process `index` ended (None: exit status 0)."""
        import ray

        try:
            code = ray.get(placed.waits[index])
        except Exception as e:  # noqa: BLE001 - its actor is gone: was its node lost?
            where = placed.where[index]
            # The actor's death can reach us before Ray's health checks declare its node dead
            # (this node, the supervisor's, is alive: no need to wait for it).
            deadline = time.monotonic() + NODE_DEATH_WAIT_S
            while where["node_id"] != self.node_id and time.monotonic() < deadline \
                    and not self.stopping.is_set():  # fmt: skip
                alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
                if not alive.get(where["node_id"], False):
                    return f"node {where['ip']} ({where['node_id'][:8]}) lost"
                time.sleep(POLL_S)
            if index < len(placed.pids):
                self._kill_orphan(where["node_id"], placed.pids[index])
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return f"its Ray actor died ({first[:160]})"
        if code == 0:
            return None
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit status {code}"

    def _kill_orphan(self, node_id: str, pid: int) -> None:
        """The role process `pid` outlived its actor on a node that is up: kill it and what it
        started there (a task on that node), before its role is placed again."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        try:
            ref = ray.remote(num_cpus=0, max_retries=0)(kill_orphan).options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(pid)
            if ray.get(ref, timeout=30):
                log.warning("killed role process %d, whose actor had died", pid)
        except Exception as e:  # noqa: BLE001 - its node went away meanwhile: so did it
            log.warning("could not reach the node of role process %d: %s", pid, e)

    def _release(self, g: Group) -> None:
        """Stop what is left of the group and give its resources back."""
        import ray
        from ray.util.placement_group import remove_placement_group

        placed = self.placed.pop(g.name, None)
        if placed is None:
            return
        for a in placed.actors:
            try:
                ray.get(a.stop.remote(signal.SIGKILL, 0.0), timeout=30)
            except Exception:  # noqa: BLE001 - gone with its node
                pass
            ray.kill(a)
        if placed.pg is not None:
            remove_placement_group(placed.pg)

    def _wait_ref(self, g: Group, ref: Any, pending: str) -> Any:
        """ray.get(ref), showing `pending` meanwhile; Stopping when the launch stops."""
        import ray

        while True:
            done, _ = ray.wait([ref], timeout=POLL_S)
            if done:
                return ray.get(ref)
            if self.stopping.is_set():
                raise Stopping
            with self.lock:
                for s in self.status_of[g.name]:
                    s.waiting = pending

    def _set(self, g: Group, **values: Any) -> None:
        with self.lock:
            for s in self.status_of[g.name]:
                for k, v in values.items():
                    setattr(s, k, v)

    # ----- engines join the router -----------------------------------------------------------

    def _sync_router(self) -> None:
        """Keep the router's workers equal to the engines that answer (every POLL_S x 2)."""
        headers = {"Authorization": f"Bearer {self.plan.admin_token}"}
        with httpx.Client(timeout=10.0, headers=headers) as client:
            while not self.stopping.wait(POLL_S * 2):
                with self.lock:
                    router_up = any(s.state == "running" for s in self.status_of.get("router", []))
                    engines = [s for g in self.plan.group("engine") for s in self.status_of[g.name]]
                    wanted = {s.url for s in engines if s.state == "running" and s.url}
                if not router_up:
                    continue
                try:
                    listed = client.get(self.router_url + "/workers").json()["workers"]
                    have = {w["url"] for w in listed}
                    for url in sorted(wanted - have):
                        # The router gives an engine that joins late the newest weights first.
                        added = client.post(self.router_url + "/workers", json={"url": url},
                                            timeout=120.0)
                        added.raise_for_status()
                        log.info("engine %s joined the router", url)
                    for url in sorted((have - wanted) & self.managed_urls):
                        client.request("DELETE", self.router_url + "/workers", params={"url": url})
                        log.info("engine %s left the router", url)
                    self.managed_urls |= wanted
                except (httpx.HTTPError, KeyError, ValueError) as e:
                    log.warning("router sync: %s", e)
