"""`agent-rl engine install|start|status`: the SGLang engine environment and a standalone server."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from agent_rl.app.cli.common import console, state
from agent_rl.engine.install import install_engine, is_installed
from agent_rl.engine.launcher import EngineServer, detect_device

app = typer.Typer(help="Install and run the SGLang inference engine.", no_args_is_help=True)


@app.command("install")
def install(
    ctx: typer.Context,
    venv: Annotated[
        Optional[Path], typer.Option("--venv", help="Where to create it (default: engine.venv).")
    ] = None,
    device: Annotated[
        str, typer.Option("--device", help="cpu (pinned CPU set), cuda (stock SGLang) or auto.")
    ] = "auto",
    python: Annotated[
        Optional[str], typer.Option("--python", help="CPython 3.11 interpreter to build it from.")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Reinstall even if up to date.")] = False,
) -> None:
    """Create the dedicated engine environment (idempotent: an up-to-date one is kept)."""
    target = venv or state(ctx).config().engine.venv
    dev = detect_device() if device == "auto" else device
    if dev not in ("cpu", "cuda"):
        raise typer.BadParameter("--device must be cpu, cuda or auto")
    install_engine(target, dev, python=python, force=force, echo=console.print)  # type: ignore


@app.command("status")
def status(ctx: typer.Context) -> None:
    """Say whether the engine environment is installed and where."""
    venv = state(ctx).config().engine.venv
    console.print(f"engine environment {venv}: {'installed' if is_installed(venv) else 'missing'}")
    if not is_installed(venv):
        raise typer.Exit(1)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@app.command("start")
def start(
    ctx: typer.Context,
    model: Annotated[
        Optional[Path], typer.Option("--model", help="HF model directory (default: engine.model).")
    ] = None,
    port: Annotated[
        Optional[int], typer.Option("--port", help="HTTP port (default: engine.port).")
    ] = None,
    host: Annotated[
        Optional[str], typer.Option("--host", help="Bind address (default: engine.host).")
    ] = None,
    moe_routing_replay: Annotated[
        Optional[bool],
        typer.Option(
            "--moe-routing-replay/--no-moe-routing-replay", help="Return routed experts (R3)."
        ),
    ] = None,
    speculative: Annotated[
        Optional[bool],
        typer.Option(
            "--speculative/--no-speculative",
            help="Speculative decoding with the model's MTP draft (GPU only; engine.speculative).",
        ),
    ] = None,
    speculative_steps: Annotated[
        Optional[int],
        typer.Option(min=1, help="Draft tokens per verification (engine.speculative_steps)."),
    ] = None,
) -> None:
    """Run one SGLang server in the foreground until Ctrl-C or SIGTERM, then stop it and exit 0;
    exit 1 if it crashes or does not stop."""
    cfg = state(ctx).config().engine
    updates = {"speculative": speculative, "speculative_steps": speculative_steps}
    cfg = cfg.model_copy(update={k: v for k, v in updates.items() if v is not None})
    server = EngineServer.from_config(
        cfg, model=model, port=port, host=host, moe_routing_replay=moe_routing_replay
    )
    console.print(f"starting SGLang ({server.device}) for {server.model}; log: {server.log_path}")
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the engine as Ctrl-C does
    try:
        server.start()
        console.print(f"engine ready at {server.url}")
        while True:
            server.check()
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass  # asked to stop: a clean stop below is a success
    finally:
        # A second Ctrl-C or `kill` (a terminal's Ctrl-C and a supervisor's SIGTERM together)
        # must not cut the stop short and leave the engine's processes behind.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        server.stop()
    if server.running():
        console.print(f"the engine at {server.url} did not stop")
        raise typer.Exit(1)
    console.print("engine stopped")
