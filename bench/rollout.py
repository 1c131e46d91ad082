"""Runner overhead in steady state: `serve` vs the bare engine, through the same router.

1. One SGLang engine (tiny-dense, CPU) and one router in front of it (`agent-rl router`'s code,
   in a process of its own) are started once and warmed up.
2. `serve` (its own process) runs calculator episodes through that router into a fresh SQLite
   store without stopping; after `--warmup-s` (engine warm, prefix cache filled, every
   episode slot busy), completion tokens/s are counted over `--window-s` from the turns the
   store records as finished inside the window.
3. Then serve is frozen (SIGSTOP) and the bare engine replays exactly the generations serve
   made (same prompt ids, same completion lengths via ignore_eos) through the same router,
   closed loop at the same concurrency, measured the same way after its own warm-up; then
   serve goes on (SIGCONT). `--rounds` rounds of both, so that both meet the same machine.
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

from bench._serving import metric_sum, run_router  # noqa: E402


def serve_role(args: argparse.Namespace) -> None:
    from agent_rl.config import Config, EngineConfig, RolloutConfig, StoreConfig
    from agent_rl.app.serve import serve

    cfg = Config(
        store=StoreConfig(url=args.store),
        engine=EngineConfig(model=args.model),
        rollout=RolloutConfig(env="calculator", group_size=8, max_concurrent_episodes=args.concurrency,
                              max_new_tokens=64, max_turns=2, router_url=args.router,
                              max_queued_groups=0),
    )
    anyio.run(lambda: serve(cfg, max_episodes=None))


def window_turns(url: str, t0: float, t1: float) -> tuple[list[tuple[list[int], int]], int]:
    """(prompt ids, completion length) of every turn finished in [t0, t1), and the episodes
    finished there."""
    from sqlalchemy import create_engine, text

    from agent_rl.store import arrays
    from agent_rl.store.db import database_url

    db = create_engine(database_url(url))
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
                 warmup_s: float, window_s: float, offset: int = 0) -> tuple[int, float]:  # fmt: skip
    """Closed-loop replay at `concurrency`, cycling through `generations` from `offset`; the
    completion tokens of requests that finished in the `window_s` after `warmup_s`, and the
    window's length."""
    from agent_rl.sglang.client import EngineClient

    done: list[tuple[float, int]] = []
    start = time.monotonic()
    stop_at = start + warmup_s + window_s
    async with EngineClient(url) as client:

        async def worker(k: int) -> None:
            i = offset + k
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
    return sum(n for t, n in done if t0 <= t < t1), t1 - t0


class InFlight:
    """Samples the router's in-flight requests (its /metrics gauge) every 0.25 s in a thread."""

    def __init__(self, router: str) -> None:
        import threading

        self.url, self.samples = router + "/metrics", []  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import urllib.request

        while not self._stop.wait(0.25):
            try:
                text = urllib.request.urlopen(self.url, timeout=2).read().decode()
            except OSError:
                continue
            self.samples.append((time.time(), metric_sum(text, "agent_rl_router_in_flight")))

    def mean(self, spans: list[tuple[float, float]]) -> float:
        inside = [n for t, n in self.samples if any(a <= t < b for a, b in spans)]
        return sum(inside) / max(len(inside), 1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


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
            # Rounds of serve and bare in turn, so both meet the same machine (a shared one's
            # load moves by the minute): serve is frozen (SIGSTOP) while the bare engine runs.
            serve_tokens = bare_tokens = episodes = 0
            serve_s = bare_s = 0.0
            generations: list[tuple[list[int], int]] = []
            loads = []
            in_flight = InFlight(router)
            serve_spans: list[tuple[float, float]] = []
            bare_spans: list[tuple[float, float]] = []
            for r in range(args.rounds):
                if r:
                    os.killpg(serve.pid, signal.SIGCONT)
                    time.sleep(args.rewarm_s)
                t0 = time.time()
                time.sleep(args.window_s)
                t1 = time.time()
                os.killpg(serve.pid, signal.SIGSTOP)
                loads.append(os.getloadavg()[0])
                window, ended = window_turns(store, t0, t1)
                if not window:
                    raise RuntimeError(f"serve finished no turn in a window: "
                                       f"{(tmp / 'serve.log').read_text()[-3000:]}")
                generations += window
                serve_tokens += sum(n for _, n in window)
                serve_s += t1 - t0
                episodes += ended
                serve_spans.append((t0, t1))
                b0 = time.time() + args.rewarm_s
                tokens, seconds = anyio.run(replay, router, generations, args.concurrency,
                                            args.rewarm_s, args.window_s, len(generations) - len(window))
                bare_spans.append((b0, b0 + seconds))
                bare_tokens += tokens
                bare_s += seconds
                loads.append(os.getloadavg()[0])
            serve_tok_s, bare_tok_s = serve_tokens / serve_s, bare_tokens / bare_s
            in_flight.stop()
            serve_busy, bare_busy = in_flight.mean(serve_spans), in_flight.mean(bare_spans)
        finally:
            for p in procs:
                kill(p)
            engine.stop()
    print(f"{args.rounds} rounds of {args.window_s:.0f} s each (serve after a {args.warmup_s:.0f} s "
          f"warm-up, then each side after {args.rewarm_s:.0f} s): {len(generations)} generations, "
          f"{episodes} episodes, concurrency {args.concurrency}")
    print(f"serve: {serve_tok_s:7.1f} tok/s  {episodes / serve_s:5.2f} episodes/s")
    print(f"bare:  {bare_tok_s:7.1f} tok/s  (same router, same generations)")
    print("load average after each window: " + ", ".join(f"{x:.2f}" for x in loads))
    print(f"requests in flight at the engine (router's gauge): serve {serve_busy:.1f}, "
          f"bare {bare_busy:.1f} of {args.concurrency}")
    return {
        "runner_ratio": round(serve_tok_s / bare_tok_s, 3),
        "serve_tok_s": round(serve_tok_s, 1),
        "bare_tok_s": round(bare_tok_s, 1),
        "serve_episodes_s": round(episodes / serve_s, 3),
        "generations": len(generations),
        "serve_in_flight": round(serve_busy, 2),
        "bare_in_flight": round(bare_busy, 2),
        "load_average": round(max(loads), 2),
        "cores": os.cpu_count(),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["main", "serve", "router"], default="main")
    parser.add_argument("--store"), parser.add_argument("--router"), parser.add_argument("--engine")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup-s", type=float, default=20.0)
    parser.add_argument("--rewarm-s", type=float, default=4.0,
                        help="warm-up of each later window (the other side's requests drain)")
    parser.add_argument("--window-s", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.role == "serve":
        serve_role(args)
    elif args.role == "router":
        run_router(args.engine)
    else:
        print("RESULT " + json.dumps(main(args)))
