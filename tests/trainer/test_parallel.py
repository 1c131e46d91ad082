"""Tensor, pipeline and expert parallelism give the same training as one process (torchrun,
gloo, CPU).

Each case (tests/trainer/_parallel_worker.py) takes the logprobs of a batch, trains 2 RL steps
(lr 1e-3) on the same data, exports HF weights, checkpoints and takes an SFT step, then takes
it again from the loaded checkpoint. Against the one-process baseline: starting logprobs and
the RL losses agree to 1e-6, the SFT loss (~6.9, at weights two steps apart) to 1e-6 relative,
grad norms to 1e-4 relative, exported weights to 1e-4, a tenth of one step's size, but for a
few elements each (`_assert_exports_agree`): Adam divides by sqrt(v) + eps, so an element whose
gradient is within rounding of zero (|g| ~ eps = 1e-8) turns the last-bit differences of another
reduction order into update differences of up to ~lr a step (glm4_moe's dense o_proj: 1.5e-4 on
one machine, 2.7e-5 on another; one process with other micro-batch sizes moves the same
elements). The SFT step from the loaded checkpoint equals the one before it bit for bit.
(Measured: docs/trainer.md, "Measured".)

Pipeline parallelism runs megatron's 1F1B schedule: PP=2 alone (dense, qwen2 and llama; MoE with
routing replay, each stage replaying its own layers' experts, qwen3_moe and the families whose
first layer is dense, glm4_moe and deepseek_v3), TP=2 x PP=2 (dense with tied embeddings, whose
last stage holds a copy of the embedding as its output layer) and EP=2 x PP=2 (MoE, data
parallel 2 as well) on 4 ranks. Each stage holds half the layers, so loading and the export
also check the global layer numbering.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from agent_rl.models import init_model
from tests.trainer._parallel_worker import train
from trainer import dist_env
from trainer.hf_convert import is_draft, read_safetensors

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_parallel_worker.py")
Baseline = tuple[list[dict[str, float]], Path]


def _baseline(model_dir: Path, out: Path) -> Baseline:
    try:
        return train(model_dir, out), out
    finally:
        dist_env.teardown()


@pytest.fixture(scope="module")
def moe_baseline(tiny_moe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    return _baseline(tiny_moe_model, tmp_path_factory.mktemp("moe-one-process"))


@pytest.fixture(scope="module")
def tiny_tied_model(tiny_dense_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-dense with tied input and output embeddings (no lm_head.weight), as Qwen2-0.5B."""
    out = tmp_path_factory.mktemp("tiny-tied")
    for f in tiny_dense_model.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = read_safetensors(tiny_dense_model)
    del weights["lm_head.weight"]
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _launch(model_dir: Path, out: Path, *runs: str, ranks: int = 2) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            str(WORKER),
            str(model_dir),
            str(out),
            *runs,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,  # the assertion below shows the ranks' stderr
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _metrics(out: Path) -> list[dict[str, float]]:
    return json.loads((out / "metrics.json").read_text())


def _compare(
    base: list[dict[str, float]], other: list[dict[str, float]], base_dir: Path, other_dir: Path,
    draft_atol: float = 1e-4,
) -> None:
    """The runs' steps, logprobs and exported weights agree; an MTP draft's weights (`mtp.*`,
    EAGLE's) to `draft_atol`."""
    for a, b in zip(base, other, strict=True):
        print(
            f"loss {a['loss']:.9f} vs {b['loss']:.9f} ({abs(a['loss'] - b['loss']):.1e}); "
            f"grad norm {a['grad_norm']:.7f} vs {b['grad_norm']:.7f}"
        )
        assert abs(a["loss"] - b["loss"]) < 1e-6 * max(1.0, abs(a["loss"]))
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * max(1.0, a["grad_norm"])
        assert a["tokens"] == b["tokens"]
        if "routing_mismatch_fraction" in a:
            assert abs(a["routing_mismatch_fraction"] - b["routing_mismatch_fraction"]) < 1e-9
    assert other[-1]["resume_max_diff"] == 0.0
    lp = (torch.load(base_dir / "logprobs.pt") - torch.load(other_dir / "logprobs.pt")).abs().max()
    print(f"max logprob diff {float(lp):.2e}")
    assert lp < 1e-6
    _assert_exports_agree(read_safetensors(base_dir / "export"),
                          read_safetensors(other_dir / "export"), draft_atol)  # fmt: skip


LR, STEPS = 1e-3, 2
"""The runs' learning rate and RL steps before the export (tests/trainer/_parallel_worker.py)."""


def _assert_exports_agree(
    w1: dict[str, torch.Tensor], w2: dict[str, torch.Tensor], draft_atol: float = 1e-4
) -> None:
    """Two exports of the same training under other reduction orders agree: every element to
    1e-4 (an MTP draft's, `mtp.*` and EAGLE's, to `draft_atol`), a tenth of one step, except at
    most one in a thousand of a tensor's elements (at least one), each within 2 * lr per step.
    Those are the elements whose gradient is within rounding of zero: Adam's update
    lr * m / (sqrt(v) + eps) has slope lr / eps there, so a gradient that differs in its last
    bits (~1e-9 where |g| ~ eps) moves by up to ~lr otherwise (each run's move is at most ~lr
    a step: Adam's first two steps are bounded by lr). A layout or gather error (a head, a
    row-parallel half in another order) moves most of a tensor's elements by the weights' own
    size (~1e-2), which this refuses."""
    assert set(w1) == set(w2)
    worst = {"policy": 0.0, "draft": 0.0}
    for name in w1:
        diff = (w1[name] - w2[name]).abs().flatten()
        kind = "draft" if is_draft(name) else "policy"
        atol = draft_atol if kind == "draft" else 1e-4
        outliers = int((diff >= atol).sum())
        assert outliers <= max(1, diff.numel() // 1000), (name, outliers, diff.numel())
        assert diff.max().item() <= 2 * LR * STEPS, (name, diff.max().item())
        worst[kind] = max(worst[kind], diff.max().item())
    print(f"max exported weight diff {worst['policy']:.2e}, draft {worst['draft']:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize(("model", "runs"), [("tiny_dense_model", ("tp2", "pp2")),
                                             ("tiny_llama_tied_model", ("tp2", "pp2"))])  # fmt: skip
def test_tp2_and_pp2_match_one_process_dense(
    model: str, runs: tuple[str, ...], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """qwen2, and llama's tied variant (tied embeddings, Llama 3's rope scaling: TP=2 splits
    its tied vocab-parallel embedding, which the output layer shares)."""
    model_dir = request.getfixturevalue(model)
    base, base_dir = _baseline(model_dir, tmp_path / "one")
    _launch(model_dir, tmp_path, *runs)
    for run in runs:
        _compare(base, _metrics(tmp_path / run), base_dir, tmp_path / run)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-glm4-moe", "tiny-deepseek_v3"])
def test_pp2_matches_one_process_with_dense_first_layers(preset: str, tmp_path: Path) -> None:
    """The MoE families whose first layer is dense, at 4 layers so that PP=2 splits them evenly:
    the first stage holds the dense layer and an MoE one; each stage replays its own experts."""
    model_dir = init_model(tmp_path / preset, preset, num_hidden_layers=4)
    base, base_dir = _baseline(model_dir, tmp_path / "one")
    assert 0 < base[0]["routing_mismatch_fraction"] <= 1  # the replayed experts are not free routing
    _launch(model_dir, tmp_path, "pp2")
    _compare(base, _metrics(tmp_path / "pp2"), base_dir, tmp_path / "pp2")


@pytest.mark.slow
def test_ep2_tp2_and_pp2_match_one_process_moe(
    tiny_moe_model: Path, moe_baseline: Baseline, tmp_path: Path
) -> None:
    base, base_dir = moe_baseline
    assert 0 < base[0]["routing_mismatch_fraction"] <= 1  # replayed experts are not free routing
    # tp2: sequence parallel + replay chunks; pp2: each stage replays its own layers
    _launch(tiny_moe_model, tmp_path, "ep2", "tp2", "pp2")
    for run in ("ep2", "tp2", "pp2"):
        _compare(base, _metrics(tmp_path / run), base_dir, tmp_path / run)


@pytest.mark.slow
def test_tp2_x_pp2_and_ep2_x_pp2_match_one_process(
    tiny_tied_model: Path, tiny_moe_model: Path, moe_baseline: Baseline, tmp_path: Path
) -> None:
    moe, moe_dir = moe_baseline
    tied, tied_dir = _baseline(tiny_tied_model, tmp_path / "tied-one")
    _launch(tiny_moe_model, tmp_path, "ep2pp2", f"tp2pp2@{tiny_tied_model}", ranks=4)
    _compare(moe, _metrics(tmp_path / "ep2pp2"), moe_dir, tmp_path / "ep2pp2")
    _compare(tied, _metrics(tmp_path / "tp2pp2"), tied_dir, tmp_path / "tp2pp2")
