"""`agent-rl model init`: write a tiny random-init model directory (see agent_rl.models)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agent_rl.app.cli.common import console
from agent_rl.models.presets import PRESETS

app = typer.Typer(help="Make tiny local models.", no_args_is_help=True)


@app.command("init")
def init(
    out: Annotated[Path, typer.Argument(help="Directory to write the model into.")],
    preset: Annotated[
        str, typer.Option("--preset", help=f"One of: {', '.join(PRESETS)}.")
    ] = "tiny-dense",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random initialisation.")] = 0,
    layers: Annotated[
        int | None, typer.Option("--layers", help="Override the number of decoder layers.")
    ] = None,
    hidden: Annotated[
        int | None, typer.Option("--hidden", help="Override the hidden size.")
    ] = None,
) -> None:
    """Write an HF-format model (weights, config, tokenizer, chat template) to OUT."""
    if preset not in PRESETS:
        raise typer.BadParameter(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    overrides = {}
    if layers is not None:
        overrides["num_hidden_layers"] = layers
    if hidden is not None:
        overrides["hidden_size"] = hidden
    from agent_rl.models.tiny import count_parameters, init_model  # torch: only when used

    path = init_model(out, preset, seed=seed, **overrides)
    console.print(f"{preset} model ({count_parameters(path):,} parameters) written to {path}")
