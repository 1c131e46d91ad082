"""Supervised warm-start data: an environment's demonstrations as token sequences.

`demonstration_sequences` plays the env's teacher policy (`agent_rl.sdk.demonstrations.demonstrations`) on
the first tasks of its stream and encodes each transcript with the model's chat template
(`render.encode_transcript`): loss on exactly each completion and its end-of-turn token. The
trainer's SFT (`trainer.sft.run_sft`) consumes these sequences and nothing else, so it never
reaches back into environments or sandboxes.

`sft_sequences` is what `agent-rl train --sft` collects: `demonstrations_needed` of the
configured env (`rollout.env_kwargs`, seeded by `trainer.seed`; for an agent env, of the SDK env
it names in `demonstrations_from`, e.g. a `verifiers:` env's `demonstrations` kwarg; one that
names none is refused in one line), in sandboxes of the backend the
application opens when the env needs them (only the application chooses a backend,
docs/layers.md, so it passes the opener in). Each demonstration runs to the turn limit given
(`train --sft --max-turns`), else the env's own `max_turns`, else `rollout.max_turns`, the limit
its RL episodes have. A demonstration cut by a limit before its natural end is left out of the
sequences and counted (`Sequences.cut`), so it is reported and never trained silently.
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
from agent_rl.sdk.agent import AgentEnv
from agent_rl.sdk.demonstrations import SandboxFactory, demonstrations
from agent_rl.sdk.registry import make
from agent_rl.sdk.sandbox import Sandbox, SandboxBackend, SandboxSpec

SandboxOpener = Callable[[], Awaitable[SandboxBackend]]
"""Opens the configured sandbox backend (the application's `tools_sandbox.factory.open_backend`
on `cfg.sandbox`); the collection closes it."""


@dataclass
class Sequences:
    """Token sequences with their loss masks, how many transcripts could not be encoded, and how
    many were cut by a limit (both left out)."""

    sequences: list[tuple[list[int], list[float]]]
    skipped: int
    cut: int = 0
    """Demonstrations that ended at a limit (turns, the env's truncation) before their natural
    end: not among the sequences."""
    max_turns: int | None = None
    """The turn limit the demonstrations ran under (None: the env's own, else the default)."""


async def demonstration_sequences(
    env_id: str,
    count: int,
    model_dir: Path,
    *,
    seed: int = 0,
    env_kwargs: Mapping[str, Any] | None = None,
    sandbox_factory: SandboxFactory | None = None,
    max_turns: int | None = None,
) -> Sequences:
    """`count` demonstrations of `env_id` of at most `max_turns` turns (unset: the env's own
    limit, else the SDK's default), encoded with the chat template of `model_dir`; those cut by a
    limit are left out and counted. ConfigError if none is left to train on."""
    transcripts = await demonstrations(
        env_id, count, seed=seed, env_kwargs=env_kwargs, sandbox_factory=sandbox_factory,
        max_turns=max_turns,
    )  # fmt: skip
    whole = [t for t in transcripts if not t.cut]
    cut = len(transcripts) - len(whole)
    if not whole:
        raise ConfigError(
            f"all {len(transcripts)} demonstrations of {env_id} were cut by a limit before their "
            f"end (max_turns {max_turns or 'of the env'}): give more turns (train --sft "
            "--max-turns, or the env's max_turns)"
        )
    renderer = ChatRenderer(model_dir)
    encoded = [encode_transcript(renderer, t.messages, t.tools) for t in whole]
    sequences = [e for e in encoded if e is not None]
    if not sequences:
        raise ConfigError(
            f"none of {len(whole)} demonstrations of {env_id} renders verbatim with the chat "
            f"template of {model_dir}; SFT needs a template that keeps completions as written"
        )
    return Sequences(sequences, len(encoded) - len(sequences), cut, max_turns)


def demonstrations_needed(sft: SftConfig, steps: int | None = None) -> int:
    """As many demonstrations as `steps` (unset: `sft.steps`) steps of `sft.batch_size`
    transcripts use, at most `sft.demos` (the run then cycles through them)."""
    return min(sft.demos, sft.batch_size * (steps or sft.steps))


async def sft_sequences(
    cfg: Config, model_dir: Path, env_id: str, count: int,
    *, open_sandboxes: SandboxOpener | None = None, max_turns: int | None = None,
) -> Sequences:
    """`count` demonstrations of `env_id` (made with `rollout.env_kwargs`, seeded by
    `trainer.seed`) encoded with the chat template of `model_dir`, each of at most `max_turns`
    turns (unset: the env's own `max_turns`, else `rollout.max_turns`). An env that needs
    sandboxes runs in ones of the backend `open_sandboxes` opens (closed after); ConfigError
    without it."""
    kwargs = cfg.rollout.env_kwargs
    env = make(env_id, **kwargs)
    if isinstance(env, AgentEnv):
        source = env.demonstrations_from()
        if source is None:
            raise ConfigError(
                f"{env_id} is an agent environment: its program, not a teacher, writes its "
                "episodes, so it has no demonstrations; pass train --sft --env <an SDK env whose "
                "prompts it shares> (or, for verifiers:..., the env kwarg demonstrations=<id>)")
        env_id, kwargs = source
        env = make(env_id, **kwargs)
    max_turns = max_turns or env.max_turns or cfg.rollout.max_turns
    if not env.needs_sandbox:
        return await demonstration_sequences(env_id, count, model_dir, seed=cfg.trainer.seed,
                                             env_kwargs=kwargs, max_turns=max_turns)
    if open_sandboxes is None:
        raise ConfigError(f"the demonstrations of {env_id} run in sandboxes, and no sandbox "
                          "backend was given to run them in")
    backend = await open_sandboxes()

    async def create(spec: SandboxSpec | None) -> Sandbox:
        return await backend.create(spec or SandboxSpec())

    try:
        return await demonstration_sequences(env_id, count, model_dir, seed=cfg.trainer.seed,
                                             env_kwargs=kwargs, sandbox_factory=create,
                                             max_turns=max_turns)
    finally:
        await backend.aclose()
