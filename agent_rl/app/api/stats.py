"""Run statistics from the store: the ledger, throughput, staleness and latency percentiles.

Computed from the newest finished episodes and tool calls (`store.recent_activity`, a bounded
window), so the cost of `/stats` does not grow with the age of the run. Staleness of a trained
episode is the one the trainer recorded when it trained it (`agent_rl.store.staleness`: the
trainer's version before the step minus the episode's sampling version), so the histogram and
the trainer's bound agree. How episodes ended, by reason, is counted over the whole run.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict
from typing import Any

import numpy as np

from agent_rl.app.api.schemas import EndingsOut, Percentiles, StatsOut, ToolLatency
from agent_rl.store import Store
from agent_rl.store.staleness import bucket

WINDOW = 5000
"""Episodes and tool calls the statistics are computed over (the newest ones)."""


def percentiles(values: list[float]) -> Percentiles:
    if not values:
        return Percentiles(count=0, p50=None, p90=None, p99=None)
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=float), [50, 90, 99]).tolist()
    return Percentiles(count=len(values), p50=p50, p90=p90, p99=p99)


def summarize(activity: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    episodes, calls = activity["episodes"], activity["tool_calls"]
    by_env: dict[str, list[float]] = defaultdict(list)
    for e in episodes:
        if e["started_at"] is not None and e["finished_at"] is not None:
            by_env[e["env_id"]].append(max(0.0, e["finished_at"] - e["started_at"]))
    by_tool: dict[str, list[float]] = defaultdict(list)
    errors: Counter[str] = Counter()
    for c in calls:
        name = c["name"] or "(malformed)"
        by_tool[name].append(float(c["duration_s"]))
        errors[name] += c["status"] != "ok"
    staleness: Counter[str] = Counter(
        str(bucket(e["staleness"])) for e in episodes if e["staleness"] is not None
    )
    finished = [e["finished_at"] for e in episodes if e["finished_at"] is not None]
    span = (max(finished) - min(finished)) if len(finished) > 1 else 0.0
    tokens = sum(e["num_model_tokens"] for e in episodes)
    throughput = {
        "window_episodes": float(len(episodes)),
        "episodes_per_s": len(episodes) / span if span > 0 else None,
        "model_tokens_per_s": tokens / span if span > 0 else None,
    }
    return {
        "throughput": throughput,
        "staleness": dict(sorted(staleness.items(), key=lambda kv: int(kv[0]))),
        "episode_latency_s": {env: percentiles(v) for env, v in sorted(by_env.items())},
        "tool_latency_s": {
            name: ToolLatency(**percentiles(v).model_dump(), errors=errors[name])
            for name, v in sorted(by_tool.items())
        },
    }


async def run_stats(store: Store, run_id: int | None) -> StatsOut:
    ledger = await store.ledger(run_id)
    endings = await store.endings(run_id)
    activity = await store.recent_activity(run_id, limit=WINDOW)
    return StatsOut(run_id=run_id, ledger=ledger.as_dict(), endings=EndingsOut(**asdict(endings)),
                    **summarize(activity))
