"""`agent-rl envs list`: which environments are registered, and where each came from."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from agent_rl.cli.common import console
from agent_rl.errors import EnvError
from agent_rl.registry import EnvSpec, load_errors, make, specs

app = typer.Typer(help="Inspect registered environments.", no_args_is_help=True)


def describe(spec: EnvSpec) -> dict[str, Any]:
    """One row: the spec plus what an instance says about itself (or why it cannot be made)."""
    row: dict[str, Any] = {
        "id": spec.id,
        "source": spec.source,
        "entry_point": spec.entry_point,
        "kwargs": spec.kwargs,
        "description": "",
        "tools": [],
        "sandbox": None,
        "demonstration": None,
        "error": None,
    }
    try:
        env = make(spec.id)
        row["tools"] = sorted(env.toolset)
        row["sandbox"] = env.needs_sandbox
        row["demonstration"] = env.has_demonstration()
        row["description"] = (
            (type(env).__doc__ or "").strip().splitlines()[0] if type(env).__doc__ else ""
        )
    except EnvError as e:
        row["error"] = str(e)
    return row


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
