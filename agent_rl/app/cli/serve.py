"""`agent-rl serve`: run episodes of an environment into the store (see agent_rl.app.serve)."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import anyio
import typer
from rich.table import Table

from agent_rl.app.cli.common import console, state
from agent_rl.config import Config
from agent_rl.kernel.errors import ConfigError

if TYPE_CHECKING:
    from agent_rl.app.serve import ServeSummary


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
    cfg = state(ctx).config()
    updates = {}
    if env is not None or router_url is not None:
        rollout = cfg.rollout.model_copy(update={k: v for k, v in {"env": env, "router_url": router_url}.items() if v is not None})
        updates["rollout"] = rollout
    if model is not None:
        updates["engine"] = cfg.engine.model_copy(update={"model": model})
    cfg = cfg.model_copy(update=updates)
    check_public_binds(cfg, with_api=api)  # before the imports below take their seconds
    from agent_rl.app.serve import LOOP
    from agent_rl.app.serve import serve as run_serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    summary = anyio.run(lambda: run_serve(cfg, max_episodes=max_episodes, with_api=api),
                        backend_options=LOOP)
    # Every episode is recorded by now: a SIGTERM (e.g. the second of a drain that just ended)
    # only cuts the summary short, instead of killing the process with a signal status.
    signal.signal(signal.SIGTERM, _exit_quietly)
    print_summary(summary)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the interpreter's teardown has nothing to stop


def check_public_binds(cfg: Config, *, with_api: bool) -> None:
    """A bind beyond loopback without `api.token` is a one-line error at once: the API's
    (`api.host`) when serve mounts it, the agent gateway's (`rollout.gateway_host`) when the
    env is an agent env, the only kind serve starts a gateway for (`rollout.env`'s class is
    imported to tell, not made; serve checks again with the env it makes,
    `agent_rl.app.serve.check_binds`)."""
    from agent_rl.config.access import is_loopback, token_value

    if token_value(cfg.api.token) is not None:
        return
    if with_api and not is_loopback(cfg.api.host):
        _refuse_public("api.host", cfg.api.host)
    if not is_loopback(cfg.rollout.gateway_host) and _hosts_agents(cfg.rollout.env):
        _refuse_public("rollout.gateway_host", cfg.rollout.gateway_host)


def _refuse_public(setting: str, host: str) -> None:
    raise ConfigError(
        f"{setting} is {host}, not loopback, and api.token is unset or blank: a public bind "
        f"needs api.token set (AGENT_RL_API__TOKEN), or set {setting} = 127.0.0.1"
    )


def _hosts_agents(env_id: str) -> bool:
    """Whether serving `env_id` starts the agent gateway (an unknown id is the registry's
    one-line error here, as it would be when serve makes the env)."""
    from agent_rl.sdk.agent import AgentEnv
    from agent_rl.sdk.registry import load_class, spec

    return issubclass(load_class(spec(env_id)), AgentEnv)


def _exit_quietly(signum: int, frame: object) -> None:
    sys.exit(0)


def print_summary(summary: ServeSummary) -> None:
    """This serve's episodes as the store has them, and how they ended (from the store)."""
    ledger, endings = summary.ledger, summary.endings
    table = Table("episodes run", "trained", "awaiting training", "filtered", "failed",
                  "not ended", "mean reward", title="this serve's episodes (from the store)")
    mean = "-" if ledger.mean_reward is None else f"{ledger.mean_reward:.3f}"
    table.add_row(str(ledger.admitted), str(ledger.trained), str(ledger.completed),
                  str(ledger.filtered), str(ledger.failed), str(ledger.running + ledger.waiting),
                  mean)
    console.print(table)
    for what, counts in (("truncated", endings.truncated), ("filtered", endings.filtered),
                         ("failed", endings.failed)):
        if counts:
            console.print(f"{what}: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())),
                          highlight=False)
    console.print("ledger of the run: " + ", ".join(
        f"{k}={v}" for k, v in summary.run_ledger.as_dict().items()), highlight=False)
