"""`agent-rl serve`: run episodes of an environment into the store (see agent_rl.serve)."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import anyio
import typer
from rich.table import Table

from agent_rl.cli.common import console, state


def serve(
    ctx: typer.Context,
    env: Annotated[Optional[str], typer.Option(help="Environment id (default: rollout.env).")] = None,
    max_episodes: Annotated[
        Optional[int], typer.Option(min=1, help="Stop after admitting and finishing N episodes.")
    ] = None,
    model: Annotated[Optional[Path], typer.Option(help="HF model directory (default: engine.model).")] = None,
    router_url: Annotated[
        Optional[str], typer.Option(help="Generate through this router instead of an embedded one.")
    ] = None,
    api: Annotated[bool, typer.Option("--api/--no-api", help="Serve the web API and viewer too.")] = True,
) -> None:
    """Run the scheduler and episode runners; by default with an embedded router and engine."""
    from agent_rl.serve import serve as run_serve
    from agent_rl.store import Store

    cfg = state(ctx).config()
    updates = {}
    if env is not None or router_url is not None:
        rollout = cfg.rollout.model_copy(update={k: v for k, v in {"env": env, "router_url": router_url}.items() if v is not None})
        updates["rollout"] = rollout
    if model is not None:
        updates["engine"] = cfg.engine.model_copy(update={"model": model})
    cfg = cfg.model_copy(update=updates)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stats = anyio.run(lambda: run_serve(cfg, max_episodes=max_episodes, with_api=api))
    # Every episode is recorded by now: a SIGTERM (e.g. the second of a drain that just ended)
    # only cuts the summary short, instead of killing the process with a signal status.
    signal.signal(signal.SIGTERM, _exit_quietly)

    async def ledger():  # type: ignore[no-untyped-def]
        async with await Store.open(cfg.store) as store:
            return await store.ledger(await store.run_id(cfg.run.name))

    table = Table("admitted", "completed", "failed", "groups ready", "groups filtered", "mean reward")
    mean = sum(stats.rewards) / len(stats.rewards) if stats.rewards else float("nan")
    table.add_row(str(stats.admitted), str(stats.completed), str(stats.failed),
                  str(stats.groups_ready), str(stats.groups_filtered), f"{mean:.3f}")
    console.print(table)
    console.print("ledger: " + ", ".join(f"{k}={v}" for k, v in anyio.run(ledger).as_dict().items()))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the interpreter's teardown has nothing to stop


def _exit_quietly(signum: int, frame: object) -> None:
    sys.exit(0)
