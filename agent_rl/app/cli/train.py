"""`agent-rl train`: the learner (trainer/loop.py), or `--sft` on demonstrations (trainer/sft.py).

Only orchestrates: resolve the model and router, build the learner, run the loop, print a
summary; for `--sft`, hand the demonstrations' token sequences (agent_rl/rollout/sft_data.py,
in sandboxes of the configured backend, which only the application opens) to trainer/sft.py.
torch and megatron-core are imported inside the command so `agent-rl --help` stays fast.
Errors are one line (ConfigError, StoreError, EngineError).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Annotated, Optional

import anyio
import typer

from agent_rl.app.cli.common import console, err_console, state
from agent_rl.config import Config
from agent_rl.kernel.errors import ConfigError, EngineError


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
    max_turns: Annotated[
        Optional[int],
        typer.Option(min=1, help="--sft: turns of a demonstration (default: the env's own "
                                 "max_turns, else rollout.max_turns)."),
    ] = None,
) -> None:
    """Train on the store's ready groups (asynchronous GRPO), or --sft on demonstrations."""
    cfg = state(ctx).config()
    model_dir = resolve_model(cfg, model)
    if sft:
        from agent_rl.rollout.sft_data import demonstrations_needed, sft_sequences
        from tools_sandbox.factory import open_backend
        from trainer.sft import run_sft

        out = output or Path(cfg.trainer.export_dir) / "sft"
        env_id = env or cfg.rollout.env
        count = demonstrations_needed(cfg.trainer.sft, max_steps)
        console.print(f"SFT: collecting {count} demonstrations of {env_id}")
        opener = functools.partial(open_backend, cfg.sandbox)
        data = anyio.run(functools.partial(sft_sequences, cfg, model_dir, env_id, count,
                                           open_sandboxes=opener, max_turns=max_turns))
        console.print(f"SFT: {data.cut} of {count} demonstrations were cut by a limit "
                      f"(max_turns {data.max_turns}) before their end and are left out")
        if data.skipped:
            console.print(f"SFT: skipped {data.skipped} transcripts the template does not render verbatim")
        result = run_sft(cfg.trainer, model_dir, out, data.sequences,
                         steps=max_steps or cfg.trainer.sft.steps, log=console.print)
        console.print(f"SFT done: {result['steps']} steps, final loss {result['loss']:.4f}; "
                      f"checkpoint {result['checkpoint']}; HF export {out}")
        return
    from trainer.learner import learner
    from trainer.loop import TrainLoop
    from trainer.weight_sync import router_url as sync_router_url

    url = sync_router_url(cfg, router_url)
    if url:  # before the (slow) model build: a wrong URL fails in a second
        anyio.run(check_router, url)
    with learner(model_dir, cfg.trainer) as e:
        loop = TrainLoop(cfg, e, sync_mode=sync, router_url=url,
                         log=lambda line: console.print(line, highlight=False, soft_wrap=True))
        _stop_on_signals(loop)
        try:
            stats = loop.run(max_steps, until_version)
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise
    console.print(f"trained {stats.steps} steps (now policy version {stats.version}), "
                  f"{stats.episodes} episodes, idle {stats.idle_fraction:.1%} of {stats.wall_s:.0f}s")


async def check_router(url: str) -> None:
    """EngineError, in one line, unless the router (or engine) at `url` answers."""
    from agent_rl.sglang.client import EngineClient

    async with EngineClient(url) as client:
        try:
            await client.model_info(timeout_s=5.0)
        except EngineError as e:
            why = type(e.__cause__).__name__ if e.__cause__ is not None else str(e)
            raise EngineError(
                f"router {url} is unreachable ({why}); start it "
                "(`agent-rl router` or `agent-rl serve`) or pass the right --router-url"
            ) from e


REPEAT_S = 1.0
"""A second signal this soon after the first is the same stop: a Ctrl-C under torchrun reaches
each rank twice, from the terminal and from torchrun passing it on to its workers."""


def _stop_on_signals(loop) -> None:  # type: ignore[no-untyped-def]
    """SIGINT/SIGTERM: stop at the next safe point (after the step in progress, or at once while
    waiting for data) and checkpoint; a second one interrupts immediately. Our own handler also
    keeps asyncio.Runner from installing its one, which cancels the store call in flight instead
    (a Ctrl-C could then be swallowed while waiting for data)."""
    import os
    import signal
    import time

    first: list[float] = []
    trainer = os.getpid()

    def handle(signum, frame):  # type: ignore[no-untyped-def]
        if os.getpid() != trainer:
            # A child forked with this handler: megatron's checkpoint writers are, and a launch's
            # stop signals the trainer's whole process tree. The stop is the trainer's: the
            # writer finishes its part of the checkpoint the trainer waits for (printing here,
            # it could block for good on a lock another thread held at the fork).
            return
        if first and time.monotonic() - first[0] > REPEAT_S:
            raise KeyboardInterrupt
        if first:  # the same stop, delivered twice (see REPEAT_S)
            return
        first.append(time.monotonic())
        err_console.print("stopping after the current step (again to interrupt)")
        loop.request_stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)
