"""`agent-rl envs list`: which environments are registered, and where each came from."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from agent_rl.app.cli.common import console
from agent_rl.sdk.registry import describe, load_errors, specs

app = typer.Typer(help="Inspect registered environments.", no_args_is_help=True)


@app.command("list")
def list_envs(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List registered environments: built-in, from installed packages' entry points, or modules."""
    rows = [describe(s) for s in specs()]
    errors = [{"source": e.source, "error": e.message} for e in load_errors()]
    if as_json:
        print(json.dumps({"envs": rows, "load_errors": errors}, indent=2))
        return
    table = Table(title="environments")
    for col in ("id", "source", "entry point", "tools", "sandbox", "description"):
        table.add_column(col, overflow="fold")
    for r in rows:
        desc = r["description"] if r["error"] is None else f"[red]cannot load: {r['error']}[/]"
        sandbox = "" if r["sandbox"] is None else ("yes" if r["sandbox"] else "no")
        table.add_row(r["id"], r["source"], r["entry_point"], ", ".join(r["tools"]), sandbox, desc)
    console.print(table)
    for e in errors:
        console.print(f"[yellow]could not load {e['source']}:[/] {e['error']}", highlight=False)
