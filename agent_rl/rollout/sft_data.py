"""Supervised warm-start data: an environment's demonstrations as token sequences.

`demonstration_sequences` plays the env's teacher policy (`agent_rl.sdk.demonstrations.demonstrations`) on
the first tasks of its stream and encodes each transcript with the model's chat template
(`render.encode_transcript`): loss on exactly each completion and its end-of-turn token. The
trainer's SFT (`trainer.sft.run_sft`) consumes these sequences and nothing else, so it never
reaches back into environments or sandboxes.

`sft_sequences` is what `agent-rl train --sft` collects: `demonstrations_needed` of the
configured env (`rollout.env_kwargs`, seeded by `trainer.seed`), in sandboxes of the backend the
application opens when the env needs them (only the application chooses a backend,
docs/layers.md, so it passes the opener in).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_rl.config import Config
from agent_rl.config.trainer import SftConfig
from agent_rl.kernel.errors import ConfigError
from agent_rl.rollout.render import ChatRenderer, encode_transcript
from agent_rl.sdk.demonstrations import SandboxFactory, demonstrations
from agent_rl.sdk.registry import make
from agent_rl.sdk.sandbox import Sandbox, SandboxBackend, SandboxSpec

SandboxOpener = Callable[[], Awaitable[SandboxBackend]]
"""Opens the configured sandbox backend (the application's `tools_sandbox.factory.open_backend`
on `cfg.sandbox`); the collection closes it."""


@dataclass
class Sequences:
    """Token sequences with their loss masks, and how many transcripts could not be encoded."""

    sequences: list[tuple[list[int], list[float]]]
    skipped: int


async def demonstration_sequences(
    env_id: str,
    count: int,
    model_dir: Path,
    *,
    seed: int = 0,
    env_kwargs: Mapping[str, Any] | None = None,
    sandbox_factory: SandboxFactory | None = None,
) -> Sequences:
    """`count` demonstrations of `env_id`, encoded with the chat template of `model_dir`;
    ConfigError if none renders verbatim with that template."""
    transcripts = await demonstrations(
        env_id, count, seed=seed, env_kwargs=env_kwargs, sandbox_factory=sandbox_factory
    )
    renderer = ChatRenderer(model_dir)
    encoded = [encode_transcript(renderer, t.messages, t.tools) for t in transcripts]
    sequences = [e for e in encoded if e is not None]
    if not sequences:
        raise ConfigError(
            f"none of {len(transcripts)} demonstrations of {env_id} renders verbatim with the chat "
            f"template of {model_dir}; SFT needs a template that keeps completions as written"
        )
    return Sequences(sequences, len(encoded) - len(sequences))


def demonstrations_needed(sft: SftConfig, steps: int | None = None) -> int:
    """As many demonstrations as `steps` (unset: `sft.steps`) steps of `sft.batch_size`
    transcripts use, at most `sft.demos` (the run then cycles through them)."""
    return min(sft.demos, sft.batch_size * (steps or sft.steps))


async def sft_sequences(
    cfg: Config, model_dir: Path, env_id: str, count: int,
    *, open_sandboxes: SandboxOpener | None = None,
) -> Sequences:
    """`count` demonstrations of `env_id` (made with `rollout.env_kwargs`, seeded by
    `trainer.seed`) encoded with the chat template of `model_dir`. An env that needs sandboxes
    runs in ones of the backend `open_sandboxes` opens (closed after); ConfigError without it."""
    kwargs = cfg.rollout.env_kwargs
    if not make(env_id, **kwargs).needs_sandbox:
        return await demonstration_sequences(env_id, count, model_dir, seed=cfg.trainer.seed,
                                             env_kwargs=kwargs)
    if open_sandboxes is None:
        raise ConfigError(f"the demonstrations of {env_id} run in sandboxes, and no sandbox "
                          "backend was given to run them in")
    backend = await open_sandboxes()

    async def create(spec: SandboxSpec | None) -> Sandbox:
        return await backend.create(spec or SandboxSpec())

    try:
        return await demonstration_sequences(env_id, count, model_dir, seed=cfg.trainer.seed,
                                             env_kwargs=kwargs, sandbox_factory=create)
    finally:
        await backend.aclose()
