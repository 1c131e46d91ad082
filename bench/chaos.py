"""Chaos run: `agent-rl quickstart --cluster`'s RL stage on Ray, with each role SIGKILLed in
turn and then a Ray node lost.

The fleet is the one `agent-rl quickstart --cluster` runs: a PostgreSQL store (a fresh database
made for this run and dropped after), two SGLang engines behind `agent-rl router`, two `agent-rl
serve` processes and one `agent-rl train`, each a role that `agent-rl launch` placed on a local
Ray cluster (`ray.cluster_utils.Cluster`: a head with the router and the launch's supervisor,
and two nodes with an engine each). After a short SFT warm start, RL runs; once the trainer has
published a version, serve-0, the router, engine-1 and the trainer are SIGKILLed one at a time
(each with everything it started), then a spare node joins and the node of engine-0 is lost with
every process on it (its raylet included, Ray told nothing). The launch restarts each role, or
places it again on the nodes left, and the next kill waits until training has moved on, except
the trainer's: it is killed while engine-1 starts again (a cold engine start is most of a kill's
recovery, and the other engine serves meanwhile), and the node goes once engine-1 serves again.
Recovery is polled for (roles running again, versions, the engine's weights), never slept for.
serve-0 is killed once it runs episodes of its own (polled for in the store), and the router's
kill waits until a live serve has resumed and ended them (a killed router fails the generations
in flight, theirs too).
Then RL is stopped as the quickstart stops it (serves drain, the trainer checkpoints) and the
store is audited.

Resumption: the episodes serve-0 was running when it was killed are resumed by a live serve
(re-running their stored turns, then generating on) instead of failing; `resumed` is the share of
them that were resumed and ended with a reward, their tokens from before the kill unchanged. The
same is measured for python-math (tools in a bubblewrap sandbox) by a separate serve of that
env, SIGKILLed as soon as one of its running episodes has a persisted turn (it admits episodes
until then, so it cannot run out of them first) and then started again (`resume_after_kill`),
while RL reaches its first versions; the kills start once it is done.

Pass: 0 episodes lost, 0 trained twice, every episode in exactly one terminal state with its
cause (failed episodes are reported by the kill they followed and their cause), after every
kill the policy version advanced, and at least RESUMED_TARGET of the killed serves' episodes
were resumed.

Run: `python bench/chaos.py [--store-url postgresql://...] [--workdir DIR]` (needs `agent-rl
engine install`, agent-rl[cluster] and a PostgreSQL server; default URL:
$AGENT_RL_TEST_POSTGRES_URL or postgres@127.0.0.1:5432/test; --workdir keeps the run's directory
and role logs). Last line: RESULT {"lost", "trained_twice", "not_terminal",
"failed_without_cause", "kills", "versions", "episodes", "failed_by_cause", "resumed", "passed"}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio  # noqa: E402
import psycopg  # noqa: E402
import tomli_w  # noqa: E402
from rich.console import Console  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from agent_rl.app.quickstart import Options  # noqa: E402
from agent_rl.app.quickstart.pipeline import Quickstart  # noqa: E402
from agent_rl.config import Config, load_config  # noqa: E402
from agent_rl.kernel.processes import alive, signal_tree  # noqa: E402
from agent_rl.store import Store  # noqa: E402
from agent_rl.testing.ray_cluster import local_cluster, lose_node  # noqa: E402

NODE = "node of engine-0"
VICTIMS = ["serve-0", "router", "engine-1", "train", NODE]
"""Roles SIGKILLed in turn, then a Ray node lost with the roles on it."""
OVERLAPPED = {"engine-1"}
"""Victims killed without waiting for their recovery before the next kill: a cold engine start
is most of a kill's recovery, and training goes on on the other engine meanwhile (the node of
that engine is lost only once the killed one serves again)."""
ENGINE_NODE = {"num_cpus": 1, "resources": {"accel": 1}}
"""A node of the local Ray cluster that one engine (its `accel`) is placed on."""
RECOVERY_TIMEOUT_S = 300.0
SERVE_BUSY_TIMEOUT_S = 60.0
"""How long a serve may run no episode of its own before it is to be killed (then: an error)."""
RESUME_WINDOW_S = 180.0
"""How long python-math's serve may run no episode with a persisted turn (one past a tool call:
a turn is persisted while the next one generates) before it is to be killed (then: an error)."""
RESUMED_TARGET = 0.9


async def running_of(store: Store, run_id: int, pid: int, tokens: bool = True) -> dict[int, Any]:
    """The episodes process `pid` was running (serve owners carry their pid) and their tokens
    (None each without `tokens`)."""
    running = await _running(store, run_id, pid)
    return {e.id: await store.episode_tokens(e.id) if tokens else None for e in running}


async def _running(store: Store, run_id: int, pid: int) -> list[Any]:
    return [e for e in await store.list_episodes(run_id=run_id, status="running", limit=100_000)
            if e.owner is not None and f"-{pid}-" in e.owner]


async def kill_when_running(store: Store, run_id: int, pid: int, what: str, *,
                            with_turns: int = 0, timeout_s: float = SERVE_BUSY_TIMEOUT_S,
                            still_running: Callable[[], bool] | None = None,
                            ) -> dict[int, Any]:  # fmt: skip
    """SIGKILL serve process `pid` (with everything it started) as soon as it runs episodes of
    run `run_id`, `with_turns` of them with a persisted turn (0: any), so that there is
    something to resume; returns the episodes it was running, with their tokens at the kill.
    Polls the store (the one given, for the whole wait). TimeoutError, the process not
    killed, after `timeout_s` without, or once `still_running()` is false (it ended by itself)."""
    started = time.monotonic()
    deadline = started + timeout_s
    most = 0
    while True:
        running = await _running(store, run_id, pid)
        with_turn = sum(e.num_turns >= 1 for e in running)
        most = max(most, with_turn)
        if running and with_turn >= with_turns:
            break
        ended = still_running is not None and not still_running()
        if ended or time.monotonic() > deadline:
            wanted = ("an episode" if not with_turns else
                      "a running episode with a persisted turn" if with_turns == 1 else
                      f"{with_turns} running episodes with a persisted turn at once (at most "
                      f"{most})")  # fmt: skip
            why = "ended by itself" if ended else "was not killed"
            raise TimeoutError(f"{what} (pid {pid}) {why}: in {time.monotonic() - started:.0f}s "
                               f"it never ran {wanted}")
        await anyio.sleep(0.05)
    signal_tree(pid, signal.SIGKILL)
    await _gone(pid)  # nothing more of it lands after the tokens read below
    return await running_of(store, run_id, pid)


async def _gone(pid: int, timeout_s: float = 10.0) -> None:
    """Wait until process `pid` has ended (exited, or a zombie its parent has yet to reap)."""
    import psutil

    try:
        process = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    deadline = time.monotonic() + timeout_s
    while alive(process):
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {pid} still ran {timeout_s:.0f}s after its SIGKILL")
        await anyio.sleep(0.01)


async def resumed_share(store: Store, before: dict[int, Any]) -> dict[str, Any]:
    """Of the episodes a killed serve was running: the share resumed and ended with a reward,
    each one's tokens from before the kill unchanged."""
    import numpy as np

    ok = 0
    changed = []
    for eid, old in before.items():
        e = (await store.episodes_by_id([eid]))[0]
        now = await store.episode_tokens(eid)
        n = len(old)
        same = len(now) >= n and all(
            np.array_equal(getattr(now, f)[:n], getattr(old, f))
            for f in ("token_ids", "logprobs", "loss_mask", "versions"))
        if not same:
            changed.append(eid)
        ok += e.resumes >= 1 and e.status in ("completed", "trained", "filtered") and same
    return {"episodes": len(before), "with_turns": sum(len(t) > 0 for t in before.values()),
            "resumed": ok, "share": ok / len(before) if before else None,
            "tokens_changed": changed}


async def resume_after_kill(qs: Quickstart, env_id: str, router_url: str,
                            episodes: int = 24) -> dict[str, Any]:  # fmt: skip
    """A serve of `env_id` (its own run, on the launch's router) SIGKILLed as soon as one of its
    running episodes has a persisted turn, then a serve of `episodes` started again: how many of
    the killed serve's episodes were resumed. The first serve admits episodes until it is
    killed, so the window cannot close before the kill (a bounded one could end all of its
    episodes first, e.g. under load); a run in which none had a persisted turn within
    RESUME_WINDOW_S says so in `error` (and fails the bench), never passing unmeasured."""
    import subprocess

    from agent_rl.app.quickstart.processes import agent_rl_command

    run = f"resume-{env_id}"
    workdir = qs.workdir / run
    workdir.mkdir(exist_ok=True)
    engine = qs.cfg.engine.model
    (workdir / "agent-rl.toml").write_text(tomli_w.dumps({
        "run": {"name": run}, "store": {"url": qs.cfg.store.url},
        "engine": {"model": str(qs.workdir / engine if engine else "")},
        # No trainer takes this run's groups: no admission bound waits for one.
        "rollout": {"env": env_id, "group_size": 8, "max_concurrent_episodes": 16,
                    "max_new_tokens": 96, "max_tokens": 1024, "heartbeat_s": 0.5,
                    "stale_after_s": 3.0, "max_queued_groups": 0},
    }))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_RL_")}
    serve = agent_rl_command("serve", "--router-url", router_url, "--no-api")
    log = open(workdir / "serve.log", "ab")  # noqa: SIM115 (closed below)
    # A session of its own: the kill takes its sandboxes with it, as a role's does.
    first = subprocess.Popen(serve, cwd=workdir, env=env, stdout=log, stderr=log,
                             start_new_session=True)
    before: dict[int, Any] = {}
    error = None
    try:
        deadline = time.monotonic() + RESUME_WINDOW_S
        async with await Store.open(qs.cfg.store) as store:
            run_id = None
            while run_id is None and first.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(Exception):  # not made by the serve yet
                    run_id = await store.run_id(run)
                await anyio.sleep(0.05)
            if run_id is None:
                raise TimeoutError(f"{env_id}'s serve (pid {first.pid}) made no run "
                                   f"in {RESUME_WINDOW_S:.0f}s")
            try:
                before = await kill_when_running(
                    store, run_id, first.pid, f"{env_id}'s serve", with_turns=1,
                    timeout_s=max(deadline - time.monotonic(), 0.0),
                    still_running=lambda: first.poll() is None)
            except TimeoutError as e:
                ended = [x for x in await store.list_episodes(run_id=run_id, limit=100_000)
                         if x.status != "running"]
                raise TimeoutError(f"{e} ({len(ended)} of its episodes ended meanwhile, "
                                   f"{sum(x.num_turns > 1 for x in ended)} of them after more "
                                   "than one turn)") from None
        qs.say(f"chaos: SIGKILL {env_id}'s serve (pid {first.pid}) with {len(before)} "
               "episodes running")
    except TimeoutError as e:
        error = str(e)
    finally:
        if first.poll() is None:
            signal_tree(first.pid, signal.SIGKILL)
        first.wait()
    if error is not None:
        log.close()
        tail = (workdir / "serve.log").read_text(errors="replace")[-1500:]
        return {"episodes": 0, "resumed": 0, "share": None, "tokens_changed": [],
                "error": f"{error}; its log ends: {tail}"}
    # No wait for its heartbeats to age past stale_after_s: the new serve's heartbeat loop
    # resumes them once they have, while it runs episodes of its own.
    second = subprocess.Popen(serve + ["--max-episodes", str(episodes)], cwd=workdir, env=env,
                              stdout=log, stderr=log)
    await anyio.to_thread.run_sync(lambda: second.wait(300))
    log.close()
    async with await Store.open(qs.cfg.store) as store:
        run_id = await store.run_id(run)
        share = await resumed_share(store, before)
        share["audit_problems"] = (await store.audit(run_id)).problems()
    return share


def fresh_database(base_url: str) -> tuple[str, str]:
    """Create an empty database next to `base_url`'s; returns (its URL, its name)."""
    name = f"agent_rl_chaos_{os.getpid()}_{int(time.time())}"
    url = make_url(base_url)
    with psycopg.connect(url.set(drivername="postgresql").render_as_string(hide_password=False),
                         autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return url.set(database=name).render_as_string(hide_password=False), name


def drop_database(base_url: str, name: str) -> None:
    url = make_url(base_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def latest(qs: Quickstart) -> int:
    async with await Store.open(qs.cfg.store) as store:
        return await store.latest_version(await store.ensure_run(qs.cfg.run.name))


async def wait_version(qs: Quickstart, above: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        v = await latest(qs)
        if v > above:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"policy version stayed at {v} for {timeout_s:.0f}s")
        await anyio.sleep(1.0)


async def engine_current(router_url: str, url: str, floor: int) -> float:
    """When the engine at `url` itself serves a policy version >= floor and the router has it in
    rotation (monotonic time). The engine is asked directly: until the router's health checks
    quarantine a dead engine, the router still lists the version it last saw there."""
    from agent_rl.sglang.client import EngineClient

    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    async with EngineClient(url) as engine, EngineClient(router_url) as router:
        while time.monotonic() < deadline:
            own = (await engine.served_versions()).get(url)
            in_rotation = url in await router.served_versions()
            if own is not None and own.isdigit() and int(own) >= floor and in_rotation:
                return time.monotonic()
            await anyio.sleep(1.0)
    raise TimeoutError(f"{url} did not come back on current weights")


async def roles(cfg: Config) -> dict[str, dict[str, Any]]:
    """The launch's roles by name (`agent-rl launch status`)."""
    from agent_rl.cluster import launch as cluster

    return {s["name"]: s for s in await anyio.to_thread.run_sync(cluster.status, cfg)}


async def launched(qs: Quickstart) -> Config:
    """The launch's config, once the RL stage wrote it and its router runs."""
    from agent_rl.app.quickstart.on_ray import RAY_CONFIG

    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while time.monotonic() < deadline:
        if (qs.workdir / RAY_CONFIG).is_file():
            cfg = load_config(qs.workdir / RAY_CONFIG)
            try:
                if (await roles(cfg))["router"]["state"] == "running":
                    return cfg
            except Exception:  # noqa: BLE001 - not launched yet
                pass
        await anyio.sleep(1.0)
    raise TimeoutError("the RL stage's launch did not start")


async def chaos(qs: Quickstart, c: Any, kills: list[dict[str, Any]],
                resumed: dict[str, Any], rl: anyio.CancelScope) -> None:  # fmt: skip
    """Kill a python-math serve of its own, then each victim once training has moved on since
    the previous kill (engine-1's restart overlaps the trainer's kill); then stop RL as the
    quickstart does (also when recovery timed out: the run is still audited, and the failure
    is in `kills`)."""
    try:
        cfg = await launched(qs)
        router_url = (await roles(cfg))["router"]["url"]

        measured = anyio.Event()

        async def python_math() -> None:
            try:
                resumed["python-math"] = await resume_after_kill(qs, "python-math", router_url)
            finally:
                measured.set()

        # Beside the wait for RL's first versions (it shares the launch's engines): the run
        # stays within its minutes. The kills wait for it: a killed router or engine fails the
        # generations of every serve, which would fail the episodes it resumed.
        async with anyio.create_task_group() as tg:
            tg.start_soon(python_math)
            await measured.wait()
            await _kill_each(qs, cfg, c, kills, resumed)
    except* TimeoutError as timeouts:  # (from a task group: in an exception group)
        kills.append({"error": "; ".join(str(e) for e in timeouts.exceptions)})
    qs.say("chaos: done; stopping RL as the quickstart does (serves drain, the trainer checkpoints)")
    rl.cancel()


async def kill_role(qs: Quickstart, cfg: Config, name: str,
                    resumed: dict[str, Any]) -> dict[str, int]:  # fmt: skip
    """SIGKILL role `name`'s process and everything it started (a serve: once it runs episodes,
    so that there is something to resume); {name: its starts}."""
    role = (await roles(cfg))[name]
    if not name.startswith("serve-"):
        signal_tree(role["pid"], signal.SIGKILL)
        qs.say(f"chaos: SIGKILL {name} (pid {role['pid']})")
        return {name: role["starts"]}
    async with await Store.open(qs.cfg.store) as store:
        run_id = await store.ensure_run(qs.cfg.run.name)
        # Admission under the staleness bound can leave one serve idle for a while (the other
        # took the groups the bound allowed): wait for episodes of its own.
        resumed["_calculator_before"] = await kill_when_running(
            store, run_id, role["pid"], name, timeout_s=SERVE_BUSY_TIMEOUT_S)
        qs.say(f"chaos: SIGKILL {name} (pid {role['pid']})")
    return {name: role["starts"]}


async def lose_node_of(qs: Quickstart, cfg: Config, c: Any, name: str) -> dict[str, int]:
    """A spare node joins, then the node of role `name` is lost with every role on it; their
    {name: starts}."""
    now = await roles(cfg)
    node_id = now[name]["node_id"]
    victim = next(n for n in c.worker_nodes if n.node_id == node_id)
    c.add_node(**ENGINE_NODE)  # (Ray starts nodes from the main thread only)
    on_it = {n: s["starts"] for n, s in now.items() if s["node_id"] == node_id}
    lose_node(c, victim)
    qs.say(f"chaos: lost the Ray node of {', '.join(on_it)} ({node_id[:8]})")
    return on_it


async def _kill_each(qs: Quickstart, cfg: Config, c: Any, kills: list[dict[str, Any]],
                     resumed: dict[str, Any]) -> None:  # fmt: skip
    await wait_version(qs, 1, RECOVERY_TIMEOUT_S)
    done: dict[str, dict[str, Any]] = {}
    try:
        async with anyio.create_task_group() as tg:
            for victim in VICTIMS[:-1]:
                before, t0 = await latest(qs), time.monotonic()
                starts = await kill_role(qs, cfg, victim, resumed)
                if victim in OVERLAPPED:
                    tg.start_soon(_record, qs, cfg, victim, starts, before, t0, done)
                else:
                    await _record(qs, cfg, victim, starts, before, t0, done)
                if victim.startswith("serve-"):
                    # Its episodes are resumed by a live serve; the next kill (the router's)
                    # would fail their generations: it waits until they have ended.
                    ended = await episodes_ended(qs, resumed.get("_calculator_before", {}))
                    done[victim]["episodes_ended_after_s"] = round(ended - t0, 1)
        # The node's engine is the other one: it goes once the killed engine serves again.
        before, t0 = await latest(qs), time.monotonic()
        starts = await lose_node_of(qs, cfg, c, "engine-0")
        await _record(qs, cfg, NODE, starts, before, t0, done)
    finally:
        kills.extend(done[v] for v in VICTIMS if v in done)
    await wait_version(qs, await latest(qs), RECOVERY_TIMEOUT_S)


async def episodes_ended(qs: Quickstart, episodes: dict[int, Any]) -> float:
    """When none of `episodes` is running any more (monotonic time)."""
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    async with await Store.open(qs.cfg.store) as store:
        while any(e.status == "running" for e in await store.episodes_by_id(list(episodes))):
            if time.monotonic() > deadline:
                raise TimeoutError("the killed serve's episodes still ran "
                                   f"{RECOVERY_TIMEOUT_S:.0f}s on")
            await anyio.sleep(0.5)
    return time.monotonic()


async def _record(qs: Quickstart, cfg: Config, victim: str, starts: dict[str, int], before: int,
                  t0: float, done: dict[str, dict[str, Any]]) -> None:  # fmt: skip
    """Poll until the victim's roles run again (started once more), training has moved on past
    `before`, and a killed engine serves current weights in the router's rotation; the times
    since the kill at `t0` in `done[victim]`."""
    deadline = t0 + RECOVERY_TIMEOUT_S
    while not all(r["state"] == "running" and r["starts"] > starts[n]
                  for n, r in (await roles(cfg)).items() if n in starts):  # fmt: skip
        if time.monotonic() > deadline:
            raise TimeoutError(f"{', '.join(starts)} not running again after the kill")
        await anyio.sleep(0.5)
    restarted_s = time.monotonic() - t0
    # Training continued: two new versions, so at least one step ran wholly after the kill.
    after = await wait_version(qs, before + 1, RECOVERY_TIMEOUT_S)
    now = await roles(cfg)
    kill = {"victim": victim, "at": time.time() - (time.monotonic() - t0),
            "roles": sorted(starts), "version_at_kill": before,
            "reasons": {n: now[n]["reason"] for n in starts},
            "restarted_after_s": round(restarted_s, 1), "version_after": after,
            "recovered_after_s": round(time.monotonic() - t0, 1)}
    for name in (n for n in starts if n.startswith("engine-")):
        # Back in rotation, on current weights (it restarted on its launch weights).
        current = await engine_current(now["router"]["url"], now[name]["url"], before)
        kill["engine_serving_current_after_s"] = round(current - t0, 1)
    done[victim] = kill
    qs.say(f"chaos: {victim} restarted; training reached version {after} "
           f"{kill['recovered_after_s']:.0f}s after the kill"
           + (f", the engine served current weights after {current_s:.0f}s"
              if (current_s := kill.get("engine_serving_current_after_s")) else ""))


async def main(store_url: str, sft_steps: int, workdir: Path | None) -> dict[str, Any]:
    import ray

    console = Console()
    url, dbname = fresh_database(store_url)
    # Every group trains (no zero-variance filter): the run keeps stepping from any warm start.
    os.environ["AGENT_RL_ROLLOUT__FILTER_ZERO_VARIANCE"] = "false"
    # A killed serve's episodes are resumed once their heartbeats are this old.
    os.environ["AGENT_RL_ROLLOUT__STALE_AFTER_S"] = "6"
    kills: list[dict[str, Any]] = []
    resumed: dict[str, Any] = {}
    c = None
    try:
        with (contextlib.nullcontext(str(workdir)) if workdir is not None
              else tempfile.TemporaryDirectory(prefix="agent-rl-chaos-")) as tmp:
            opts = Options(cluster=True, store_url=url, sft_steps=sft_steps, rl_steps=10_000,
                           rl_minutes=30, eval_tasks=2, eval_samples=1)
            qs = Quickstart(opts, Path(tmp), console)
            t0 = time.monotonic()
            async with qs.running():
                await qs.sft_stage()
                # The RL stage's launch goes on this cluster (on_ray.py uses the one connected):
                # a head (the router, the launch's supervisor) and two nodes of an engine each.
                # (Ray starts nodes from the main thread only: the event loop waits meanwhile.)
                c, _ = local_cluster(2, [ENGINE_NODE, ENGINE_NODE], "agent-rl-chaos")
                async with anyio.create_task_group() as rl:
                    rl.start_soon(chaos, qs, c, kills, resumed, rl.cancel_scope)
                    await qs.rl_stage()
            async with await Store.open(qs.cfg.store) as store:
                run_id = await store.ensure_run(qs.cfg.run.name)
                await store.resolve_interrupted(stale_after_s=0.0, run_id=run_id)
                audit = await store.audit(run_id)
                episodes = await store.list_episodes(run_id=run_id, limit=1_000_000)
                versions = await store.latest_version(run_id)
                resumed["calculator"] = await resumed_share(
                    store, resumed.pop("_calculator_before", {}))
            os.chdir(Path(__file__).resolve().parents[1])
    finally:
        if c is not None:
            ray.shutdown()
            c.shutdown()
        drop_database(store_url, dbname)
    failed_by_cause = Counter(_failure_key(e, kills) for e in episodes if e.status == "failed")
    ok_recovery = len(kills) == len(VICTIMS) and all(
        "error" not in k and k["version_after"] > k["version_at_kill"] for k in kills)
    ok_resumed = all((r.get("share") or 0.0) >= RESUMED_TARGET and not r["tokens_changed"]
                     for r in resumed.values()) and len(resumed) == 2
    return {
        "lost": audit.lost,
        "trained_twice": audit.trained_twice,
        "not_terminal": audit.not_terminal,
        "failed_without_cause": audit.failed_without_cause,
        "audit_problems": audit.problems(),
        "kills": kills,
        "versions": versions,
        "episodes": audit.ledger.as_dict(),
        "failed_by_cause": dict(failed_by_cause),
        "resumed": resumed,
        "wall_s": round(time.monotonic() - t0, 1),
        "load": Path("/proc/loadavg").read_text().split()[:3],
        "passed": not audit.problems() and ok_recovery and ok_resumed,
    }


def _failure_key(episode: Any, kills: list[dict[str, Any]]) -> str:
    """`after VICTIMS: TYPE: CAUSE`: the last kill before the episode failed (with any other
    made within a second of it: the trainer's goes with engine-1's), and enough of its cause
    (the addresses it names left out) to tell the router's 502 (a worker failed after the
    request was sent) from its other answers and from an unreachable router."""
    before = sorted((k for k in kills if "at" in k and k["at"] <= (episode.finished_at or 0.0)),
                    key=lambda k: k["at"])
    victims = " + ".join(k["victim"] for k in before if before[-1]["at"] - k["at"] < 1.0)
    cause = re.sub(r"https?://[^\s:/]+:\d+", "URL", episode.error_cause or "")
    return f"after {victims or 'no kill'}: {episode.error_type}: {cause[:150]}"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store-url", default=os.environ.get(
        "AGENT_RL_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"))
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--workdir", type=Path, help="the run's directory, kept afterwards (its "
                    "role logs in runs/ray/logs); default: a temporary one")
    args = ap.parse_args()
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=False)
    result = anyio.run(main, args.store_url, args.sft_steps, args.workdir)
    print("RESULT " + json.dumps(result))
