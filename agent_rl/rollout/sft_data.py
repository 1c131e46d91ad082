"""Supervised warm-start data: an environment's demonstrations as token sequences.

`demonstration_sequences` plays the env's teacher policy (`agent_rl.sdk.demonstrations.demonstrations`) on
the first tasks of its stream and encodes each transcript with the model's chat template
(`render.encode_transcript`): loss on exactly each completion and its end-of-turn token. The
trainer's SFT (`trainer.sft.run_sft`) consumes these sequences and nothing else, so it never
reaches back into environments or sandboxes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_rl.sdk.demonstrations import SandboxFactory, demonstrations
from agent_rl.kernel.errors import ConfigError
from agent_rl.rollout.render import ChatRenderer, encode_transcript


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
