"""Sustained decode of the served model at real lengths: engine direct vs router vs serve's runner.

One SGLang engine (tiny-dense, CPU, positions up to 8k, a KV cache for 64 x 4k tokens) and one
router in front of it (in a process of its own) are started once. Then for each completion
length L in 256, 1024, 4096 and concurrency c in 1, 8, 32, 64, three drivers keep c requests in
flight, closed loop:
- engine: c workers send /generate straight to the engine;
- router: the same through the router;
- runner: `serve` (in this process) runs one-turn episodes of the `decode-bench` env through the
  router, `rollout.max_concurrent_episodes = c`, each asking for its completion length.
Steady state at length L means the running requests sit at every position from 0 to L, not all
at the start: each request gets a prompt of P random tokens and generates exactly L - P tokens
(ignore_eos), so from the first decode step on the engine decodes at the positions a
long-running closed loop would. A cell's first c requests take P at the middles of c equal
slices of [0, L), the same on the three paths (`start_lengths`); later ones P uniform in
[8, L). The prompts are prefixes of one random sequence (the runner's: of one text), so
SGLang's prefix cache prefills each position once: otherwise 64 prompts of ~2k tokens took this
CPU longer to prefill than the whole bench may run, and prefill is not what the bench measures.
The window opens once c requests decode on the engine and none waits to be prefilled (or after
8 s, 16 s at 4k), plus `--settle-s`; a cell ends by aborting its requests and waiting until the
engine holds none. (Before, a window opened once c requests ran, after 8 s at most: at 4k x 32
the paths took 6-8 s to get there, and windows that opened on fewer, or met the previous cell's
aborted requests still leaving, spent their time prefilling: some read 0 tok/s.) The meter
is the engine's own: SGLang's decode-token counter (`sglang:realtime_tokens_total{mode="decode"}`
on its /metrics, with `--enable-metrics`), which the scheduler advances by the tokens of every
decode step, read as the window opens and as it closes: exact to one step and blind to which
client sent the requests, so the three drivers are measured alike. At the window's end every
request is aborted. (The meter before it timed each /generate call in this process and spread
a call's tokens evenly from its first token to its return; requests that start one after
another, as serve's episodes do, decode slower while the later ones prefill, so that spread
moved tokens out of the window: the runner read 0.90 of the counter at 1k x 32 and 0.94 at 256
x 32, the engine's driver, whose c requests start at once, 1.00.) At 4k x 64 the first path
may still be ramping when its 16 s are up (30 of 64 running, 30 waiting, in one run): the line
the bench prints says so.

On this 2-core CPU machine the whole matrix must fit in 5 minutes, so a cell is a window of
`--window-s` seconds (default 2.5; 4k cells x1.5) after its settle: steady in the sense above,
short in wall time. Cells run engine, router, runner in turn for each (L, c), so machine load
hits the three alike; `--repeats R` runs each path R times per cell, the order reversed every
other round, and reads the mean (the rounds are in the RESULT). Prints the matrix, c32/c1 at
256 tokens (target >= 8), and runner/engine per length (target >= 0.9). `--out FILE` writes
the matrix for `agent-rl audit --decode-table`.
Last line: RESULT {"tok_s": {path: {L: {c: tok/s}}}, "batch_gain_32": ..., "runner_ratio_4k":
..., "runner_ratio": {L: ...}, "running": {path: {L: {c: requests}}}, "load_average":
..., "wall_s": ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl.sglang.client import EngineClient  # noqa: E402
from bench._serving import RouterProcess, ServeThread, metric_sum  # noqa: E402

LENGTHS = (256, 1024, 4096)
CONCURRENCY = (1, 8, 32, 64)
PATHS = ("engine", "router", "runner")
VOCAB = 1000
ENV_ID = "decode-bench"
BASE = [random.Random(0).randrange(10, VOCAB) for _ in range(max(LENGTHS))]
"""Every prompt is a prefix of this one sequence (see the module docstring)."""
OPEN_WAIT_S = 8.0
"""Longest wait for c requests to run before a window opens anyway, at lengths up to 1k (on a
loaded 2-core machine 64 long requests may never all run at once: the cell then measures what
does); at 4k twice as long: 32 requests took 6-8 s to be prefilled and running there, and a
window opened on fewer spent its time prefilling the rest (one read 0 tok/s)."""
IDLE_WAIT_S = 15.0
"""Longest wait, after a cell's requests are aborted, for the engine to hold none: a cell whose
window met the previous cell's requests still leaving read 0 tok/s."""


def start_lengths(length: int, c: int) -> list[int]:
    """Prompt lengths of a cell's first c requests, the same on the three paths: the middles of
    c equal slices of [0, length), so the requests the window meets decode at positions spread
    evenly over the length (at 4k a request outlasts the window, and a CPU engine decodes at
    position 3,500 much slower than at 100: random first positions made one cell's paths
    differ by their draws, 129 / 96 / 69 tok/s at c1). Later requests draw theirs at random."""
    return [max(8, int((i + 0.5) * length / c)) for i in range(c)]


def register_env() -> None:
    """One-turn episodes whose prompt length and completion length follow the task (see the
    module docstring); the reward does not matter."""
    from agent_rl import Env
    from agent_rl.sdk.messages import Message, user
    from agent_rl.sdk.registry import register
    from agent_rl.sdk.tasks import Task, TaskSource

    class Stream(TaskSource):
        def __init__(self, length: int, concurrency: int) -> None:
            self.length, self.concurrency = length, concurrency

        def stream(self, seed: int = 0):  # type: ignore[no-untyped-def]
            # A word is a digit and a space: two tokens of the byte-level tokenizer.
            first = [max(p // 2, 4) for p in start_lengths(self.length, self.concurrency)]
            rng = random.Random(seed)
            i = 0
            while True:
                words = first[i] if i < len(first) else rng.randrange(4, max(self.length // 2, 5))
                yield Task(id=str(i), data={"words": words, "new": self.length - 2 * words})
                i += 1

    class DecodeBench(Env):
        def __init__(self, length: int = 256, concurrency: int = 1) -> None:
            super().__init__()
            self.length, self.concurrency = length, concurrency

        def builtin_tasks(self, split: str = "train") -> TaskSource:
            return Stream(self.length, self.concurrency)

        def initial_messages(self, task: Task) -> list[Message]:
            rng = random.Random(0)  # every prompt a prefix of one text: see the module docstring
            return [user(" ".join(str(rng.randrange(10)) for _ in range(task["words"])))]

        def sampling_params(self) -> dict[str, Any]:
            assert self.task is not None
            return {"max_new_tokens": max(int(self.task["new"]), 1), "ignore_eos": True}

        async def score(self, answer: str) -> float:
            return 0.0

    register(ENV_ID, DecodeBench)


GAUGE_S = 0.25
"""How often a window samples the requests running on the engine: a path that keeps fewer than
c running (a driver's gap between two requests) reads lower for that reason alone."""


async def window(engine_url: str, window_s: float, settle_s: float, c: int, length: int,
                 path: str, gauge: list[int]) -> float:
    """The measured window's decode tokens per second on the engine: it opens once `c`
    requests run there and none waits (at most OPEN_WAIT_S of waiting, twice that at 4k) plus
    `settle_s`, and lasts `window_s`, with the engine's running requests sampled into `gauge`
    every GAUGE_S; then every request is aborted."""
    async with EngineClient(engine_url) as engine:

        async def state() -> tuple[int, int]:
            """(requests running, requests waiting) on the engine."""
            loads = await engine.loads()
            return (sum(x.get("num_running_reqs", 0) for x in loads),
                    sum(x.get("num_waiting_reqs", 0) for x in loads))

        async def running() -> int:
            return (await state())[0]

        async def counter() -> tuple[float, float]:
            """(the decode counter, when it was read: the middle of the request)."""
            t0 = time.monotonic()
            async with engine.session.get(engine_url + "/metrics") as resp:
                resp.raise_for_status()
                text = await resp.text()
            decoded = metric_sum(text, "sglang:realtime_tokens_total", mode="decode")
            return decoded, (t0 + time.monotonic()) / 2

        # Open once c requests decode and none waits to be prefilled (or after the wait).
        t0, wait_s = time.monotonic(), OPEN_WAIT_S * (2 if length >= 4096 else 1)
        while (now := await state()) != (c, 0) and time.monotonic() < t0 + wait_s:
            await asyncio.sleep(0.1)
        if now != (c, 0):
            print(f"    {path} window opens after {wait_s:.0f} s with {now[0]} of {c} running, "
                  f"{now[1]} waiting", flush=True)
        await asyncio.sleep(settle_s)
        d0, w0 = await counter()
        while (left := w0 + window_s - time.monotonic()) > 0:
            await asyncio.sleep(min(GAUGE_S, left))
            if time.monotonic() < w0 + window_s:
                gauge.append(await running())
        d1, w1 = await counter()
        await engine.abort(abort_all=True)
    return (d1 - d0) / (w1 - w0)


async def closed_loop(url: str, engine_url: str, length: int, c: int, window_s: float,
                      settle_s: float, rng: random.Random, gauge: list[int]) -> float:
    stop = asyncio.Event()
    first = start_lengths(length, c)

    async def worker(k: int, client: EngineClient) -> None:
        p = first[k]
        while not stop.is_set():
            prompt = BASE[:p]
            await client.generate(prompt, {"max_new_tokens": length - p, "ignore_eos": True,
                                           "temperature": 1.0}, return_logprob=True)
            p = rng.randrange(8, length)

    async with EngineClient(url) as client:
        tasks = [asyncio.create_task(worker(k, client)) for k in range(c)]
        try:
            tok_s = await window(engine_url, window_s, settle_s, c, length, "engine"
                                 if url == engine_url else "router", gauge)
            stop.set()
            await asyncio.wait(tasks, timeout=30)  # the aborted calls return
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await _abort(engine_url)
    return tok_s


def runner(router: str, engine_url: str, model: Path, tmp: Path, length: int, c: int,
           window_s: float, settle_s: float, gauge: list[int]) -> float:
    from agent_rl.config import Config, EngineConfig, RolloutConfig, StoreConfig

    cfg = Config(
        store=StoreConfig(url=f"sqlite:///{tmp}/runner-{length}-{c}.db"),
        engine=EngineConfig(model=model),
        rollout=RolloutConfig(env=ENV_ID, env_kwargs={"length": length, "concurrency": c},
                              group_size=1,
                              max_concurrent_episodes=c, max_new_tokens=length,
                              max_tokens=length + 256, max_turns=1, router_url=router,
                              max_queued_groups=0, filter_zero_variance=False,
                              engine_sample_s=0),
    )  # fmt: skip
    serve = ServeThread(cfg, max_episodes=None)
    serve.start()
    try:
        tok_s = asyncio.run(window(engine_url, window_s, settle_s, c, length, "runner", gauge))
        time.sleep(1.0)  # the runner's aborted calls return (their episodes fail: engine error)
    finally:
        serve.stop()
        asyncio.run(_abort(engine_url))
        if serve.error is not None and not isinstance(serve.error, asyncio.CancelledError):
            print(f"serve: {serve.error!r}", file=sys.stderr)
    return tok_s


async def _abort(url: str) -> None:
    """Abort every request on the engine and wait until it holds none (IDLE_WAIT_S at most)."""
    async with EngineClient(url) as engine:
        await engine.abort(abort_all=True)
        deadline = time.monotonic() + IDLE_WAIT_S
        while time.monotonic() < deadline:
            loads = await engine.loads()
            if not any(x.get("num_running_reqs") or x.get("num_waiting_reqs") for x in loads):
                return
            await asyncio.sleep(0.1)
        print(f"    the engine still holds requests {IDLE_WAIT_S:.0f} s after the abort",
              flush=True)


def main(args: argparse.Namespace) -> dict[str, Any]:
    import logging

    import anyio

    from agent_rl.config import EngineConfig
    from agent_rl.engine.launcher import EngineServer
    from agent_rl.models import init_model

    # The runner's episodes in flight at each window's end fail as aborted, by design.
    logging.getLogger("agent_rl").setLevel(logging.ERROR)
    t_start = time.monotonic()
    register_env()
    lengths = [int(x) for x in args.lengths.split(",")]
    concurrency = [int(x) for x in args.concurrency.split(",")]
    tok_s: dict[str, dict[str, dict[str, float]]] = {p: {} for p in PATHS}
    running: dict[str, dict[str, dict[str, float]]] = {p: {} for p in PATHS}
    loads = []
    rounds: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = args.model or init_model(tmp / "model", "tiny-dense", seed=0,
                                         max_position_embeddings=max(lengths) * 2)
        engine = EngineServer.from_config(EngineConfig(
            model=model, port=0, log_dir=tmp / "logs",
            max_total_tokens=max(concurrency) * (max(lengths) + 64),
            max_running_requests=max(concurrency),
            extra_args=["--enable-metrics"],  # the decode counter, the meter
            ))
        anyio.run(engine.astart)
        router_proc = RouterProcess([engine.url], None, tmp / "router.log")
        router_proc.start()
        router = router_proc.url
        print(f"engine at {engine.url}, router at {router}; started in "
              f"{time.monotonic() - t_start:.0f} s", flush=True)
        rng = random.Random(0)
        try:
            for length in lengths:
                window = args.window_s * (1.5 if length >= 4096 else 1.0)
                for c in concurrency:
                    reads: dict[str, list[float]] = {p: [] for p in PATHS}
                    gauges: dict[str, list[int]] = {p: [] for p in PATHS}
                    for r in range(args.repeats):
                        # Rounds alternate the order (engine router runner, then back), so a
                        # drift of the machine's speed over the cell weighs on no path alone.
                        for path in PATHS if r % 2 == 0 else PATHS[::-1]:
                            if path == "runner":
                                v = runner(router, engine.url, model, tmp, length, c, window,
                                           args.settle_s, gauges[path])
                            else:
                                url = engine.url if path == "engine" else router
                                v = asyncio.run(closed_loop(url, engine.url, length, c, window,
                                                            args.settle_s, rng, gauges[path]))
                            reads[path].append(v)
                    row = {p: sum(v) / len(v) for p, v in reads.items()}
                    for path in PATHS:
                        tok_s[path].setdefault(str(length), {})[str(c)] = round(row[path], 1)
                        running[path].setdefault(str(length), {})[str(c)] = round(
                            sum(gauges[path]) / max(len(gauges[path]), 1), 1)
                        if args.repeats > 1:
                            rounds.setdefault(f"{length}x{c}", {})[path] = [
                                round(v, 1) for v in reads[path]]
                    loads.append(os.getloadavg()[0])
                    print(f"L={length:5} c={c:3}: " + "  ".join(
                        f"{p} {row[p]:7.1f}" for p in PATHS) + f" tok/s  (load {loads[-1]:.2f}, "
                        f"{time.monotonic() - t_start:.0f} s)", flush=True)
        finally:
            router_proc.stop()
            engine.stop()
    ratio = {str(L): round(tok_s["runner"][str(L)][str(cc)] / tok_s["engine"][str(L)][str(cc)], 3)
             for L in lengths for cc in [32 if 32 in concurrency else concurrency[-1]]
             if tok_s["engine"][str(L)][str(cc)] > 0}
    gain = None
    if 256 in lengths and 1 in concurrency and 32 in concurrency:
        gain = round(tok_s["engine"]["256"]["32"] / max(tok_s["engine"]["256"]["1"], 1e-9), 2)
    tables = (("tok/s", tok_s), ("requests running on the engine (window mean)", running))
    for title, matrix in tables:
        print(f"\n{title} by path, length x concurrency "
              + " ".join(f"c{c:<6}" for c in concurrency))
        for path in PATHS:
            for L in lengths:
                print(f"  {path:7} L={L:5}  " + " ".join(
                    f"{matrix[path][str(L)][str(c)]:7.1f}" for c in concurrency))
    if gain is not None:
        print(f"batching gain c32/c1 at 256 tokens: {gain:.2f}x (target >= 8)")
    print("runner / engine at c32: " + ", ".join(f"{L}: {r:.2f}" for L, r in ratio.items())
          + " (target >= 0.9)")
    if args.out:
        Path(args.out).write_text(json.dumps({"tok_s": tok_s}, indent=1))
        print(f"wrote {args.out} (agent-rl audit --decode-table {args.out})")
    return {"tok_s": tok_s, "batch_gain_32": gain, "runner_ratio_4k": ratio.get("4096"),
            "runner_ratio": ratio, "running": running, "repeats": args.repeats,
            **({"rounds": rounds} if rounds else {}),
            "load_average": round(max(loads), 2) if loads else None,
            "cores": os.cpu_count(), "wall_s": round(time.monotonic() - t_start, 1)}


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(143)  # the `finally`s stop the engine and the router


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model directory (default: a fresh tiny-dense)")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    parser.add_argument("--window-s", type=float, default=2.5, help="measured seconds per cell")
    parser.add_argument("--repeats", type=int, default=1,
                        help="windows per path and cell, in alternating order; reads the mean")
    parser.add_argument("--settle-s", type=float, default=0.5,
                        help="seconds after c requests run before the window opens")
    parser.add_argument("--out", help="write the matrix here (for agent-rl audit)")
    print("RESULT " + json.dumps(main(parser.parse_args())))
