"""Runner overhead in steady state: `serve` vs the bare engine, through the same router.

1. One SGLang engine (tiny-dense, CPU) and one router in front of it (`agent-rl router`'s code,
   in a process of its own) are started once and warmed up.
2. `serve` (its own process) runs calculator episodes through that router into a fresh SQLite
   store without stopping; after `--warmup-s` (engine warm, prefix cache filled, every
   episode slot busy), completion tokens/s are counted over `--window-s` from the turns the
   store records as finished inside the window.
3. Then serve is stopped and the bare engine replays exactly the window's generations (same
   prompt ids, same completion lengths via ignore_eos) through the same router, closed loop at
   the same concurrency, measured the same way after its own warm-up.
runner_ratio = serve tokens/s / bare tokens/s: what serve's scheduler, runners, env, tools,
drift check and store cost the engine. The load average is printed with the result: on a
shared machine the engine's speed moves, and the ratio with it.
Last line: RESULT {"runner_ratio", "serve_tok_s", "bare_tok_s", "serve_episodes_s", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def serve_role(args: argparse.Namespace) -> None:
    from agent_rl.config import Config, EngineConfig, RolloutConfig, StoreConfig
    from agent_rl.serve import serve

    cfg = Config(
        store=StoreConfig(url=args.store),
        engine=EngineConfig(model=args.model),
        rollout=RolloutConfig(env="calculator", group_size=8, max_concurrent_episodes=args.concurrency,
                              max_new_tokens=64, max_turns=2, router_url=args.router,
                              max_queued_groups=0),
    )
    anyio.run(lambda: serve(cfg, max_episodes=None))


def router_role(args: argparse.Namespace) -> None:
    from agent_rl.config import RouterConfig
    from router.app import Router

    async def run() -> None:
        async with Router(RouterConfig(port=0), workers=[args.engine]) as r:
            print(r.url, flush=True)
            await anyio.sleep_forever()

    anyio.run(run)


def window_turns(url: str, t0: float, t1: float) -> tuple[list[tuple[list[int], int]], int]:
    """(prompt ids, completion length) of every turn finished in [t0, t1), and the episodes
    finished there."""
    from sqlalchemy import create_engine, text

    from agent_rl.store import arrays
    from agent_rl.store.db import engine_url

    db = create_engine(engine_url(url))
    try:
        with db.connect() as conn:
            episodes = conn.scalar(text(
                "SELECT count(*) FROM episodes WHERE finished_at >= :a AND finished_at < :b"),
                {"a": t0, "b": t1})
            rows = conn.execute(text(
                "SELECT episode_id, idx, num_prompt_tokens, num_tokens, finished_at FROM "
                "(SELECT episode_id, \"index\" AS idx, num_prompt_tokens, num_tokens, finished_at "
                "FROM turns) t WHERE finished_at >= :a AND finished_at < :b"), {"a": t0, "b": t1}).all()
            generations = []
            for r in rows:
                spans = conn.execute(text(
                    'SELECT token_ids, codec FROM turns WHERE episode_id = :e AND "index" <= :i '
                    'ORDER BY "index"'), {"e": r.episode_id, "i": r.idx}).all()
                ids = [int(t) for s in spans for t in arrays.decode(s.token_ids, arrays.TOKEN_DTYPE, s.codec)]
                completion = r.num_tokens - r.num_prompt_tokens
                generations.append((ids[: len(ids) - completion], completion))
    finally:
        db.dispose()
    return generations, int(episodes)


async def replay(url: str, generations: list[tuple[list[int], int]], concurrency: int,
                 warmup_s: float, window_s: float) -> float:  # fmt: skip
    """Closed-loop replay at `concurrency`, cycling through `generations`; completion tokens/s
    over `window_s` after `warmup_s` (tokens of requests that finished inside the window)."""
    from agent_rl.engine.client import EngineClient

    done: list[tuple[float, int]] = []
    start = time.monotonic()
    stop_at = start + warmup_s + window_s
    async with EngineClient(url) as client:

        async def worker(k: int) -> None:
            i = k
            while time.monotonic() < stop_at:
                prompt, n = generations[i % len(generations)]
                await client.generate(prompt, {"max_new_tokens": n, "ignore_eos": True,
                                               "temperature": 1.0})
                done.append((time.monotonic(), n))
                i += concurrency

        async with anyio.create_task_group() as tg:
            for k in range(concurrency):
                tg.start_soon(worker, k)
    t0, t1 = start + warmup_s, stop_at
    return sum(n for t, n in done if t0 <= t < t1) / (t1 - t0)


def wait_url(proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in (log.read_text() if log.exists() else "").splitlines():
            if line.startswith("http://"):
                return line.strip()
        if proc.poll() is not None:
            raise RuntimeError(log.read_text()[-2000:])
        time.sleep(0.1)
    raise RuntimeError(f"no URL in {log}")


def spawn(log: Path, *argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, __file__, *argv], stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def kill(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def main(args: argparse.Namespace) -> dict[str, Any]:
    from agent_rl.config import EngineConfig
    from agent_rl.engine.launcher import EngineServer
    from agent_rl.models import init_model

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = init_model(tmp / "model", "tiny-dense", seed=0)
        engine = EngineServer.from_config(EngineConfig(model=model, port=0, log_dir=tmp / "logs"))
        anyio.run(engine.astart)
        procs = []
        try:
            procs.append(spawn(tmp / "router.log", "--role", "router", "--engine", engine.url))
            router = wait_url(procs[-1], tmp / "router.log")
            store = f"sqlite:///{tmp}/store.db"
            serve = spawn(tmp / "serve.log", "--role", "serve", "--store", store, "--router", router,
                          "--model", str(model), "--concurrency", str(args.concurrency))
            procs.append(serve)
            time.sleep(args.warmup_s)
            t0 = time.time()
            load0 = os.getloadavg()[0]
            time.sleep(args.window_s)
            t1 = time.time()
            load_serve = os.getloadavg()[0]
            kill(serve)
            generations, episodes = window_turns(store, t0, t1)
            if not generations:
                raise RuntimeError(f"serve finished no turn in the window: {(tmp / 'serve.log').read_text()[-3000:]}")
            serve_tok_s = sum(n for _, n in generations) / (t1 - t0)
            bare_tok_s = anyio.run(replay, router, generations, args.concurrency,
                                   args.bare_warmup_s, args.window_s)
            load_bare = os.getloadavg()[0]
        finally:
            for p in procs:
                kill(p)
            engine.stop()
    print(f"window {args.window_s:.0f} s after {args.warmup_s:.0f} s warm-up: {len(generations)} "
          f"generations, {episodes} episodes, concurrency {args.concurrency}")
    print(f"serve: {serve_tok_s:7.1f} tok/s  {episodes / (t1 - t0):5.2f} episodes/s  "
          f"(load average {load0:.2f} -> {load_serve:.2f})")
    print(f"bare:  {bare_tok_s:7.1f} tok/s  (same router, load average {load_bare:.2f})")
    return {
        "runner_ratio": round(serve_tok_s / bare_tok_s, 3),
        "serve_tok_s": round(serve_tok_s, 1),
        "bare_tok_s": round(bare_tok_s, 1),
        "serve_episodes_s": round(episodes / (t1 - t0), 3),
        "generations": len(generations),
        "load_average": round(max(load_serve, load_bare), 2),
        "cores": os.cpu_count(),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["main", "serve", "router"], default="main")
    parser.add_argument("--store"), parser.add_argument("--router"), parser.add_argument("--engine")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup-s", type=float, default=20.0)
    parser.add_argument("--bare-warmup-s", type=float, default=5.0)
    parser.add_argument("--window-s", type=float, default=40.0)
    args = parser.parse_args()
    if args.role == "serve":
        serve_role(args)
    elif args.role == "router":
        router_role(args)
    else:
        print("RESULT " + json.dumps(main(args)))
