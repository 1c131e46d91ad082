"""SFT warm start: cross-entropy on given token sequences, same model and checkpoint format.

`run_sft` takes `(token ids, loss mask)` sequences (for demonstrations, made by
`agent_rl.rollout.sft_data`: loss on each completion and the `<|im_end|>` that ends it),
takes `steps` optimizer steps of `trainer.sft.batch_size` sequences (cycling through them),
then writes a dist_checkpointing checkpoint to `out/checkpoint` and an HF export to `out` (start
RL from it with `--model out`). It knows nothing of environments: the application layer brings
the data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agent_rl.config import TrainerConfig
from agent_rl.kernel.errors import ConfigError

TokenSequence = tuple[Sequence[int], Sequence[float]]
"""Token ids and their loss mask (1.0 on the tokens to learn), of equal length."""


def run_sft(
    cfg: TrainerConfig,
    model_dir: Path,
    out: Path,
    sequences: Sequence[TokenSequence],
    *,
    steps: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train `steps` SFT steps on `sequences`; write checkpoint and HF export."""
    from trainer.batch import Batch
    from trainer.learner import learner

    if not sequences:
        raise ConfigError("SFT needs at least one token sequence")
    size = cfg.sft.batch_size
    metrics: dict[str, float] = {}
    with learner(model_dir, cfg, lr=cfg.sft.lr) as e:
        for step in range(steps):
            rows = [sequences[(step * size + i) % len(sequences)] for i in range(size)]
            batch = Batch.from_sequences([r[0] for r in rows], [r[1] for r in rows])
            metrics = e.sft_step(batch)
            if step == 0 or (step + 1) % 10 == 0 or step + 1 == steps:
                log(f"SFT step {step + 1}/{steps}: loss {metrics['loss']:.4f} "
                    f"({int(metrics['tokens'])} tokens)")
        checkpoint = e.save_checkpoint(out / "checkpoint")
        e.export_hf(out)
    return {"steps": steps, "loss": metrics.get("loss", float("nan")), "checkpoint": checkpoint,
            "sequences": len(sequences)}
