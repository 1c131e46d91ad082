"""`agent-rl router`: run the metadata-preserving router alone, in front of many SGLang servers.

Options override the `[router]` section of the config. The process runs until SIGINT or SIGTERM,
then closes its listening socket and upstream connections. It runs on uvloop, which costs less
CPU per proxied request than the default event loop (measurements in docs/router.md).
"""

from __future__ import annotations

import asyncio
import signal
from typing import Annotated, Optional

import typer
import uvloop
from pydantic import ValidationError

from agent_rl.app.cli.common import err_console, state
from agent_rl.config import RouterConfig
from agent_rl.kernel.errors import ConfigError
from agent_rl.kernel.heap import long_lived_heap


def router(
    ctx: typer.Context,
    worker: Annotated[
        Optional[list[str]],
        typer.Option("--worker", "-w", help="SGLang server URL (repeatable); added to [router] workers."),
    ] = None,
    host: Annotated[Optional[str], typer.Option(help="Bind address (config default: 127.0.0.1).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port to listen on (0: any free port).")] = None,
    policy: Annotated[
        Optional[str], typer.Option(help="session-affinity | least-outstanding | round-robin.")
    ] = None,
    tokenless_control: Annotated[
        Optional[bool],
        typer.Option("--tokenless-control/--token-control", help="Control endpoints without the admin token, for "
                     "tools that send none (slime); loopback binds only."),
    ] = None,
) -> None:
    """Run the router: SGLang and OpenAI passthrough, balancing, health, control fan-out."""
    config = state(ctx).config().router
    options = {"host": host, "port": port, "policy": policy, "tokenless_control": tokenless_control}
    updates = {k: v for k, v in options.items() if v is not None}
    if updates:
        try:
            config = RouterConfig.model_validate({**config.model_dump(), **updates})
        except ValidationError as e:
            problems = "; ".join(f"--{err['loc'][0]}: {err['msg']}" for err in e.errors())
            raise ConfigError(f"invalid router option: {problems}") from e
    uvloop.run(serve(config, worker or []))


async def serve(config: RouterConfig, workers: list[str]) -> None:
    """Run a router until the process is asked to stop."""
    from router import (
        Router,  # the CLI root stays importable without the router's dependencies loaded
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with Router(config, workers) as running:
        err_console.print(
            f"router on {running.url}: {len(running.pool)} worker(s), policy {config.policy}",
            highlight=False, soft_wrap=True,
        )
        if config.tokenless_control:
            err_console.print(
                "control endpoints open without a token on loopback ([router] tokenless_control)",
                highlight=False, markup=False, soft_wrap=True,
            )
        elif running.token_generated:
            err_console.print(
                f"admin token (generated for this run; set [router] admin_token to fix it): "
                f"{running.admin_token}", highlight=False, markup=False, soft_wrap=True,
            )
        with long_lived_heap():  # started and imported: see agent_rl/kernel/heap.py
            await stop.wait()
