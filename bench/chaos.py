"""Chaos run: the quickstart's multi-process mode, with each process SIGKILLed in turn.

The fleet is the one `agent-rl quickstart --cluster` runs: a PostgreSQL store (a fresh database
made for this run and dropped after), two SGLang engines behind a standalone `agent-rl router`,
two `agent-rl serve` processes and one `agent-rl train`, each a separate OS process under the
quickstart's supervisor. After a short SFT warm start, RL runs; once the trainer has published a
few versions, serve-0, the router, engine-1 and the trainer are SIGKILLed one at a time (their
whole process groups), the supervisor starts each again, and the next kill waits until training
has moved on. Then RL is stopped as the quickstart stops it and the store is audited.

Resumption: the episodes serve-0 was running when it was killed are resumed by a live serve
(re-running their stored turns, then generating on) instead of failing; `resumed` is the share of
them that were resumed and ended with a reward, their tokens from before the kill unchanged. The
same is measured for python-math (tools in a bubblewrap sandbox) by a separate serve of that
env, SIGKILLed while its episodes run and then started again (`resume_after_kill`).

Pass: 0 episodes lost, 0 trained twice, every episode in exactly one terminal state with its
cause (failed episodes by cause are reported), after every kill the policy version advanced,
and at least RESUMED_TARGET of the killed serves' episodes were resumed.

Run: `python bench/chaos.py [--store-url postgresql://...]` (needs `agent-rl engine install` and a
PostgreSQL server; default URL: $AGENT_RL_TEST_POSTGRES_URL or postgres@127.0.0.1:5432/test; about
4-5 minutes on 2 cores). Last line: RESULT {"lost", "trained_twice", "not_terminal",
"failed_without_cause", "kills", "versions", "episodes", "failed_by_cause", "resumed", "passed"}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
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
from agent_rl.app.quickstart.processes import Supervisor  # noqa: E402
from agent_rl.store import Store  # noqa: E402

VICTIMS = ["serve-0", "router", "engine-1", "train"]
RECOVERY_TIMEOUT_S = 300.0
RESUMED_TARGET = 0.9


async def running_of(store: Store, run_id: int, pid: int) -> dict[int, Any]:
    """The episodes process `pid` was running (serve owners carry their pid) and their tokens."""
    running = [e for e in await store.list_episodes(run_id=run_id, status="running", limit=100_000)
               if e.owner is not None and f"-{pid}-" in e.owner]
    return {e.id: await store.episode_tokens(e.id) for e in running}


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
    return {"episodes": len(before), "resumed": ok, "share": ok / len(before) if before else None,
            "tokens_changed": changed}


async def resume_after_kill(qs: Quickstart, env_id: str, episodes: int = 48) -> dict[str, Any]:
    """A serve of `env_id` (its own run, on the fleet's router) SIGKILLed once several episodes
    have persisted turns, then started again: how many of its episodes were resumed."""
    import signal
    import subprocess

    from agent_rl.app.quickstart.processes import agent_rl_command

    assert qs.fleet is not None
    run = f"resume-{env_id}"
    workdir = qs.workdir / run
    workdir.mkdir(exist_ok=True)
    engine = qs.cfg.engine.model
    (workdir / "agent-rl.toml").write_text(tomli_w.dumps({
        "run": {"name": run}, "store": {"url": qs.cfg.store.url},
        "engine": {"model": str(qs.workdir / engine if engine else "")},
        "rollout": {"env": env_id, "group_size": 8, "max_concurrent_episodes": 16,
                    "max_new_tokens": 96, "max_tokens": 1024, "heartbeat_s": 0.5,
                    "stale_after_s": 3.0},
    }))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_RL_")}
    argv = agent_rl_command("serve", "--router-url", qs.fleet.router_url, "--no-api",
                            "--max-episodes", str(episodes))
    log = open(workdir / "serve.log", "ab")  # noqa: SIM115 (closed below)
    first = subprocess.Popen(argv, cwd=workdir, env=env, stdout=log, stderr=log)
    before: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and first.poll() is None:
            await anyio.sleep(0.05)
            async with await Store.open(qs.cfg.store) as store:
                try:
                    run_id = await store.run_id(run)
                except Exception:
                    continue
                running = await store.list_episodes(run_id=run_id, status="running")
                if sum(e.num_turns >= 1 for e in running) >= 2:
                    first.send_signal(signal.SIGKILL)
                    first.wait()
                    before = await running_of(store, run_id, first.pid)
                    break
    finally:
        if first.poll() is None:
            first.kill()
    await anyio.sleep(4)  # its heartbeats age past stale_after_s
    second = subprocess.Popen(argv, cwd=workdir, env=env, stdout=log, stderr=log)
    await anyio.to_thread.run_sync(lambda: second.wait(300))
    log.close()
    if not before:
        tail = (workdir / "serve.log").read_text(errors="replace")[-1500:]
        return {"episodes": 0, "resumed": 0, "share": None, "tokens_changed": [],
                "error": f"no episode was running when it was killed; its log ends: {tail}"}
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


async def engine_current(qs: Quickstart, index: int, floor: int) -> float:
    """When engine `index` itself serves a policy version >= floor and the router has it in
    rotation (monotonic time). The engine is asked directly: until the router's health checks
    quarantine a dead engine, the router still lists the version it last saw there."""
    from agent_rl.sglang.client import EngineClient

    assert qs.fleet is not None
    url = qs.fleet.engines[index]
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    async with EngineClient(url) as engine, EngineClient(qs.fleet.router_url) as router:
        while time.monotonic() < deadline:
            own = (await engine.served_versions()).get(url)
            in_rotation = url in await router.served_versions()
            if own is not None and own.isdigit() and int(own) >= floor and in_rotation:
                return time.monotonic()
            await anyio.sleep(1.0)
    raise TimeoutError(f"{url} did not come back on current weights")


async def chaos(qs: Quickstart, sup: Supervisor, kills: list[dict[str, Any]],
                resumed: dict[str, Any]) -> None:  # fmt: skip
    """Kill each victim once training has moved on since the previous kill, and a python-math
    serve of its own; then stop RL (also when recovery timed out: the run is still audited,
    and the failure is in `kills`)."""
    from signal import SIGINT

    async def python_math() -> None:
        resumed["python-math"] = await resume_after_kill(qs, "python-math")

    try:
        # Beside the kills (it shares the fleet's engines): the run stays within its minutes.
        async with anyio.create_task_group() as tg:
            tg.start_soon(python_math)
            await _kill_each(qs, sup, kills, resumed)
    except TimeoutError as e:
        kills.append({"error": str(e)})
    qs.say("chaos: done; stopping RL as the quickstart does (trainer, then serve drains)")
    await sup.stop("train", grace_s=120, sig=SIGINT)


async def _kill_each(qs: Quickstart, sup: Supervisor, kills: list[dict[str, Any]],
                     resumed: dict[str, Any]) -> None:  # fmt: skip
    await wait_version(qs, 1, RECOVERY_TIMEOUT_S)
    for name in VICTIMS:
        before = await latest(qs)
        starts = sup[name].starts
        t0 = time.monotonic()
        pid = sup.kill(name)
        qs.say(f"chaos: SIGKILL {name} (pid {pid}) at policy version {before}")
        if name.startswith("serve-"):
            async with await Store.open(qs.cfg.store) as store:
                run_id = await store.ensure_run(qs.cfg.run.name)
                resumed["_calculator_before"] = await running_of(store, run_id, pid)
        while sup[name].starts == starts:
            await anyio.sleep(0.2)
        restarted_s = time.monotonic() - t0
        # Training continued: two new versions, so at least one step ran wholly after the kill.
        after = await wait_version(qs, before + 1, RECOVERY_TIMEOUT_S)
        kill = {"process": name, "pid": pid, "version_at_kill": before,
                "restarted_after_s": round(restarted_s, 1), "version_after": after,
                "recovered_after_s": round(time.monotonic() - t0, 1)}
        if name.startswith("engine-"):
            # Back in rotation, on current weights (it restarted on its launch weights).
            kill["engine_serving_current_after_s"] = round(
                await engine_current(qs, int(name.split("-")[1]), before) - t0, 1)
        kills.append(kill)
        qs.say(f"chaos: {name} restarted; training reached version {after} "
               f"{kill['recovered_after_s']:.0f}s after the kill"
               + (f", the engine served current weights after {current:.0f}s"
                  if (current := kill.get("engine_serving_current_after_s")) else ""))
    await wait_version(qs, await latest(qs), RECOVERY_TIMEOUT_S)


async def main(store_url: str, sft_steps: int) -> dict[str, Any]:
    console = Console()
    url, dbname = fresh_database(store_url)
    # Every group trains (no zero-variance filter): the run keeps stepping from any warm start.
    os.environ["AGENT_RL_ROLLOUT__FILTER_ZERO_VARIANCE"] = "false"
    # A killed serve's episodes are resumed once their heartbeats are this old.
    os.environ["AGENT_RL_ROLLOUT__STALE_AFTER_S"] = "6"
    kills: list[dict[str, Any]] = []
    resumed: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="agent-rl-chaos-") as tmp:
            opts = Options(cluster=True, store_url=url, sft_steps=sft_steps, rl_steps=10_000,
                           rl_minutes=30, eval_tasks=2, eval_samples=1)
            qs = Quickstart(opts, Path(tmp), console)
            t0 = time.monotonic()
            async with qs.running() as sup:
                qs.fleet = await qs.start_fleet(sup)
                await qs.sft_stage()
                async with anyio.create_task_group() as rl:
                    rl.start_soon(chaos, qs, sup, kills, resumed)
                    await qs.rl_stage()
            async with await Store.open(qs.cfg.store) as store:
                run_id = await store.ensure_run(qs.cfg.run.name)
                audit = await store.audit(run_id)
                episodes = await store.list_episodes(run_id=run_id, limit=1_000_000)
                versions = await store.latest_version(run_id)
                resumed["calculator"] = await resumed_share(
                    store, resumed.pop("_calculator_before", {}))
            os.chdir(Path(__file__).resolve().parents[1])
    finally:
        drop_database(store_url, dbname)
    failed_by_cause = Counter(f"{e.error_type}: {(e.error_cause or '')[:60]}"
                              for e in episodes if e.status == "failed")
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
        "passed": not audit.problems() and ok_recovery and ok_resumed,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store-url", default=os.environ.get(
        "AGENT_RL_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"))
    ap.add_argument("--sft-steps", type=int, default=60)
    args = ap.parse_args()
    result = anyio.run(main, args.store_url, args.sft_steps)
    print("RESULT " + json.dumps(result))
