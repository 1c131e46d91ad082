"""Serve's ceiling: how many turns/s one `serve` process sustains when the engine costs nothing.

The engine is `agent_rl.testing.stand_in_engine`, the fault-free stand-in for a GPU engine (no GPU
here, and a CPU SGLang's few hundred tokens/s would hide serve's own cost): it speaks SGLang's
`/generate` (input ids in; output ids with logprobs, weight version and finish reason out) and
answers scripted multi-turn episodes instantly (or at `--tokens-per-s` per request), in a
process of its own. Each serve runs in a process of its own against a fresh store, with 64
episodes in flight, and is measured in steady state: after `--warmup-s`, over `--window-s`,
turns completed (counted in the store) per second and the serve processes' CPU time (user +
system) per turn; the stand-in's and the router's CPU per turn are reported beside it.

Runs, each a fresh store:
1. calculator (tool calls, then the answer; 4 turns with `--turns`) on SQLite, one serve; the
   same through the router (in its own process: the router hop); calculator with 3x longer
   episodes (what of a turn's cost is per episode); search-qa (BM25 search tool, 6 turns);
2. calculator on PostgreSQL (`AGENT_RL_BENCH_POSTGRES_URL`, else `AGENT_RL_TEST_POSTGRES_URL`;
   skipped without one) with 1, 2 and 4 serves on one store (scaling = turns/s of n serves /
   turns/s of one), with what the store's backends did meanwhile (`PostgresWaits`: lock
   waits, I/O, or waiting for their serve) and the postgres processes' CPU per turn, which
   tell contention on the store from a machine out of CPU; and the same with 1 and 4 serves
   paced (the stand-in at `--paced-tokens-per-s` per request, `--paced-concurrency` episodes
   per serve): on a machine with fewer cores than 4 saturated serves need, whether the store
   lets serves add up when CPU is not what bounds them (`scaling_4_serves_paced`);
3. a py-spy profile (`.[bench]`; sampled, all threads, waits left out) of the one-serve SQLite
   run, taken after its measurement, its samples grouped into stages by their innermost frame.

Last line: RESULT {"turns_per_s_sqlite", "turns_per_s_postgres", "cpu_ms_per_turn",
"top_stages", "scaling_4_serves", "scaling_4_serves_paced", ...}. The load average and the
machine's CPU use are printed with every run: on a shared or saturated machine the numbers say
so.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._proc import cpu_s  # noqa: E402
from bench._stages import stages  # noqa: E402

POSTGRES = os.environ.get("AGENT_RL_BENCH_POSTGRES_URL",
                          os.environ.get("AGENT_RL_TEST_POSTGRES_URL", ""))


def script(env: str, turns: int, model: Path) -> dict[str, Any]:
    """Completions for the stand-in: tool calls for turns 0..turns-2, then the answer."""
    from agent_rl.rollout.render import ChatRenderer
    from agent_rl.sdk.tool_calls import format_tool_call

    renderer = ChatRenderer(model)
    call = (format_tool_call("calc", {"expression": "12*34+5"}) if env == "calculator"
            else format_tool_call("search", {"query": "capital of France"}))
    answer = "413" if env == "calculator" else "Paris"
    completions = [renderer.encode(call)] * (turns - 1) + [renderer.encode(answer)]
    return {"completions": completions, "eos_id": renderer.eos_id}


# --- the processes ----------------------------------------------------------------------------

def serve_role(args: argparse.Namespace) -> None:
    """One serve process: `serve` until killed."""
    import anyio

    from agent_rl.config import Config, EngineConfig, RolloutConfig, StoreConfig
    from agent_rl.app.serve import serve

    logging_quiet()
    env_kwargs = {"max_turns": args.turns}
    cfg = Config(
        store=StoreConfig(url=args.store, pool_size=8),
        engine=EngineConfig(model=args.model),
        rollout=RolloutConfig(env=args.env, env_kwargs=env_kwargs, router_url=args.engine,
                              group_size=8, max_concurrent_episodes=args.concurrency,
                              max_queued_groups=0, max_turns=args.turns, max_new_tokens=64,
                              max_tokens=8192, seed=args.seed),
    )
    cfg.run.name = "ceiling"
    anyio.run(lambda: serve(cfg, max_episodes=None),
              backend_options={"use_uvloop": bool(os.environ.get("CEILING_UVLOOP"))})


def logging_quiet() -> None:
    import logging

    logging.basicConfig(level=logging.ERROR)


def spawn(*argv: str, log: Path) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    return subprocess.Popen([sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()


def wait_url(proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        for line in text.splitlines():
            if line.startswith("http://"):
                return line.strip()
        if proc.poll() is not None:
            raise RuntimeError(f"{log.name} exited: {text[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"{log.name} printed no URL in {timeout_s} s")


def count_turns(url: str) -> int:
    from sqlalchemy import create_engine, text

    from agent_rl.store.db import database_url

    db = create_engine(database_url(url))
    try:
        with db.connect() as conn:
            return int(conn.scalar(text("SELECT count(*) FROM turns")))
    finally:
        db.dispose()


def count_episodes(url: str) -> int:
    from sqlalchemy import create_engine, text

    from agent_rl.store.db import database_url

    db = create_engine(database_url(url))
    try:
        with db.connect() as conn:
            return int(conn.scalar(text(
                "SELECT count(*) FROM episodes WHERE status NOT IN ('waiting', 'running')")))
    finally:
        db.dispose()


class PostgresWaits:
    """What the store's PostgreSQL backends do during a window, sampled every 20 ms in a thread
    (`pg_stat_activity`): how many transactions are open at once, and what each is doing:
    running a statement, waiting on a lock (`Lock`: rows, transaction ids; `LWLock`: the
    server's internal locks, WAL insertion among them), on I/O (`IO`: WAL writes and fsyncs),
    or on its serve (idle in transaction: the client has not sent the next statement, e.g. its
    thread is waiting for a CPU). Serves that contend on the store show up as lock waits;
    serves bounded by CPU show up as transactions waiting for their serve, with the machine's
    CPU busy. The backends' own CPU (the postgres processes') is counted too."""

    def __init__(self, url: str) -> None:
        import threading

        self.url, self.samples = url, collections.Counter()  # type: ignore[var-annotated]
        self.ticks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.cpu0 = self._cpu()
        self._thread.start()

    @staticmethod
    def _cpu() -> dict[int, float]:
        import psutil

        out = {}
        for p in psutil.process_iter(["name", "username"]):
            if p.info["username"] == "postgres" or (p.info["name"] or "").startswith("postgres"):
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    out[p.pid] = t.user + t.system
        return out

    def _run(self) -> None:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._stop.wait(0.02):
                rows = conn.execute(
                    "SELECT CASE WHEN state = 'active' THEN coalesce(wait_event_type, 'CPU') "
                    "ELSE 'serve' END FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid() AND state IN ('active', 'idle in transaction')"
                ).fetchall()
                self.ticks += 1
                self.samples.update(r[0] for r in rows)

    def stop(self, turns: int) -> dict[str, float]:
        self._stop.set()
        self._thread.join(5)
        cpu1 = self._cpu()
        cpu = sum(cpu1[p] - self.cpu0[p] for p in cpu1 if p in self.cpu0)
        active = sum(self.samples.values())
        share = lambda *kinds: round(sum(self.samples[k] for k in kinds) / max(active, 1), 3)  # noqa: E731
        return {
            "pg_open_transactions": round(active / max(self.ticks, 1), 2),
            "pg_lock_wait_share": share("Lock", "LWLock"),
            "pg_io_wait_share": share("IO"),
            "pg_running_share": share("CPU"),
            "pg_waiting_for_serve_share": share("serve", "Client"),
            "postgres_cpu_ms_per_turn": round(1000 * cpu / max(turns, 1), 3),
        }


def fresh_store(backend: str, tmp: Path) -> str:
    import anyio

    from agent_rl.config import StoreConfig
    from agent_rl.store.migrate import upgrade

    if backend == "sqlite":
        url = f"sqlite:///{tmp}/store-{uuid.uuid4().hex[:6]}.db"
    else:
        import psycopg

        name = f"ceiling_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(POSTGRES, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        url = POSTGRES.rsplit("/", 1)[0] + "/" + name
    anyio.run(upgrade, StoreConfig(url=url))
    return url


def drop_store(url: str) -> None:
    if url.startswith("postgresql"):
        import psycopg

        with psycopg.connect(POSTGRES, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')


def measure(args: argparse.Namespace, tmp: Path, *, env: str, backend: str, serves: int = 1,
            router: bool = False, profile: bool = False, turns: int | None = None,
            paced: bool = False) -> dict[str, Any]:  # fmt: skip
    """One run: a fresh store, `serves` serve processes, steady-state turns/s and CPU/turn.
    `paced`: the stand-in decodes at `--paced-tokens-per-s` per request and each serve keeps
    `--paced-concurrency` episodes in flight, so that serves do not run out of CPU."""
    import psutil

    turns = turns or (args.turns if env == "calculator" else 6)
    tokens_per_s = args.paced_tokens_per_s if paced else args.tokens_per_s
    concurrency = args.paced_concurrency if paced else args.concurrency
    model = tmp / "model"
    script_file = tmp / f"script-{env}-{turns}.json"
    if not script_file.exists():
        script_file.write_text(json.dumps(script(env, turns, model)))
    store = fresh_store(backend, tmp)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        elog = tmp / f"engine-{uuid.uuid4().hex[:6]}.log"
        extra = ["--tokens-per-s", str(tokens_per_s)] if tokens_per_s else []
        procs.append(spawn("-m", "agent_rl.testing.stand_in_engine", "--script", str(script_file),
                           *extra, log=elog))
        url = wait_url(procs[-1], elog)
        if router:
            rlog = tmp / f"router-{uuid.uuid4().hex[:6]}.log"
            procs.append(spawn(__file__, "--role", "router", "--engine", url, log=rlog))
            url = wait_url(procs[-1], rlog)
        serve_procs = []
        for i in range(serves):
            slog = tmp / f"serve-{i}-{uuid.uuid4().hex[:6]}.log"
            serve_procs.append(spawn(
                __file__, "--role", "serve", "--store", store, "--engine", url, "--env", env,
                "--turns", str(turns), "--model", str(model), "--seed", str(i),
                "--concurrency", str(concurrency), log=slog))
        procs += serve_procs
        deadline = time.monotonic() + 120
        while count_turns(store) < 50 * serves:
            if any(p.poll() is not None for p in serve_procs) or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start: {(tmp / slog).read_text()[-3000:]}")
            time.sleep(0.2)
        time.sleep(args.warmup_s)
        others = [p for p in procs if p not in serve_procs]  # the stand-in, the router
        t0, n0, e0 = time.monotonic(), count_turns(store), count_episodes(store)
        c0 = [cpu_s(p.pid) for p in serve_procs]
        o0 = [cpu_s(p.pid) for p in others]
        psutil.cpu_percent()
        waits = PostgresWaits(store) if backend == "postgresql" else None
        time.sleep(args.window_s)
        busy = psutil.cpu_percent() / 100
        t1, n1, e1 = time.monotonic(), count_turns(store), count_episodes(store)
        c1 = [cpu_s(p.pid) for p in serve_procs]
        o1 = [cpu_s(p.pid) for p in others]
        load = os.getloadavg()[0]
        pg = waits.stop(n1 - n0) if waits is not None else {}
        spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
        if profile and spy is None:
            print("no py-spy: no profile (pip install -e '.[bench]')", flush=True)
        elif profile:  # after the measurement, which the sampler would slow down
            subprocess.run(
                [spy, "record",
                 "--pid", str(serve_procs[0].pid), "--format", "raw", "--rate", "250",
                 "--duration", str(int(args.profile_s)), "--output", str(tmp / "profile.txt"),
                 "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=args.profile_s + 30)
    finally:
        stop(procs)
        drop_store(store)
    dt, dn = t1 - t0, n1 - n0
    cpu = sum(c1) - sum(c0)
    result = {
        "env": env, "backend": backend, "serves": serves, "router": router, "paced": paced,
        "turns_per_s": round(dn / dt, 1), "episodes_per_s": round((e1 - e0) / dt, 1),
        "cpu_ms_per_turn": round(1000 * cpu / max(dn, 1), 3),
        "serve_cpu_share": round(cpu / dt / serves, 2),
        "engine_cpu_ms_per_turn": round(1000 * (o1[0] - o0[0]) / max(dn, 1), 3),
        "load": round(load, 2), "machine_cpu_busy": round(busy, 2),
    }
    result |= pg
    if router:
        result["router_cpu_ms_per_turn"] = round(1000 * (o1[1] - o0[1]) / max(dn, 1), 3)
    if profile and (tmp / "profile.txt").exists():
        result["stages"] = stages(tmp / "profile.txt")
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["main", "serve", "router"], default="main")
    ap.add_argument("--store"), ap.add_argument("--engine"), ap.add_argument("--env")
    ap.add_argument("--model", type=Path), ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--turns", type=int, default=4, help="turns per calculator episode")
    ap.add_argument("--concurrency", type=int, default=64, help="episodes in flight per serve")
    ap.add_argument("--tokens-per-s", type=float, default=None,
                    help="the stand-in's decode speed per request (default: instant)")
    ap.add_argument("--paced-tokens-per-s", type=float, default=100.0,
                    help="the paced scaling runs' decode speed per request")
    ap.add_argument("--paced-concurrency", type=int, default=16,
                    help="episodes in flight per serve in the paced scaling runs")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--profile-s", type=float, default=8.0)
    ap.add_argument("--keep", action="store_true", help="keep the logs and the profile")
    ap.add_argument("--only", default="", help="comma-separated run names (default: all)")
    args = ap.parse_args()
    if args.role == "serve":
        return serve_role(args)
    if args.role == "router":
        from bench._serving import run_router

        return run_router(args.engine)

    from agent_rl.models import init_model

    started = time.monotonic()
    with (contextlib.nullcontext(tempfile.mkdtemp()) if args.keep
          else tempfile.TemporaryDirectory()) as d:
        if args.keep:
            print(f"keeping the run's files (logs, profile) in {d}")
        tmp = Path(d)
        init_model(tmp / "model", "tiny-dense", seed=0)
        runs: dict[str, dict[str, Any]] = {}
        plan = {
            "sqlite": dict(env="calculator", backend="sqlite", profile=True),
            "sqlite_router": dict(env="calculator", backend="sqlite", router=True),
            "search_sqlite": dict(env="search-qa", backend="sqlite"),
            "sqlite_long": dict(env="calculator", backend="sqlite", turns=3 * args.turns),
        }
        if POSTGRES:
            plan |= {f"postgres_{n}": dict(env="calculator", backend="postgresql", serves=n)
                     for n in (1, 2, 4)}
            plan |= {f"postgres_paced_{n}": dict(env="calculator", backend="postgresql",
                                                 serves=n, paced=True) for n in (1, 4)}
        only = set(filter(None, args.only.split(",")))
        for name, kw in plan.items():
            if not only or name in only:
                print(f"== {name}  (load average {os.getloadavg()[0]:.2f})", flush=True)
                runs[name] = measure(args, tmp, **kw)  # type: ignore[arg-type]
    get = lambda name, key: runs.get(name, {}).get(key)  # noqa: E731
    one, four = get("postgres_1", "turns_per_s"), get("postgres_4", "turns_per_s")
    stages_ = get("sqlite", "stages") or {}
    result = {
        "turns_per_s_sqlite": get("sqlite", "turns_per_s"),
        "turns_per_s_postgres": one,
        "cpu_ms_per_turn": get("sqlite", "cpu_ms_per_turn"),
        "top_stages": dict(list(stages_.items())[:6]),
        "scaling_4_serves": round(four / one, 2) if one and four else None,
        "scaling_2_serves": round(get("postgres_2", "turns_per_s") / one, 2)
        if one and get("postgres_2", "turns_per_s") else None,
        "scaling_4_serves_paced": round(get("postgres_paced_4", "turns_per_s")
                                        / get("postgres_paced_1", "turns_per_s"), 2)
        if get("postgres_paced_1", "turns_per_s") and get("postgres_paced_4", "turns_per_s")
        else None,
        "episodes_per_s_sqlite": get("sqlite", "episodes_per_s"),
        "turns_per_s_sqlite_via_router": get("sqlite_router", "turns_per_s"),
        "cpu_ms_per_turn_via_router": get("sqlite_router", "cpu_ms_per_turn"),
        "turns_per_s_sqlite_long_episodes": get("sqlite_long", "turns_per_s"),
        "cpu_ms_per_turn_long_episodes": get("sqlite_long", "cpu_ms_per_turn"),
        "turns_per_s_search_qa": get("search_sqlite", "turns_per_s"),
        "cpu_ms_per_turn_search_qa": get("search_sqlite", "cpu_ms_per_turn"),
        "cpu_ms_per_turn_postgres": get("postgres_1", "cpu_ms_per_turn"),
        "cores": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 2),
        "wall_s": round(time.monotonic() - started, 1),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
