"""SFT warm start: cross-entropy on demonstration transcripts, same model and checkpoint format.

`encode_transcript` renders a transcript with the model's chat template and tokenizes it piece
by piece: the text between assistant turns (system, user, tool observations, template markup)
has loss mask 0; each assistant completion, exactly its raw text, plus the `<|im_end|>` (eos)
that ends it, has loss mask 1, so the model learns to write the completion and to stop.
`run_sft` draws demonstrations of an environment (`agent_rl.demo.demonstrations`), takes
`steps` optimizer steps of `sft_batch_size` transcripts (cycling through them), then writes a
dist_checkpointing checkpoint to `out/checkpoint` and an HF export to `out` (start RL from it
with `--model out`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent_rl.config import Config
from agent_rl.errors import ConfigError
from agent_rl.messages import Message
from agent_rl.rollout.render import ChatRenderer


def encode_transcript(
    renderer: ChatRenderer, messages: list[Message], tools: list[dict[str, Any]]
) -> tuple[list[int], list[float]] | None:
    """(token ids, loss mask) of a whole conversation, or None if the template does not render
    the completions verbatim (then its tokens would not be what the model should write)."""
    completions = [str(m["content"]) for m in messages if m["role"] == "assistant"]
    if not completions:
        return None
    text = renderer.render(messages, tools, generation_prompt=False)
    anchor = renderer.generation_prompt(
        messages[: next(i for i, m in enumerate(messages) if m["role"] == "assistant")], tools
    )
    # The pieces of text around the completions, each completion found right after the
    # generation prompt (so a short completion is not matched inside earlier text).
    segments, pos = [], 0
    for c in completions:
        at = text.find(anchor + c, pos)
        if at < 0:
            return None
        segments.append(text[pos : at + len(anchor)])
        pos = at + len(anchor) + len(c)
    segments.append(text[pos:])
    ids: list[int] = []
    mask: list[float] = []
    for i, segment in enumerate(segments):
        if i > 0:  # the segment after a completion starts with the eos that ended it
            if not segment.startswith(renderer.eos_text):
                return None
            segment = segment[len(renderer.eos_text):]
        piece = renderer.encode(segment)
        ids += piece
        mask += [0.0] * len(piece)
        if i < len(completions):
            completion = renderer.encode(completions[i]) + [renderer.eos_id]
            ids += completion
            mask += [1.0] * len(completion)
    if mask and mask[0]:
        mask[0] = 0.0  # token 0 has no prediction
    return ids, mask


def run_sft(
    cfg: Config,
    model_dir: Path,
    out: Path,
    *,
    env_id: str,
    steps: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train `steps` SFT steps on demonstrations of `env_id`; write checkpoint and HF export."""
    import anyio

    from agent_rl.demo import demonstrations
    from trainer.batch import Batch
    from trainer.engine import engine

    tcfg = cfg.trainer
    size = tcfg.sft_batch_size
    count = min(tcfg.sft_demos, size * steps)
    log(f"SFT: collecting {count} demonstrations of {env_id}")
    transcripts = anyio.run(
        lambda: demonstrations(env_id, count, seed=tcfg.seed, **cfg.rollout.env_kwargs)
    )
    renderer = ChatRenderer(model_dir)
    encoded = [encode_transcript(renderer, t.messages, t.tools) for t in transcripts]
    data = [e for e in encoded if e is not None]
    if not data:
        raise ConfigError(
            f"none of {len(transcripts)} demonstrations of {env_id} renders verbatim with the chat "
            f"template of {model_dir}; SFT needs a template that keeps completions as written"
        )
    if len(data) < len(encoded):
        log(f"SFT: skipped {len(encoded) - len(data)} transcripts the template does not render verbatim")
    metrics: dict[str, float] = {}
    with engine(model_dir, tcfg, lr=tcfg.sft_lr) as e:
        for step in range(steps):
            rows = [data[(step * size + i) % len(data)] for i in range(size)]
            batch = Batch.from_sequences([r[0] for r in rows], [r[1] for r in rows])
            metrics = e.sft_step(batch)
            if step == 0 or (step + 1) % 10 == 0 or step + 1 == steps:
                log(f"SFT step {step + 1}/{steps}: loss {metrics['loss']:.4f} "
                    f"({int(metrics['tokens'])} tokens)")
        checkpoint = e.save_checkpoint(out / "checkpoint")
        e.export_hf(out)
    return {"steps": steps, "loss": metrics.get("loss", float("nan")), "checkpoint": checkpoint,
            "transcripts": len(data)}
