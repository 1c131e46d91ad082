"""Runner overhead: `serve` (scheduler, runners, router, store, env) vs the bare engine
generating the same tokens with the same concurrency, in one run.

1. One SGLang engine (tiny-dense) and the router in front of it are started once.
2. `serve` runs N calculator episodes through the router into a fresh SQLite store; model
   tokens/s = completion tokens generated / wall time.
3. The bare engine replays exactly those generations (same prompt ids, same completion
   lengths via ignore_eos) straight to the engine, with the same concurrency.
runner_ratio = serve tokens/s / bare tokens/s (target >= 0.9).
Last line: RESULT {"runner_ratio", "serve_tok_s", "bare_tok_s", "serve_episodes_s"}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl.config import Config, EngineConfig, RolloutConfig, StoreConfig  # noqa: E402
from agent_rl.engine.client import EngineClient  # noqa: E402
from agent_rl.engine.launcher import EngineServer  # noqa: E402
from agent_rl.models import init_model  # noqa: E402
from agent_rl.serve import serve  # noqa: E402
from agent_rl.store import Store  # noqa: E402
from router.app import Router  # noqa: E402


async def replay(url: str, generations: list[tuple[list[int], int]], concurrency: int) -> float:
    """Generate the same completions straight from the engine; returns seconds."""
    limiter = anyio.CapacityLimiter(concurrency)
    async with EngineClient(url) as client:

        async def one(prompt: list[int], n: int) -> None:
            async with limiter:
                await client.generate(prompt, {"max_new_tokens": n, "ignore_eos": True, "temperature": 1.0})

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for prompt, n in generations:
                tg.start_soon(one, prompt, n)
        return time.perf_counter() - t0


async def main(episodes: int, concurrency: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        model = init_model(Path(tmp) / "model", "tiny-dense", seed=0)
        cfg = Config(
            store=StoreConfig(url=f"sqlite:///{tmp}/store.db"),
            engine=EngineConfig(model=model, port=0, log_dir=Path(tmp) / "logs"),
            rollout=RolloutConfig(env="calculator", group_size=8, max_concurrent_episodes=concurrency,
                                  max_new_tokens=64, max_turns=2),
        )
        engine = await EngineServer.from_config(cfg.engine).astart()
        try:
            async with Router(cfg.router.model_copy(update={"port": 0}), workers=[engine.url]) as router:
                cfg.rollout.router_url = router.url
                # Warm up the engine and the prefix cache path once.
                await serve(cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": "warmup"})}),
                            max_episodes=8)
                t0 = time.perf_counter()
                await serve(cfg, max_episodes=episodes)
                serve_s = time.perf_counter() - t0
            async with await Store.open(cfg.store, create=True) as store:
                run = await store.run_id(cfg.run.name)
                generations = []
                for e in await store.list_episodes(run_id=run, limit=100_000):
                    tokens = await store.episode_tokens(e.id)
                    for t in (await store.get_episode(e.id)).turns:
                        generations.append((tokens.token_ids[: t.span_start + t.num_prompt_tokens].tolist(),
                                            t.num_tokens - t.num_prompt_tokens))
            completion_tokens = sum(n for _, n in generations)
            bare_s = await replay(engine.url, generations, concurrency)
        finally:
            engine.stop()
    serve_tok_s, bare_tok_s = completion_tokens / serve_s, completion_tokens / bare_s
    print(f"{episodes} episodes, {len(generations)} generations, {completion_tokens} completion tokens, "
          f"concurrency {concurrency}")
    print(f"serve: {serve_s:6.1f} s  {serve_tok_s:7.1f} tok/s  {episodes / serve_s:5.2f} episodes/s")
    print(f"bare:  {bare_s:6.1f} s  {bare_tok_s:7.1f} tok/s")
    return {
        "runner_ratio": round(serve_tok_s / bare_tok_s, 3),
        "serve_tok_s": round(serve_tok_s, 1),
        "bare_tok_s": round(bare_tok_s, 1),
        "serve_episodes_s": round(episodes / serve_s, 3),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    result = anyio.run(main, args.episodes, args.concurrency)
    print("RESULT " + json.dumps(result))
