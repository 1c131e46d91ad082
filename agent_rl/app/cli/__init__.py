"""The `agent-rl` command line: a thin Typer layer over library functions.

Each command (group) lives in its own module, listed in COMMANDS and imported only when it is
invoked: some pull in torch, megatron-core or the engine client, and `agent-rl config show`
should not wait for them. Errors that agent-rl raises on purpose (`AgentRLError`) are printed as
one line, with exit code 1 and no traceback.
"""

from __future__ import annotations

import sys
from importlib import import_module
from pathlib import Path
from typing import Annotated, Optional

import click
import typer
from typer.core import TyperGroup

from agent_rl.app.cli import common
from agent_rl.app.cli.common import CliState
from agent_rl.kernel.errors import AgentRLError
from agent_rl.kernel.heap import imports_begin, imports_end

# name -> "module:attribute"; the attribute is a Typer app (a command group) or a function
# (a single command).
COMMANDS: dict[str, str] = {
    "config": "agent_rl.app.cli.config_cmd:app",
    "db": "agent_rl.app.cli.db:app",
    "audit": "agent_rl.app.cli.audit:audit",
    "episodes": "agent_rl.app.cli.episodes:app",
    "envs": "agent_rl.app.cli.envs:app",
    "model": "agent_rl.app.cli.model:app",
    "engine": "agent_rl.app.cli.engine:app",
    "router": "agent_rl.app.cli.router:router",
    "serve": "agent_rl.app.cli.serve:serve",
    "train": "agent_rl.app.cli.train:train",
    "eval": "agent_rl.app.cli.eval_cmd:eval_cmd",
    "api": "agent_rl.app.cli.api:api",
    "quickstart": "agent_rl.app.cli.quickstart:quickstart",
    "launch": "agent_rl.app.cli.launch:app",
}


class LazyGroup(TyperGroup):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module, _, attr = target.partition(":")
        obj = getattr(import_module(module), attr)
        imports_end()  # the command's libraries are in (see agent_rl/kernel/heap.py)
        if isinstance(obj, typer.Typer):
            command: click.Command = typer.main.get_group(obj)
        else:
            single = typer.Typer(add_completion=False)  # as the root: no completion options
            single.command(cmd_name)(obj)
            command = typer.main.get_command(single)
        command.name = cmd_name
        if command.help and not command.short_help:
            # The root's list shows the help's first paragraph, and in Typer's rich mode with
            # the docstring's line breaks: give it the paragraph as one line to wrap.
            command.short_help = " ".join(command.help.split("\n\n")[0].split())
        return command


app = typer.Typer(
    name="agent-rl",
    cls=LazyGroup,
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


def main() -> None:
    imports_begin()
    try:
        app()
    except AgentRLError as e:
        _fail(e)
    except BaseExceptionGroup as group:
        # A failure inside a task group (serve's, the API's) arrives wrapped: its own error
        # is the one line to print, not the group's traceback.
        errors, _ = group.split(AgentRLError)
        if errors is None:
            raise
        _fail(_first_leaf(errors))
    except KeyboardInterrupt:
        common.err_console.print("interrupted")
        sys.exit(130)


def _first_leaf(group: BaseException) -> BaseException:
    while isinstance(group, BaseExceptionGroup):
        group = group.exceptions[0]
    return group


def _fail(e: BaseException) -> None:
    from rich.markup import escape

    from agent_rl.config.secrets import redact_text

    # The message is text, not markup: "[router] admin_token" must print as written. A URL's
    # password in it (a driver's message quoting its connection string) is masked.
    message = redact_text(str(e), [])
    common.err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(1)
