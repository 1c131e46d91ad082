"""`agent-rl train --sft`: demonstrations tokenized with the chat template (loss on exactly the
completions and their end-of-turn token), loss going down, checkpoint and HF export written."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agent_rl.config import TrainerConfig
from agent_rl.sdk.demonstrations import demonstrations
from agent_rl.rollout.sft_data import demonstration_sequences
from agent_rl.rollout.render import ChatRenderer, encode_transcript
from trainer.sft import run_sft


def test_transcript_mask_covers_completions_and_their_end(tiny_dense_model: Path) -> None:
    renderer = ChatRenderer(tiny_dense_model)
    transcript = asyncio.run(demonstrations("calculator", 1, seed=0))[0]
    encoded = encode_transcript(renderer, transcript.messages, transcript.tools)
    assert encoded is not None
    ids, mask = encoded
    assert len(ids) == len(mask) and mask[0] == 0.0
    # The masked tokens are exactly each completion followed by <|im_end|>.
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    expected = [renderer.encode(c) + [renderer.eos_id] for c in transcript.completions()]
    assert runs == expected
    # Masked and unmasked pieces together are the template's rendering of the conversation.
    assert renderer.decode(ids) == renderer.render(
        transcript.messages, transcript.tools, generation_prompt=False
    )


def test_sft_lowers_loss_and_exports(tiny_dense_model: Path, tmp_path: Path) -> None:
    cfg = TrainerConfig(sft={"lr": 1e-3, "batch_size": 2}, micro_batch_size=2,
                        checkpoint_dir=tmp_path / "unused")
    lines: list[str] = []
    out = tmp_path / "sft"
    data = asyncio.run(demonstration_sequences("calculator", 20, tiny_dense_model))
    assert data.skipped == 0 and len(data.sequences) == 20
    result = run_sft(cfg, tiny_dense_model, out, data.sequences, steps=10, log=lines.append)
    print("\n".join(lines))
    losses = [float(line.split("loss ")[1].split()[0]) for line in lines if "SFT step" in line]
    assert losses[-1] < losses[0]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert Path(result["checkpoint"]).is_dir()


def test_env_kwargs_named_like_parameters_reach_the_env(tiny_dense_model: Path) -> None:
    """`rollout.env_kwargs` travel as one mapping: keys named like the demonstration functions'
    own parameters (n, seed, split, sandbox_factory, id) once raised TypeError there."""
    from agent_rl.sdk.registry import register, unregister
    from envs.calculator.env import CalculatorEnv

    seen: dict = {}

    class Configurable(CalculatorEnv):
        def __init__(self, *, n: int = 0, seed: int = 0, split: str = "", sandbox_factory: object = None,
                     id: str = "", **kwargs: object) -> None:  # noqa: A002
            super().__init__(**kwargs)  # type: ignore[arg-type]
            seen.update(n=n, seed=seed, split=split, sandbox_factory=sandbox_factory, id=id)

    register("test-configurable", Configurable)
    try:
        kwargs = {"n": 7, "seed": 5, "split": "x", "sandbox_factory": "y", "id": "z"}
        data = asyncio.run(demonstration_sequences("test-configurable", 3, tiny_dense_model, env_kwargs=kwargs))
        assert len(data.sequences) == 3 and seen == kwargs
    finally:
        unregister("test-configurable")
