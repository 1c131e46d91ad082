"""`agent-rl api`: serve the web API and episode viewer alone, over the configured store.

`agent-rl serve` mounts the same app in its own process; this command is for inspecting a
store (a finished run, a shared PostgreSQL) without running rollouts. Options override the
`[api]` section. It binds 127.0.0.1 unless told otherwise, and refuses any other address
without a token. Runs until SIGINT or SIGTERM.
"""

from __future__ import annotations

import signal
from typing import Annotated

import typer
from pydantic import ValidationError

from agent_rl.app.cli.common import err_console, state
from agent_rl.config import ApiConfig, Config
from agent_rl.config.secrets import redact_url
from agent_rl.kernel.errors import ConfigError


def api(
    ctx: typer.Context,
    host: Annotated[
        str | None, typer.Option(help="Bind address (config default: 127.0.0.1).")
    ] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on (0: any free port).")] = None,
) -> None:
    """Serve the web API (/api/v1, /openapi.json) and the episode viewer (/)."""
    import anyio

    config = state(ctx).config()
    updates = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
    if updates:
        try:
            config.api = ApiConfig.model_validate({**config.api.model_dump(), **updates})
        except ValidationError as e:
            problems = "; ".join(f"--{err['loc'][0]}: {err['msg']}" for err in e.errors())
            raise ConfigError(f"invalid api option: {problems}") from e
    anyio.run(run, config)


async def run(config: Config) -> None:
    """Serve until the process is asked to stop."""
    import anyio

    from agent_rl.app.api import create_app, serve_api
    from agent_rl.app.api.app import check_exposure

    check_exposure(config.api)
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_api, create_app(config), config.api)
        host = config.api.host if ":" not in config.api.host else f"[{config.api.host}]"
        err_console.print(
            f"agent-rl api on http://{host}:{port}/ (store {redact_url(config.store.url)})",
            highlight=False,
            soft_wrap=True,
        )
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                break
        tg.cancel_scope.cancel()
