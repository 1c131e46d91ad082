"""`agent-rl db upgrade|current`: apply and inspect the store's schema migrations."""

from __future__ import annotations

import anyio
import typer

from agent_rl.cli.common import console, state
from agent_rl.store.migrate import current_revision, head_revision, upgrade

app = typer.Typer(help="Manage the trajectory store's schema.", no_args_is_help=True)


@app.command("upgrade")
def upgrade_cmd(ctx: typer.Context) -> None:
    """Create or migrate the store's schema to this version of agent-rl."""
    cfg = state(ctx).config().store
    anyio.run(_upgrade, cfg)
    console.print(f"store at {cfg.url} is at revision {head_revision()} (head)", highlight=False)


async def _upgrade(cfg) -> None:  # type: ignore[no-untyped-def]
    from agent_rl.store import Store

    # Opening without the schema check turns a bad URL into a one-line StoreError first.
    store = await Store.open(cfg, check=False)
    await store.close()
    await upgrade(cfg)


@app.command("current")
def current_cmd(ctx: typer.Context) -> None:
    """Print the database's schema revision and whether it is at head."""
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


