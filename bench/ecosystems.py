"""A verifiers v1 environment's cost in serve, side by side in one run: out of process in a
long-lived env server, out of process with a process per episode, and the same tiny env
written with agent-rl's SDK (an `AgentEnv` in serve's process), on one engine.

In process is not a side: verifiers 0.4.0 pins `openai<3` and agent-rl's venv has openai 3, so
verifiers cannot be imported by serve. The SDK env stands in for it: the same two calls per
episode (`tests/ecosystems/verifiers_modules/vf_tiny_echo.py`: a prompt, `max_tokens` 6, then
"Again." and a second answer), the same reward, made from serve's process with the `openai`
client, every call through the same gateway. Each side's harness makes an `openai` client per
episode and neither loads the CA bundle per episode: the env server shares one TLS context among
the clients made in it (runner.py), and the SDK env's clients share one too (as verifiers run in
serve's process would: the same bridge). `tokens_per_call` (the stored model tokens over calls)
shows the sides generate alike.

One real SGLang engine (tiny-moe on CPU, routing replay on). Each side runs `serve` with
`--episodes` episodes, `--concurrency` at a time, after a warm-up (the env server started and
the task rows listed, for both verifiers sides, before the clock starts). `calls_per_s`: the
recorded turns over the window from the first episode's start to the last one's end (the
store's times). `cpu_ms_per_call`: this process's CPU (serve, its gateway, and for the SDK side
the agent) during the serve call, per call. `env_cpu_ms_per_call`: the verifiers side's own
processes (the env server, or the per-episode processes) per call; `total_cpu_ms_per_call` the
sum. The env server and SDK sides run in turn, `--rounds` times (alternating order), the
figures medians over rounds; the process-per-episode side (seconds of CPU per episode) runs
once, last, with `--process-episodes` episodes. The machine's 1-minute load average is printed
before and after each side (a shared machine: compare runs at similar load only).

Last line: RESULT {"calls_per_s": {side: ...}, "cpu_ms_per_call": {side: ...},
"ratio_out_of_process": server / SDK calls/s (the median of each round's ratio),
"ratio_server_over_process", ...}; target: the env server >= 0.8x the SDK env's calls/s.

    python bench/ecosystems.py [--episodes 32] [--concurrency 8] [--rounds 5]
                               [--process-episodes 2]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import resource
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl.config import Config, EngineConfig, RolloutConfig, StoreConfig, TrainerConfig
from agent_rl.sdk.agent import AgentEnv
from agent_rl.sdk.registry import make, register
from agent_rl.sdk.rewards import Reward
from agent_rl.sdk.tasks import ListTasks, Task, TaskSource
from bench._proc import cpu_s
from envs.verifiers_env.env import PYTHON_VAR

ROOT = Path(__file__).resolve().parents[1]
MODULES = ROOT / "tests" / "ecosystems" / "verifiers_modules"
PROMPTS = [("Say hi.", 0.0), ("Count to three.", 0.25)]
"""As vf_tiny_echo.PROMPTS: (prompt, base reward)."""
MAX_TOKENS = 6
"""As vf_tiny_echo.MAX_TOKENS."""


@register("bench-ecosystems-sdk")
class EchoAgent(AgentEnv):
    """vf_tiny_echo written with agent-rl's SDK: two calls, reward tokens/100 + base."""

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        return ListTasks([Task(id=f"echo-{i}", data={"prompt": p, "base": b})
                          for i, (p, b) in enumerate(PROMPTS)])  # fmt: skip

    async def run(self, base_url: str, api_key: str, task: Task) -> int:
        from openai import AsyncOpenAI, DefaultAsyncHttpxClient

        tokens = 0
        http = DefaultAsyncHttpxClient(verify=tls_context())
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http) as client:
            messages: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
            for follow_up in ("Again.", None):
                r = await client.chat.completions.create(
                    model="policy", messages=messages, max_tokens=MAX_TOKENS)  # type: ignore[arg-type]
                tokens += r.usage.completion_tokens if r.usage else 0
                answer = r.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": answer})
                if follow_up is not None:
                    messages.append({"role": "user", "content": follow_up})
        return tokens

    async def score(self, task: Task, result: Any, transcript: list[dict[str, Any]]) -> Reward:
        return Reward(value=result / 100 + task["base"])


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One TLS context for the SDK env's clients, as the env server shares one among its own."""
    return ssl.create_default_context()


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def sides(python: str) -> dict[str, tuple[str, dict[str, Any]]]:
    vf = {"python": python, "paths": [str(MODULES)]}
    return {"verifiers_server": ("verifiers:vf_tiny_echo", {**vf, "servers": 1}),
            "verifiers_process": ("verifiers:vf_tiny_echo", {**vf, "servers": 0}),
            "sdk": ("bench-ecosystems-sdk", {})}  # fmt: skip


def config(db: Path, url: str, model: Path, env: str, kwargs: dict[str, Any], c: int) -> Config:
    return Config(
        store=StoreConfig(url=f"sqlite:///{db}"),
        engine=EngineConfig(model=model, moe_routing_replay=True),
        rollout=RolloutConfig(env=env, env_kwargs=kwargs, router_url=url, group_size=2,
                              max_concurrent_episodes=c, max_new_tokens=MAX_TOKENS,
                              max_tokens=1024, max_turns=3),
        trainer=TrainerConfig(max_staleness=1000),
    )  # fmt: skip


async def side(db: Path, url: str, model: Path, env_id: str, kwargs: dict[str, Any],
               episodes: int, c: int) -> dict[str, float]:  # fmt: skip
    from agent_rl.app.serve import serve
    from agent_rl.store import Store

    env = make(env_id, **kwargs)
    env.task_source()  # warm: the env server started, the rows listed (cached per process)
    pool = getattr(env, "pool", None)
    server_pid = pool.servers[0].ensure().process.pid if pool is not None else None
    env_cpu = cpu_s(server_pid) if server_pid else children_cpu()
    cpu = time.process_time()
    cfg = config(db, url, model, env_id, kwargs, c)
    summary = await serve(cfg, max_episodes=episodes)
    cpu = time.process_time() - cpu
    env_cpu = (cpu_s(server_pid) if server_pid else children_cpu()) - env_cpu
    async with await Store.open(cfg.store) as store:
        rows = await store.list_episodes(run_id=summary.run_id, limit=100_000)
    failed = [e.error_cause for e in rows if e.status not in ("completed", "filtered")]
    assert not failed, f"{env_id}: episodes failed: {failed[:1]}"
    calls = sum(e.num_turns for e in rows)
    tokens = sum(e.num_model_tokens for e in rows)
    ends = [(e.started_at or 0.0, e.finished_at or 0.0) for e in rows]
    window = max(end for _, end in ends) - min(start for start, _ in ends)
    return {"calls_per_s": calls / window, "cpu_ms_per_call": cpu / calls * 1e3,
            "env_cpu_ms_per_call": env_cpu / calls * 1e3, "tokens_per_call": tokens / calls,
            "calls": calls}  # fmt: skip


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from agent_rl.config import load_config
    from agent_rl.engine.launcher import EngineServer
    from agent_rl.models import init_model

    python = os.environ.get(PYTHON_VAR) or str(ROOT / ".venv-verifiers" / "bin" / "python")
    if not Path(python).is_file():
        raise SystemExit(f"no verifiers environment at {python}: set {PYTHON_VAR}")
    work = Path(tempfile.mkdtemp(prefix="bench-ecosystems-"))
    model = init_model(work / "tiny-moe", "tiny-moe", seed=0)
    engine = EngineServer(model, venv=load_config().engine.venv, log_dir=work / "logs",
                          moe_routing_replay=True, max_running_requests=64)  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {}
    loads: list[float] = []
    started = time.time()
    await engine.astart()
    print(f"engine up in {time.time() - started:.0f} s", flush=True)
    every = sides(python)
    # The two sides the target compares alternate round by round (they meet the same load);
    # the process-per-episode side, many times slower, runs once, last, with fewer episodes.
    pair = ("verifiers_server", "sdk")
    plan = [(r, name) for r in range(args.rounds) for name in (pair if r % 2 == 0 else pair[::-1])]
    plan.append((0, "verifiers_process"))
    try:
        for r, name in plan:
            env_id, kwargs = every[name]
            episodes = args.process_episodes if name == "verifiers_process" else args.episodes
            loads.append(load_average())
            out = await side(work / f"{name}-{r}.db", engine.url, model, env_id, kwargs,
                             episodes, args.concurrency)  # fmt: skip
            loads.append(load_average())
            runs.setdefault(name, []).append(out)
            print(f"{name} round {r} (load {loads[-2]:.1f}-{loads[-1]:.1f}): "
                  f"{out['calls_per_s']:.2f} calls/s, {out['cpu_ms_per_call']:.1f} ms serve "
                  f"CPU/call, {out['env_cpu_ms_per_call']:.1f} ms env CPU/call "
                  f"({out['calls']:.0f} calls)", flush=True)  # fmt: skip
    finally:
        engine.stop()

    def median(name: str, key: str) -> float:
        return statistics.median(o[key] for o in runs[name])

    result: dict[str, Any] = {
        key: {name: round(median(name, key), 2) for name in runs}
        for key in ("calls_per_s", "cpu_ms_per_call", "env_cpu_ms_per_call", "tokens_per_call")
    }
    result["total_cpu_ms_per_call"] = {
        name: round(median(name, "cpu_ms_per_call") + median(name, "env_cpu_ms_per_call"), 1)
        for name in runs
    }
    calls = result["calls_per_s"]
    # Each round's ratio pairs sides that ran back to back, at the same machine load.
    paired = [v["calls_per_s"] / d["calls_per_s"]
              for v, d in zip(runs["verifiers_server"], runs["sdk"])]  # fmt: skip
    result["ratio_out_of_process"] = round(statistics.median(paired), 3)
    result["ratio_server_over_process"] = round(calls["verifiers_server"]
                                                / calls["verifiers_process"], 2)  # fmt: skip
    result["episodes"], result["concurrency"] = args.episodes, args.concurrency
    result["load_average"] = [min(loads), max(loads)]
    return result


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=32, help="episodes per side and round")
    parser.add_argument("--concurrency", type=int, default=8, help="episodes at a time")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of the server and SDK sides (alternating order)")
    parser.add_argument("--process-episodes", type=int, default=2,
                        help="episodes of the process-per-episode side (one round)")
    started = time.time()
    out = asyncio.run(main(parser.parse_args()))
    print(f"wall {time.time() - started:.0f} s")
    print("RESULT " + json.dumps(out))
