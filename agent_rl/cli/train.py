"""`agent-rl train`: the learner (trainer/loop.py), or `--sft` on demonstrations (trainer/sft.py).

Only orchestrates: resolve the model and router, build the Engine, run the loop, print a
summary. torch and megatron-core are imported inside the command so `agent-rl --help` stays
fast. Errors are one line (ConfigError, StoreError, EngineError).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from agent_rl.cli.common import console, err_console, state
from agent_rl.config import Config
from agent_rl.errors import ConfigError


def resolve_model(cfg: Config, model: Path | None) -> Path:
    """--model, else trainer.model, else engine.model; it must be an HF model directory whose
    architecture matches the served one (engine.model) when both are configured."""
    chosen = model or cfg.trainer.model or cfg.engine.model
    if chosen is None:
        raise ConfigError("no model to train: pass --model DIR or set [trainer] model")
    if not (Path(chosen) / "config.json").is_file():
        raise ConfigError(f"{chosen} is not a HuggingFace model directory (no config.json)")
    served = cfg.engine.model
    if served is not None and (Path(served) / "config.json").is_file() and served != chosen:
        keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_experts")
        ours = json.loads((Path(chosen) / "config.json").read_text())
        theirs = json.loads((Path(served) / "config.json").read_text())
        diff = [k for k in keys if ours.get(k) != theirs.get(k)]
        if diff:
            raise ConfigError(
                f"model {chosen} does not match engine.model {served} ({', '.join(diff)} differ): "
                "the engines could not load its exports"
            )
    return Path(chosen)


def train(
    ctx: typer.Context,
    sft: Annotated[bool, typer.Option("--sft", help="Supervised warm start on demonstrations.")] = False,
    sync: Annotated[
        bool, typer.Option("--sync", help="Synchronous baseline: train only on the current policy's data.")
    ] = False,
    max_steps: Annotated[Optional[int], typer.Option(min=1, help="Stop after N optimizer steps.")] = None,
    until_version: Annotated[
        Optional[int], typer.Option(min=1, help="Stop once the run's policy version reaches V (resumable).")
    ] = None,
    model: Annotated[Optional[Path], typer.Option(help="HF model directory to train.")] = None,
    router_url: Annotated[
        Optional[str], typer.Option(help="Router (or SGLang server) that loads the exports.")
    ] = None,
    output: Annotated[
        Optional[Path], typer.Option(help="--sft: directory for the final HF export.")
    ] = None,
    env: Annotated[Optional[str], typer.Option(help="--sft: environment (default rollout.env).")] = None,
) -> None:
    """Train on the store's ready groups (asynchronous GRPO), or --sft on demonstrations."""
    cfg = state(ctx).config()
    model_dir = resolve_model(cfg, model)
    if sft:
        from trainer.sft import run_sft

        out = output or Path(cfg.trainer.export_dir) / "sft"
        result = run_sft(cfg, model_dir, out, env_id=env or cfg.rollout.env,
                         steps=max_steps or cfg.trainer.sft_steps, log=console.print)
        console.print(f"SFT done: {result['steps']} steps, final loss {result['loss']:.4f}; "
                      f"checkpoint {result['checkpoint']}; HF export {out}")
        return
    import anyio

    from trainer.engine import engine
    from trainer.loop import TrainLoop
    from trainer.sync import check_reachable

    url = router_url or cfg.trainer.router_url or cfg.rollout.router_url
    if url:  # before the (slow) model build: a wrong URL fails in a second
        anyio.run(check_reachable, url)
    with engine(model_dir, cfg.trainer) as e:
        loop = TrainLoop(cfg, e, sync_mode=sync, router_url=router_url,
                         log=lambda line: console.print(line, highlight=False, soft_wrap=True))
        _stop_on_signals(loop)
        try:
            stats = loop.run(max_steps, until_version)
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise
    console.print(f"trained {stats.steps} steps (now policy version {stats.version}), "
                  f"{stats.episodes} episodes, idle {stats.idle_fraction:.1%} of {stats.wall_s:.0f}s")


def _stop_on_signals(loop) -> None:  # type: ignore[no-untyped-def]
    """SIGINT/SIGTERM: stop at the next safe point (after the step in progress, or at once while
    waiting for data) and checkpoint; a second one interrupts immediately. Our own handler also
    keeps asyncio.Runner from installing its one, which cancels the store call in flight instead
    (a Ctrl-C could then be swallowed while waiting for data)."""
    import signal

    def handle(signum, frame):  # type: ignore[no-untyped-def]
        if loop.stopping:
            raise KeyboardInterrupt
        err_console.print("stopping after the current step (again to interrupt)")
        loop.request_stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)
