"""`agent-rl train --sft`: demonstrations tokenized with the chat template (loss on exactly the
completions and their end-of-turn token), loss going down, checkpoint and HF export written."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

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


@pytest.mark.slow  # ~30 s: the CLI's process builds the model, steps once and exports
def test_train_sft_runs_demonstrations_to_the_envs_max_turns_and_reports_the_cut(
    tiny_dense_model: Path, tmp_path: Path
) -> None:
    """`agent-rl train --sft` on `long-tail` with the env's own `max_turns = 30`: it collects
    demonstrations of up to 30 turns (not 16, nor rollout.max_turns' 8) and says how many were
    cut by the limit (left out of training), as the library counts them."""
    import subprocess
    import sys

    from agent_rl.config import Config
    from agent_rl.rollout.sft_data import sft_sequences
    from tests.rollout.test_sft_data import LONG_SEARCH

    kwargs = ", ".join(f"{k} = {v}" for k, v in LONG_SEARCH.items())
    (tmp_path / "agent-rl.toml").write_text(
        f"[rollout]\nenv = \"long-tail\"\nenv_kwargs = {{ {kwargs} }}\n"
        "[trainer]\nmicro_batch_size = 8\ncheckpoint_dir = \"ckpt\"\ntensorboard_dir = \"tb\"\n"
        "[trainer.sft]\nbatch_size = 8\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", "from agent_rl.app.cli import main; main()", "train", "--sft",
         "--model", str(tiny_dense_model), "--output", "sft", "--max-steps", "1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = asyncio.run(sft_sequences(Config(rollout={"env_kwargs": LONG_SEARCH}),
                                     tiny_dense_model, "long-tail", 8))
    assert data.max_turns == 30 and data.cut > 0
    line = " ".join(proc.stdout.split())
    assert (f"SFT: {data.cut} of 8 demonstrations were cut by a limit (max_turns 30) before "
            "their end and are left out") in line
    assert (tmp_path / "sft" / "model.safetensors").is_file()
