"""The `agent-rl` command line: a thin Typer layer over library functions.

Each command group lives in its own module and is registered here. Errors that agent-rl raises
on purpose (`AgentRLError`) are printed as one line, with exit code 1 and no traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from agent_rl.cli import config_cmd, db, envs, episodes, model
from agent_rl.cli.common import CliState, err_console
from agent_rl.cli.router import router as router_command
from agent_rl.errors import AgentRLError

app = typer.Typer(
    name="agent-rl",
    help="Train LLM agents with reinforcement learning.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def root(
    ctx: typer.Context,
    config: Annotated[
        Optional[Path],
        typer.Option("--config", "-c", help="TOML config file (default: ./agent-rl.toml if present)."),
    ] = None,
) -> None:
    ctx.obj = CliState(config_path=config)


app.add_typer(config_cmd.app, name="config")
app.add_typer(db.app, name="db")
app.add_typer(episodes.app, name="episodes")
app.add_typer(envs.app, name="envs")
app.command("router")(router_command)
app.add_typer(model.app, name="model")


def main() -> None:
    try:
        app()
    except AgentRLError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
