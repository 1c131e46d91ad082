"""py-spy samples of serve grouped into stages (bench/serve_ceiling.py's `top_stages`): each
sample goes to the stage of its innermost frame that names one; samples of a waiting thread are
left out."""

from __future__ import annotations

import collections
from pathlib import Path

# (stage, what in a frame's "function (file:line)" marks it), innermost match wins.
STAGES = [
    # driver.py: the hot statements' calls into the driver (its C code has no frames of its own).
    ("store: SQL (SQLAlchemy, the driver, the database)", ("sqlalchemy/", "sqlite3", "psycopg/",
                                                           "agent_rl/store/driver.py")),
    ("store: transaction and thread hop", ("agent_rl/store/base.py", "anyio/to_thread",
                                           "anyio/_backends", "concurrent/futures")),
    ("store: turn rows", ("agent_rl/store/lifecycle.py", "agent_rl/store/arrays.py")),
    ("render: chat template", ("jinja2/", "transformers/", "agent_rl/rollout/render.py")),
    ("tokenizer", ("tokenizers/",)),
    ("engine client: HTTP", ("aiohttp/", "multidict", "yarl/", "agent_rl/sglang/client.py")),
    ("router (in serve)", ("router/",)),
    ("json", ("json/",)),
    ("env step and tools", ("agent_rl/sdk/env.py", "agent_rl/sdk/tools.py", "envs/", "rank_bm25")),
    ("tool-call parsing", ("agent_rl/sdk/tool_calls.py",)),
    ("telemetry", ("opentelemetry/", "agent_rl/kernel/telemetry.py")),
    ("retries", ("tenacity/",)),
    ("runner", ("agent_rl/rollout/runner.py", "agent_rl/rollout/recorded.py")),
    ("scheduler", ("agent_rl/rollout/scheduler.py",)),
    ("numpy", ("numpy/",)),
    ("event loop", ("asyncio/", "selectors.py", "uvloop")),
]


IDLE = ("Condition.wait", "EpollSelector.select", "select (selectors", "Event.wait")
"""Innermost frames of a thread waiting (py-spy's own idle detection misses lock waits)."""


def classify(stack: str) -> str | None:
    frames = stack.split(";")
    if frames[-1].startswith(IDLE):
        return None
    for frame in reversed(frames):  # innermost first
        for stage, marks in STAGES:
            if any(m in frame for m in marks):
                return stage
    return "other"


def stages(path: Path) -> dict[str, float]:
    """Share of busy samples per stage (py-spy raw format: `stack count` per line)."""
    counts: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        stage = classify(stack) if stack and n.isdigit() else None
        if stage is not None:
            counts[stage] += int(n)
    total = sum(counts.values()) or 1
    return {k: round(v / total, 3) for k, v in counts.most_common()}
