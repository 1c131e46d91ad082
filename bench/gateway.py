"""The agent gateway's cost, side by side in one run: an OpenAI chat-completions call through
`serve`'s gateway vs `/generate` straight to the engine with the same tokens.

One real SGLang engine (tiny-moe on CPU, routing replay on). Gateway side: `serve` runs an
agent env whose every episode makes `--calls` calls (`POST /agents/{key}/v1/chat/completions`,
each extending the conversation with the answer and a new user message, greedy, `max_tokens`
fixed) with aiohttp (the direct side's client too), timing each call; the gateway renders it,
generates through the engine, records the turn in the store (SQLite) and answers. Direct side:
the stored prompt ids of each of those calls sent to the engine's `/generate` with the same
sampling parameters and options (logprobs, routed experts), from the same process, episodes at
the same concurrency and each one's calls in order. The engine's prefix cache is flushed
before each side. Rounds (5 by default: on 2 cores shared with the engine, one round's ratio
swings 0.8-1.25 with how the engine's batches form) alternate gateway and direct; a ratio is the
median over rounds of the round's gateway p50 over its direct p50 (the two sides of a round
meet the same machine load), the other figures are medians over rounds. CPU is this process's
(for the gateway: serve, the gateway and the agents' client; the engine is a process of its
own), per call, from the first call's start to the last one's end. Each round prints the
machine's 1-minute load average before and after it (the machine is shared: compare runs at
similar load only).
`gateway_overhead_ms_c*` separates the gateway's own cost from the engine's swings: a round's
call p50 minus the p50 of the gateway's calls to the engine in the same round (median over
rounds).

`tokens_exact`: every stored completion is exactly what the engine generates for its stored
prompt (the direct call's greedy output for the same prompt ids equals the stored tokens).

`--dialect messages|responses` has the agents call Anthropic's `/v1/messages` (content blocks
sent back) or OpenAI's `/v1/responses` (each call continuing the previous response by
`previous_response_id`) instead; `--dialect all` measures each of the three at 16.

Last line: RESULT {"p50_ratio_c1", "p50_ratio_c16", "cpu_ms_per_call_c16": {dialect: ms},
"p50_ratio_c16_by_dialect", "tokens_exact", "load_average", ...}; targets on a quiet machine:
p50 ratio <= 1.1 at 16, CPU <= 1.5 ms per call for each dialect.

    python bench/gateway.py [--episodes 48] [--calls 4] [--tokens 16] [--rounds 5] [--dialect all]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl.sdk.agent import AgentEnv
from agent_rl.config import Config, EngineConfig, RolloutConfig, StoreConfig, TrainerConfig
from agent_rl.sglang.client import EngineClient
from agent_rl.sdk.registry import register
from agent_rl.sdk.tasks import ListTasks, Task, TaskSource
from bench._serving import on_generate

LATENCIES: list[float] = []
ENGINE_CALLS: list[float] = []
"""Latencies of the gateway's own /generate calls (inside serve), the engine's share of a call."""
TOKENS = 16
TASKS = 1024
"""Distinct questions (more than any round's calls, so no prompt repeats in a round)."""


@register("bench-gateway-agent")
class AgentLoop(AgentEnv):
    """CALLS_PER_EPISODE chat-completions calls per episode, each extending the conversation
    (the usual agent loop), timed from the agent's side."""

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        return ListTasks([Task(id=str(i), data={"question": f"What is {i}+{i * 7}?"}) for i in range(TASKS)],
                         shuffle=False)  # fmt: skip

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]
        auth = {"Authorization": f"Bearer {api_key}"}
        previous = None
        for k in range(CALLS_PER_EPISODE):
            if DIALECT[0] == "messages":  # Anthropic's Messages: content blocks back, x-api-key
                url, headers = f"{base_url}/messages", {"x-api-key": api_key}
                body: dict[str, Any] = {"model": "policy", "messages": messages, "max_tokens": TOKENS, "temperature": 0}
            elif DIALECT[0] == "responses":  # only the new input after the first call
                url, headers = f"{base_url}/responses", auth
                body = {"model": "policy", "input": messages, "max_output_tokens": TOKENS, "temperature": 0,
                        "previous_response_id": previous}  # fmt: skip
            else:
                url, headers = f"{base_url}/chat/completions", auth
                body = {"model": "policy", "messages": messages, "max_tokens": TOKENS, "temperature": 0}
            t, cpu = time.perf_counter(), time.process_time()
            WINDOW[0] = min(WINDOW[0], cpu)
            async with HTTP.post(url, json=body, headers=headers) as r:
                r.raise_for_status()
                out = await r.json()
            LATENCIES.append(time.perf_counter() - t)
            WINDOW[1] = max(WINDOW[1], time.process_time())
            follow = {"role": "user", "content": f"And {k}+{k}?"}
            if DIALECT[0] == "messages":
                messages += [{"role": "assistant", "content": out["content"] or ""}, follow]
            elif DIALECT[0] == "responses":
                previous, messages = out["id"], [follow]
            else:
                messages += [out["choices"][0]["message"], follow]
        return ""

    async def score(self, task: Task, result: Any, transcript: list[dict[str, Any]]) -> float:
        return 0.0


HTTP: aiohttp.ClientSession
"""The agents' HTTP client: aiohttp, as the direct side's EngineClient, so both sides pay for
the same client."""
CALLS_PER_EPISODE = 4
DIALECT = ["chat"]
"""The API the agents call: chat (completions), messages (Anthropic's), responses."""
WINDOW = [float("inf"), 0.0]
"""This process's CPU time at the first call's start and the last call's end."""


def load_average() -> float:
    """The machine's 1-minute load average."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def config(db: Path, url: str, model: Path, concurrency: int, run: str) -> Config:
    return Config(
        run={"name": run}, store=StoreConfig(url=f"sqlite:///{db}"),
        engine=EngineConfig(model=model, moe_routing_replay=True),
        rollout=RolloutConfig(env="bench-gateway-agent", router_url=url, group_size=1,
                              max_concurrent_episodes=concurrency, max_queued_groups=0,
                              max_new_tokens=TOKENS, max_tokens=4096, engine_sample_s=0),
        trainer=TrainerConfig(max_staleness=1000),
    )  # fmt: skip


async def gateway_round(db: Path, url: str, model: Path, episodes: int, c: int,
                        run: str) -> tuple[list[float], float, list[float]]:
    """Latencies of every call, this process's CPU per call from the first call's start to the
    last one's end (serve's start and end left out), and the latencies of the gateway's calls
    to the engine."""
    from agent_rl.app.serve import serve

    global HTTP
    LATENCIES.clear()
    ENGINE_CALLS.clear()
    WINDOW[:] = [float("inf"), 0.0]
    async with EngineClient(url) as engine:
        await engine.flush_cache()  # both sides start from a cold prefix cache
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as HTTP:
        summary = await serve(config(db, url, model, c, run), max_episodes=episodes)
    assert summary.failed == 0, "an episode failed"
    return list(LATENCIES), (WINDOW[1] - WINDOW[0]) / len(LATENCIES), list(ENGINE_CALLS)


async def stored_calls(db: Path, run: str) -> list[list[tuple[list[int], list[int]]]]:
    """Per episode, (prompt ids, completion ids) of every call it recorded, in order."""
    from agent_rl.store import Store

    out = []
    async with await Store.open(StoreConfig(url=f"sqlite:///{db}")) as store:
        run_id = await store.run_id(run)
        for e in await store.list_episodes(run_id=run_id, limit=100_000):
            ids = (await store.episode_tokens(e.id)).token_ids.tolist()
            out.append([(ids[: t.span_start + t.num_prompt_tokens], ids[t.span_start + t.num_prompt_tokens:
                                                                         t.span_start + t.num_tokens])
                        for t in (await store.get_episode(e.id)).turns])  # fmt: skip
    return out


async def direct_round(url: str, episodes: list[list[tuple[list[int], list[int]]]], c: int) -> tuple[list[float], float, bool]:
    """The same calls straight to /generate: episodes `c` at a time, each one's calls in order."""
    gate = asyncio.Semaphore(c)
    latencies: list[float] = []
    exact = True
    async with EngineClient(url) as client:
        await client.flush_cache()
        cpu = time.process_time()

        async def episode(i: int, calls: list[tuple[list[int], list[int]]]) -> None:
            nonlocal exact
            async with gate:
                for k, (prompt, completion) in enumerate(calls):
                    t = time.perf_counter()
                    gen = await client.generate(prompt, {"temperature": 0, "top_p": 1.0, "max_new_tokens": TOKENS},
                                                rid=f"direct-{c}-{i}-{k}-{time.monotonic_ns()}", return_logprob=True,
                                                return_routed_experts=True)  # fmt: skip
                    latencies.append(time.perf_counter() - t)
                    exact &= gen.output_ids == completion

        await asyncio.gather(*(episode(i, calls) for i, calls in enumerate(episodes)))
        cpu = time.process_time() - cpu
    return latencies, cpu / len(latencies), exact


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from agent_rl.config import load_config
    from agent_rl.engine.launcher import EngineServer
    from agent_rl.models import init_model

    global TOKENS, CALLS_PER_EPISODE
    TOKENS, CALLS_PER_EPISODE = args.tokens, args.calls
    work = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    model = init_model(work / "tiny-moe", "tiny-moe", seed=0)
    engine = EngineServer(model, venv=load_config().engine.venv, log_dir=work / "logs", moe_routing_replay=True,
                          max_running_requests=64)  # fmt: skip
    await engine.astart()
    result: dict[str, Any] = {}
    exact = True
    loads: list[float] = []
    # At 1 a call's latency hardly varies; at 16 it follows how the engine's batches form, so
    # a round there makes more calls.
    episodes = {1: max(args.episodes // 4, 4), 16: args.episodes}
    dialects = ["chat", "messages", "responses"] if args.dialect == "all" else [args.dialect]
    per_dialect: dict[str, float] = {}
    try:
        for dialect, c in [(d, c) for d in dialects for c in ((16,) if len(dialects) > 1 else (1, 16))]:
            DIALECT[0] = dialect
            gw, direct, gw_cpu, direct_cpu, overhead = [], [], [], [], []
            for r in range(args.rounds):
                loads.append(load_average())
                run, db = f"{dialect}-c{c}-r{r}", work / f"{dialect}-c{c}-r{r}.db"
                lat, cpu, engine_calls = await gateway_round(db, engine.url, model, episodes[c],
                                                             c, run)
                gw.append(statistics.median(lat))
                overhead.append(gw[-1] - statistics.median(engine_calls))
                gw_cpu.append(cpu)
                calls = await stored_calls(db, run)
                lat, cpu, same = await direct_round(engine.url, calls, c)
                direct.append(statistics.median(lat))
                direct_cpu.append(cpu)
                exact &= same
                loads.append(load_average())
                print(f"{dialect} c={c} round {r} (load {loads[-2]:.1f}-{loads[-1]:.1f}): "
                      f"gateway p50 {gw[-1] * 1e3:.1f} ms ({gw_cpu[-1] * 1e3:.1f} ms CPU/call, "
                      f"{overhead[-1] * 1e3:+.1f} ms over its engine calls' p50), "
                      f"direct p50 {direct[-1] * 1e3:.1f} ms ({direct_cpu[-1] * 1e3:.1f} ms CPU/call), "
                      f"tokens exact: {same}", flush=True)  # fmt: skip
            # Each round's ratio pairs sides that ran back to back on the same machine load.
            result[f"p50_ratio_c{c}"] = round(statistics.median(g / d for g, d in zip(gw, direct)), 3)
            result[f"gateway_p50_ms_c{c}"] = round(statistics.median(gw) * 1e3, 1)
            result[f"direct_p50_ms_c{c}"] = round(statistics.median(direct) * 1e3, 1)
            result[f"gateway_overhead_ms_c{c}"] = round(statistics.median(overhead) * 1e3, 1)
            result[f"gateway_cpu_ms_per_call_c{c}"] = round(statistics.median(gw_cpu) * 1e3, 2)
            result[f"direct_cpu_ms_per_call_c{c}"] = round(statistics.median(direct_cpu) * 1e3, 2)
            if c == 16:
                per_dialect[dialect] = result[f"gateway_cpu_ms_per_call_c{c}"]
                result.setdefault("p50_ratio_c16_by_dialect", {})[dialect] = result["p50_ratio_c16"]
    finally:
        engine.stop()
    result["cpu_ms_per_call_c16"] = per_dialect
    result["tokens_exact"] = exact
    result["load_average"] = [min(loads), max(loads)]
    return result


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=48,
                        help="episodes per round at concurrency 16 (a quarter of it at 1)")
    parser.add_argument("--calls", type=int, default=4, help="calls per episode")
    parser.add_argument("--tokens", type=int, default=16, help="max_tokens of every call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dialect", choices=["chat", "messages", "responses", "all"], default="chat",
                        help="the API the agents call; all: each of them, at concurrency 16")
    started = time.time()
    # Every /generate call of this process (the direct side's too; cleared before each
    # gateway round) into ENGINE_CALLS.
    on_generate(lambda sent, returned, _: ENGINE_CALLS.append(returned - sent))
    out = asyncio.run(main(parser.parse_args()))
    print(f"wall {time.time() - started:.0f} s")
    print("RESULT " + json.dumps(out))
