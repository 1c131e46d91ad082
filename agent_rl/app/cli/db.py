"""`agent-rl db upgrade|current|audit`: the store's schema migrations, and its bookkeeping
checked from the rows (`Store.audit`)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Optional

import anyio
import typer

from agent_rl.app.cli.common import console, state
from agent_rl.config import StoreConfig

if TYPE_CHECKING:
    from agent_rl.store import Audit

app = typer.Typer(help="Manage and check the trajectory store.", no_args_is_help=True)


@app.command("upgrade")
def upgrade_cmd(ctx: typer.Context) -> None:
    """Create or migrate the store's schema to this version of agent-rl."""
    from agent_rl.config.secrets import redact_url
    from agent_rl.store.migrate import head_revision

    cfg = state(ctx).config().store
    anyio.run(_upgrade, cfg)
    console.print(f"store at {redact_url(cfg.url)} is at revision {head_revision()} (head)", highlight=False)


async def _upgrade(cfg: StoreConfig) -> None:
    from agent_rl.store import Store
    from agent_rl.store.migrate import upgrade

    # Opening without the schema check turns a bad URL into a one-line StoreError first.
    store = await Store.open(cfg, check=False)
    await store.close()
    await upgrade(cfg)


@app.command("current")
def current_cmd(ctx: typer.Context) -> None:
    """Print the database's schema revision and whether it is at head."""
    from agent_rl.store.migrate import current_revision, head_revision

    cfg = state(ctx).config().store

    async def run() -> str | None:
        from agent_rl.store import Store

        store = await Store.open(cfg, check=False)
        try:
            return await anyio.to_thread.run_sync(current_revision, store.db)
        finally:
            await store.close()

    rev = anyio.run(run)
    head = head_revision()
    if rev == head:
        console.print(f"{rev} (head)")
    else:
        console.print(f"{rev or 'empty'} (head is {head}: run `agent-rl db upgrade`)")
        raise typer.Exit(1)


@app.command("audit")
def audit_cmd(
    ctx: typer.Context,
    run: Annotated[Optional[str], typer.Option(help="Run name (default: every run).")] = None,
    finished: Annotated[bool, typer.Option(
        "--finished", help="The run is over: an episode still waiting or running is a problem.",
    )] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per run.")] = False,
) -> None:
    """Check each run's bookkeeping from the rows: every admitted episode exists (none lost) in
    one state with its cause, and the trainer's steps trained each once. Exit 1 on a problem."""
    audits = anyio.run(_audits, state(ctx).config().store, run)
    bad = 0
    for name, audit in audits:
        problems = audit.problems(finished=finished)
        bad += bool(problems)
        if as_json:
            row = {"run": name, **asdict(audit), "trained_twice": audit.trained_twice,
                   "problems": problems}
            print(json.dumps(row))
            continue
        ledger = audit.ledger.as_dict()
        console.print(
            f"run {name}: " + " ".join(f"{k}={v}" for k, v in ledger.items())
            + f" lost={audit.lost} trained_by_steps={audit.trained_by_steps}",
            highlight=False, markup=False,
        )
        for p in problems:
            console.print(f"  problem: {p}", highlight=False, markup=False)
        if not problems:
            console.print("  ok", highlight=False)
    if not as_json:
        console.print(f"{len(audits)} runs audited, {bad} with problems", highlight=False)
    if bad:
        raise typer.Exit(1)


async def _audits(cfg: StoreConfig, run: str | None) -> list[tuple[str, Audit]]:
    from agent_rl.store import Store

    async with await Store.open(cfg) as store:
        runs = [{"id": await store.run_id(run), "name": run}] if run else await store.list_runs()
        return [(r["name"], await store.audit(r["id"])) for r in runs]
