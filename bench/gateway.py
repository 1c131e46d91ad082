"""The agent gateway's cost, side by side in one run: an OpenAI chat-completions call through
`serve`'s gateway vs `/generate` straight to the engine with the same tokens.

One real SGLang engine (tiny-moe on CPU, routing replay on). Gateway side: `serve` runs an
agent env whose every episode makes `--calls` calls (`POST /agents/{key}/v1/chat/completions`,
each extending the conversation with the answer and a new user message, greedy, `max_tokens`
fixed); the gateway renders it, generates through the engine, records the turn in the store
(SQLite) and answers. The agents' HTTP client (aiohttp) runs in a process of its own, as an
agent harness is the user's program and usually runs apart from serve: the env's `run` hands
the episode's base URL and key to that process over a pipe (one line each way per episode) and
waits for its answer, so serve's CPU is serve's and the gateway's, not the client's (which
ran in serve's process before and was ~15% of what was counted there). Direct side: the
stored prompt ids of each of those calls sent to the engine's `/generate` with the same
sampling parameters and options (logprobs, routed experts), from this process (its client
is aiohttp too), episodes at the same concurrency and each one's calls in order. The engine's
prefix cache is flushed before each side. Rounds (9 by default: on 2 cores shared with the
engine, one round's ratio swings 0.9-1.2 with how the engine's batches form, a standard
deviation of ~0.08 around ~1.03-1.05 in 45 quiet rounds, so the median of 5 rounds still moved
by ~0.05 from run to run) alternate gateway and direct; a ratio is the median over rounds of
the round's gateway p50 over its direct p50 (the two sides of a round meet the same machine
load), the other figures are medians over rounds. CPU is per call, from the first episode's hand-off to the last one's
answer: serve's process (serve, the gateway, the store; the engine is a process of its own)
as `cpu_ms_per_call_*`, the agents' process beside it as `agents_cpu_ms_per_call_*`. Each
round prints the machine's 1-minute load average before and after it (the machine is shared:
compare runs at similar load only).
`gateway_overhead_ms_c*` separates the gateway's own cost from the engine's swings: a round's
call p50 minus the p50 of the gateway's calls to the engine in the same round (median over
rounds).

`tokens_exact`: every stored completion is exactly what the engine generates for its stored
prompt (the direct call's greedy output for the same prompt ids equals the stored tokens).

`--dialect messages|responses` has the agents call Anthropic's `/v1/messages` (content blocks
sent back) or OpenAI's `/v1/responses` (each call continuing the previous response by
`previous_response_id`) instead; `--dialect all` measures each of the three at 16, their
rounds in turn (chat's round r, messages', responses', then round r + 1), so the machine's
drift over the run meets every dialect alike.

`--agents-in-serve` runs the agents' client in serve's process instead, as this bench did
before (its CPU then counts as serve's), to compare with figures taken that way.

Last line: RESULT {"p50_ratio_c1", "p50_ratio_c16", "cpu_ms_per_call_c16": {dialect: ms},
"p50_ratio_c16_by_dialect", "agents_cpu_ms_per_call_c16", "agents_in_serve", "tokens_exact",
"load_average", ...}; with `--dialect all`, `p50_ratio_c16` is the largest of the dialects'
ratios (the other `*_c16` figures outside the per-dialect maps are the last dialect's, as
each dialect's own lines print them); targets on a quiet machine: p50 ratio <= 1.1 at 16, CPU
<= 1.5 ms per call for each dialect.

    python bench/gateway.py [--episodes 48] [--calls 4] [--tokens 16] [--rounds 9] [--dialect all]
                            [--agents-in-serve]
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
import anyio

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


async def agent_calls(http: aiohttp.ClientSession, dialect: str, base_url: str, api_key: str,
                      question: str, calls: int, tokens: int) -> list[float]:
    """One episode's agent: `calls` calls, each extending the conversation (the usual agent
    loop), timed from the agent's side; returns their latencies."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    auth = {"Authorization": f"Bearer {api_key}"}
    previous = None
    latencies = []
    for k in range(calls):
        if dialect == "messages":  # Anthropic's Messages: content blocks back, x-api-key
            url, headers = f"{base_url}/messages", {"x-api-key": api_key}
            body: dict[str, Any] = {"model": "policy", "messages": messages, "max_tokens": tokens,
                                    "temperature": 0}
        elif dialect == "responses":  # only the new input after the first call
            url, headers = f"{base_url}/responses", auth
            body = {"model": "policy", "input": messages, "max_output_tokens": tokens,
                    "temperature": 0, "previous_response_id": previous}
        else:
            url, headers = f"{base_url}/chat/completions", auth
            body = {"model": "policy", "messages": messages, "max_tokens": tokens, "temperature": 0}
        t = time.perf_counter()
        async with http.post(url, json=body, headers=headers) as r:
            r.raise_for_status()
            out = await r.json()
        latencies.append(time.perf_counter() - t)
        follow = {"role": "user", "content": f"And {k}+{k}?"}
        if dialect == "messages":
            messages += [{"role": "assistant", "content": out["content"] or ""}, follow]
        elif dialect == "responses":
            previous, messages = out["id"], [follow]
        else:
            messages += [out["choices"][0]["message"], follow]
    return latencies


async def agents_process() -> None:
    """The agents' process (`--agents`): one JSON line per episode on stdin (`n`, `dialect`,
    `base_url`, `api_key`, `question`, `calls`, `tokens`), the episode's agent run at once,
    one JSON line back on stdout when it is done (`n`, `latencies`, this process's CPU time at
    its start and end, or `error`)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout

    async def episode(job: dict[str, Any]) -> None:
        cpu = time.process_time()
        try:
            lat = await agent_calls(http, job["dialect"], job["base_url"], job["api_key"],
                                    job["question"], job["calls"], job["tokens"])
            reply: dict[str, Any] = {"n": job["n"], "latencies": lat,
                                     "cpu": [cpu, time.process_time()]}
        except Exception as e:
            reply = {"n": job["n"], "error": repr(e)}
        out.write(json.dumps(reply) + "\n")
        out.flush()

    tasks = set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        while line := await reader.readline():
            task = loop.create_task(episode(json.loads(line)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)


class Agents:
    """serve's side of the agents' process: `run` hands it an episode and waits for its end."""

    def __init__(self) -> None:
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.count = 0

    async def start(self) -> Agents:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--agents", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE)  # fmt: skip
        self.reader = asyncio.get_running_loop().create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            reply = json.loads(line)
            self.waiting.pop(reply["n"]).set_result(reply)
        for f in self.waiting.values():
            f.set_exception(RuntimeError("the agents' process exited"))

    async def run(self, **job: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.count += 1
        future = self.waiting[self.count] = asyncio.get_running_loop().create_future()
        self.proc.stdin.write(json.dumps({"n": self.count, **job}).encode() + b"\n")
        reply = await future
        if "error" in reply:
            raise RuntimeError(f"the agent failed: {reply['error']}")
        return reply

    async def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        await self.proc.wait()
        await self.reader


@register("bench-gateway-agent")
class AgentLoop(AgentEnv):
    """CALLS_PER_EPISODE calls per episode, made by the agents' process (`agent_calls`)."""

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        return ListTasks([Task(id=str(i), data={"question": f"What is {i}+{i * 7}?"}) for i in range(TASKS)],
                         shuffle=False)  # fmt: skip

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        WINDOW[0] = min(WINDOW[0], time.process_time())
        job = dict(dialect=DIALECT[0], base_url=base_url, api_key=api_key,
                   question=task["question"], calls=CALLS_PER_EPISODE, tokens=TOKENS)
        if IN_SERVE:  # --agents-in-serve: the agent's client in serve's process, counted there
            reply = {"latencies": await agent_calls(IN_SERVE[0], **job), "cpu": [0.0, 0.0]}
        else:
            reply = await AGENTS.run(**job)
        WINDOW[1] = max(WINDOW[1], time.process_time())
        LATENCIES.extend(reply["latencies"])
        AGENT_CPU[0] = min(AGENT_CPU[0], reply["cpu"][0])
        AGENT_CPU[1] = max(AGENT_CPU[1], reply["cpu"][1])
        return ""

    async def score(self, task: Task, result: Any, transcript: list[dict[str, Any]]) -> float:
        return 0.0


AGENTS: Agents
"""The agents' process."""
IN_SERVE: list[aiohttp.ClientSession] = []
"""With --agents-in-serve: the agents' client, in serve's process."""
CALLS_PER_EPISODE = 4
DIALECT = ["chat"]
"""The API the agents call: chat (completions), messages (Anthropic's), responses."""
WINDOW = [float("inf"), 0.0]
"""serve's process's CPU time at the first episode's hand-off and the last one's answer."""
AGENT_CPU = [float("inf"), 0.0]
"""The agents' process's CPU time at the first episode's start and the last one's end."""


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
                        run: str) -> tuple[list[float], float, float, list[float]]:
    """Latencies of every call, serve's and the agents' process's CPU per call from the first
    episode's hand-off to the last one's answer (serve's start and end left out), and the
    latencies of the gateway's calls to the engine."""
    from agent_rl.app.serve import serve

    LATENCIES.clear()
    ENGINE_CALLS.clear()
    WINDOW[:] = [float("inf"), 0.0]
    AGENT_CPU[:] = [float("inf"), 0.0]
    async with EngineClient(url) as engine:
        await engine.flush_cache()  # both sides start from a cold prefix cache
    if IN_SERVE:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            IN_SERVE[:] = [http]
            summary = await serve(config(db, url, model, c, run), max_episodes=episodes)
    else:
        summary = await serve(config(db, url, model, c, run), max_episodes=episodes)
    assert summary.failed == 0, "an episode failed"
    n = len(LATENCIES)
    serve_cpu, agents_cpu = (WINDOW[1] - WINDOW[0]) / n, (AGENT_CPU[1] - AGENT_CPU[0]) / n
    return list(LATENCIES), serve_cpu, agents_cpu, list(ENGINE_CALLS)


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

    global TOKENS, CALLS_PER_EPISODE, AGENTS
    TOKENS, CALLS_PER_EPISODE = args.tokens, args.calls
    if args.agents_in_serve:
        IN_SERVE.append(None)  # type: ignore[arg-type]  # set per round
    else:
        AGENTS = await Agents().start()
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
    # The series of one group take their rounds in turn (each dialect's round r, then each one's
    # round r + 1, ...): the machine's speed drifts over minutes, and a series measured after
    # another read higher for that alone (with the dialects one after the other, the first one's
    # ratio was the lowest in most runs, whichever dialect went first).
    groups = [[(d, 16) for d in dialects]] if len(dialects) > 1 else [[(dialects[0], 1)], [(dialects[0], 16)]]
    try:
        for group in groups:
            measured: dict[tuple[str, int], dict[str, list[float]]] = {
                series: {k: [] for k in ("gw", "direct", "gw_cpu", "direct_cpu", "overhead", "agent_cpu")}
                for series in group
            }  # fmt: skip
            for r in range(args.rounds):
                for dialect, c in group:
                    m = measured[(dialect, c)]
                    DIALECT[0] = dialect
                    loads.append(load_average())
                    run, db = f"{dialect}-c{c}-r{r}", work / f"{dialect}-c{c}-r{r}.db"
                    lat, cpu, agents, engine_calls = await gateway_round(db, engine.url, model,
                                                                         episodes[c], c, run)
                    m["gw"].append(statistics.median(lat))
                    m["overhead"].append(m["gw"][-1] - statistics.median(engine_calls))
                    m["gw_cpu"].append(cpu)
                    m["agent_cpu"].append(agents)
                    calls = await stored_calls(db, run)
                    lat, cpu, same = await direct_round(engine.url, calls, c)
                    m["direct"].append(statistics.median(lat))
                    m["direct_cpu"].append(cpu)
                    exact &= same
                    loads.append(load_average())
                    print(f"{dialect} c={c} round {r} (load {loads[-2]:.1f}-{loads[-1]:.1f}): "
                          f"gateway p50 {m['gw'][-1] * 1e3:.1f} ms "
                          f"({m['gw_cpu'][-1] * 1e3:.2f} ms serve CPU/call, "
                          f"agents {m['agent_cpu'][-1] * 1e3:.2f}, "
                          f"{m['overhead'][-1] * 1e3:+.1f} ms over its engine calls' p50), "
                          f"direct p50 {m['direct'][-1] * 1e3:.1f} ms ({m['direct_cpu'][-1] * 1e3:.1f} ms CPU/call), "
                          f"tokens exact: {same}", flush=True)  # fmt: skip
            for (dialect, c), m in measured.items():
                # Each round's ratio pairs sides that ran back to back on the same machine load.
                result[f"p50_ratio_c{c}"] = round(statistics.median(g / d for g, d in zip(m["gw"], m["direct"])), 3)
                result[f"gateway_p50_ms_c{c}"] = round(statistics.median(m["gw"]) * 1e3, 1)
                result[f"direct_p50_ms_c{c}"] = round(statistics.median(m["direct"]) * 1e3, 1)
                result[f"gateway_overhead_ms_c{c}"] = round(statistics.median(m["overhead"]) * 1e3, 1)
                result[f"gateway_cpu_ms_per_call_c{c}"] = round(statistics.median(m["gw_cpu"]) * 1e3, 2)
                result[f"direct_cpu_ms_per_call_c{c}"] = round(statistics.median(m["direct_cpu"]) * 1e3, 2)
                result[f"agents_cpu_ms_per_call_c{c}"] = round(statistics.median(m["agent_cpu"]) * 1e3, 2)
                if c == 16:
                    per_dialect[dialect] = result[f"gateway_cpu_ms_per_call_c{c}"]
                    result.setdefault("p50_ratio_c16_by_dialect", {})[dialect] = result["p50_ratio_c16"]
    finally:
        engine.stop()
        if not args.agents_in_serve:
            await AGENTS.close()
    result["cpu_ms_per_call_c16"] = per_dialect
    if len(dialects) > 1:  # the target holds for every dialect: the headline is the worst one's
        result["p50_ratio_c16"] = max(result["p50_ratio_c16_by_dialect"].values())
    result["agents_in_serve"] = args.agents_in_serve
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
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dialect", choices=["chat", "messages", "responses", "all"], default="chat",
                        help="the API the agents call; all: each of them, at concurrency 16")
    parser.add_argument("--agents-in-serve", action="store_true",
                        help="run the agents' client in serve's process (how this bench measured "
                             "before: its CPU counted as serve's)")
    # The agents' process (`agents_process`), started by the bench itself.
    parser.add_argument("--agents", action="store_true", help=argparse.SUPPRESS)
    started = time.time()
    if "--agents" in sys.argv[1:]:
        asyncio.run(agents_process())
        sys.exit(0)
    # Every /generate call of this process (the direct side's too; cleared before each
    # gateway round) into ENGINE_CALLS.
    on_generate(lambda sent, returned, _: ENGINE_CALLS.append(returned - sent))
    from agent_rl.app.serve import LOOP

    # serve's own event loop (`agent-rl serve`'s), so the bench measures what users run.
    out = anyio.run(main, parser.parse_args(), backend_options=LOOP)
    print(f"wall {time.time() - started:.0f} s")
    print("RESULT " + json.dumps(out))
