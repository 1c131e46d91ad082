"""`agent-rl config show|check`: print the effective config, validate a file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from agent_rl.app.cli.common import console, state
from agent_rl.config import load_config

app = typer.Typer(help="Show or validate configuration.", no_args_is_help=True)


@app.command("show")
def show(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of TOML-like text.")] = False,
) -> None:
    """Print the effective configuration (defaults, file, AGENT_RL_* variables)."""
    cfg = state(ctx).config().model_dump(mode="json")
    if as_json:
        print(json.dumps(cfg, indent=2))
        return
    for section, values in cfg.items():
        console.print(f"[bold]\\[{section}][/]", highlight=False)
        for key, value in values.items():
            console.print(f"{key} = {json.dumps(value)}", highlight=False, markup=False)
        console.print()


@app.command("check")
def check(file: Annotated[Path, typer.Argument(help="TOML file to validate.")]) -> None:
    """Validate a config file; exit non-zero with the offending key if it is invalid."""
    load_config(file)
    console.print(f"{file}: ok")
