"""Sustained, batched decode throughput of the engine at real completion lengths.

Rollout cost is decode at concurrency, not one short request: this starts one SGLang server on
the tiny-dense preset (or uses --url), then for each concurrency c in 1, 8, 32 runs c workers,
each sending `--rounds` sequential /generate requests of 8 random prompt tokens and exactly
`--tokens` completion tokens (ignore_eos), and reports completion tokens per wall second.
The ratio c32 / c1 is the batching gain the rollout side relies on (target >= 8x on 2 cores).

The levels run in turn `--repeats` times and each keeps its best pass (a shared machine only
slows a pass down). Usage: python bench/engine.py [--url URL] [--model DIR] [--tokens 256]
[--rounds 2] [--repeats 2]
Last line: RESULT {"tok_s_c1": ..., "tok_s_c8": ..., "tok_s_c32": ..., "batch32_vs_1": ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from agent_rl.config import load_config
from agent_rl.sglang.client import EngineClient
from agent_rl.engine.launcher import EngineServer
from agent_rl.models import init_model

LEVELS = (1, 8, 32)


async def level(client: EngineClient, c: int, tokens: int, rounds: int, rng: random.Random) -> dict:
    done: list[tuple[int, float]] = []
    vocab = 1000

    async def worker() -> None:
        for _ in range(rounds):
            prompt = [rng.randrange(10, vocab) for _ in range(8)]
            t = time.perf_counter()
            g = await client.generate(
                prompt, {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 1.0},
                return_logprob=True,
            )  # fmt: skip
            done.append((len(g.output_ids), time.perf_counter() - t))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(c)))
    wall = time.perf_counter() - t0
    total = sum(n for n, _ in done)
    return {
        "concurrency": c,
        "requests": len(done),
        "tokens": total,
        "wall_s": wall,
        "tok_s": total / wall,
        "per_request_tok_s": sum(n / d for n, d in done) / len(done),
    }


async def bench(url: str, tokens: int, rounds: int, repeats: int) -> dict[int, dict]:
    """Run the levels `repeats` times in turn; keep each level's best run. Other processes on
    a shared machine only ever slow a run down, so the best is the least disturbed one."""
    rng = random.Random(0)
    best: dict[int, dict] = {}
    async with EngineClient(url) as client:
        await client.generate([5, 6, 7], {"max_new_tokens": 16})  # warm-up
        for _ in range(repeats):
            for c in LEVELS:
                r = await level(client, c, tokens, rounds, rng)
                if c not in best or r["tok_s"] > best[c]["tok_s"]:
                    best[c] = r
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="an already running SGLang server (default: start one)")
    ap.add_argument("--model", type=Path, help="model directory (default: a fresh tiny-dense)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="requests per worker and level")
    ap.add_argument("--repeats", type=int, default=2, help="passes over the levels; best kept")
    args = ap.parse_args()

    with ExitStack() as stack:
        url = args.url
        if url is None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            model = args.model or init_model(tmp / "tiny-dense", "tiny-dense")
            cfg = load_config().engine
            server = EngineServer.from_config(cfg, model=model, port=0, log_dir=tmp)
            t = time.perf_counter()
            stack.enter_context(server)
            print(
                f"engine ({server.device}) ready in {time.perf_counter() - t:.1f} s at {server.url}"
            )
            url = server.url
        results = asyncio.run(bench(url, args.tokens, args.rounds, args.repeats))

    header = ("concurrency", "requests", "tokens", "wall s", "tok/s", "per-request tok/s")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (11, 8, 7, 7, 8, 17), strict=True)))
    for r in results.values():
        print(
            f"{r['concurrency']:>11} {r['requests']:>8} {r['tokens']:>7} {r['wall_s']:>7.2f} "
            f"{r['tok_s']:>8.1f} {r['per_request_tok_s']:>17.1f}"
        )
    ratio = results[32]["tok_s"] / results[1]["tok_s"]
    print(f"c32 / c1 = {ratio:.2f} (target >= 8)")
    print("RESULT " + json.dumps({
        "tok_s_c1": round(results[1]["tok_s"], 1),
        "tok_s_c8": round(results[8]["tok_s"], 1),
        "tok_s_c32": round(results[32]["tok_s"], 1),
        "batch32_vs_1": round(ratio, 2),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
