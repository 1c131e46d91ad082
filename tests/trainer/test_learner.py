"""Engine: RL/SFT steps with Megatron's optimizer, checkpoint resume, HF export (real
megatron-core on CPU, one process)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from agent_rl.config import TrainerConfig
from tests.trainer._batches import rl_batch
from trainer.arch import ModelArch
from trainer.checkpoint import latest_checkpoint
from trainer.learner import learner


def test_trainer_logprobs_match_transformers(tiny_dense_model: Path) -> None:
    vocab = ModelArch.from_hf_dir(tiny_dense_model).vocab_size
    batch = rl_batch(vocab, size=3)
    with learner(tiny_dense_model, TrainerConfig(micro_batch_size=2)) as e:
        ours = e.logprobs(batch)["logprobs"]
    hf = AutoModelForCausalLM.from_pretrained(tiny_dense_model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=batch.tokens).logits, -1)
    ref = ref[:, :-1].gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    diff = ((ours[:, 1:] - ref).abs() * batch.loss_mask[:, 1:]).sum() / batch.loss_mask[:, 1:].sum()
    print(f"trainer vs transformers logprobs: mean abs diff {diff:.2e}")
    assert diff < 1e-5 and ours[:, 0].eq(0).all()


def test_micro_batching_does_not_change_the_step(tiny_dense_model: Path) -> None:
    vocab = ModelArch.from_hf_dir(tiny_dense_model).vocab_size
    batch = rl_batch(vocab)
    results = []
    for micro in (8, 3):
        with learner(tiny_dense_model, TrainerConfig(micro_batch_size=micro, optim={"lr": 1e-3})) as e:
            first = e.rl_step(batch)
            results.append((first["loss"], first["grad_norm"], e.logprobs(batch)["logprobs"]))
    assert abs(results[0][0] - results[1][0]) < 1e-6
    assert abs(results[0][1] - results[1][1]) < 1e-6
    assert (results[0][2] - results[1][2]).abs().max() < 1e-5


def test_rl_steps_report_metrics_and_move_the_policy(tiny_dense_model: Path) -> None:
    vocab = ModelArch.from_hf_dir(tiny_dense_model).vocab_size
    batch = rl_batch(vocab)
    with learner(tiny_dense_model, TrainerConfig(optim={"lr": 1e-3}, micro_batch_size=4)) as e:
        before = e.logprobs(batch)["logprobs"]
        metrics = e.rl_step(batch)
        after = e.logprobs(batch)["logprobs"]
    for key in (
        "loss",
        "grad_norm",
        "entropy",
        "clip_fraction",
        "policy_kl",
        "train_rollout_logprob_abs_diff",
        "tis_weight_mean",
    ):
        assert key in metrics, key
    assert metrics["tokens"] == batch.loss_mask[:, 1:].sum().item() and metrics["step"] == 1
    assert metrics["grad_norm"] > 0 and (after - before).abs().max() > 1e-4
    # sequences with positive advantage became more likely on their policy tokens
    gain = ((after - before) * batch.loss_mask).sum(-1)
    assert (gain[batch.advantages > 0] > 0).all()


@pytest.mark.parametrize("distributed", [True, False])
def test_weight_decay_skips_biases_and_norms(tiny_dense_model: Path, distributed: bool) -> None:
    """`weight_decay` shrinks the weight matrices and leaves biases and norm weights (1-d) to
    Adam alone, as megatron's parameter groups intend."""
    batch = rl_batch(ModelArch.from_hf_dir(tiny_dense_model).vocab_size, size=4)
    after = []
    for decay in (0.0, 0.5):
        cfg = TrainerConfig(optim={"lr": 1e-2, "weight_decay": decay}, micro_batch_size=4,
                            parallel={"distributed_optimizer": distributed})  # fmt: skip
        with learner(tiny_dense_model, cfg) as e:
            e.rl_step(batch)
            after.append({n: p.detach().clone() for n, p in e.module.named_parameters()})
    flat = [n for n, p in after[0].items() if p.dim() == 1]
    assert any(n.endswith(".bias") for n in flat) and any("layernorm" in n for n in flat)
    for name, value in after[0].items():
        same = torch.equal(value, after[1][name])
        assert same == (value.dim() == 1), name


def test_sft_steps_lower_the_nll(tiny_dense_model: Path) -> None:
    vocab = ModelArch.from_hf_dir(tiny_dense_model).vocab_size
    batch = rl_batch(vocab, size=4)
    with learner(tiny_dense_model, TrainerConfig(micro_batch_size=4), lr=1e-3) as e:
        nll = [e.sft_step(batch)["nll"] for _ in range(4)]
    assert nll[-1] < nll[0] - 0.1, nll


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"parallel": {"distributed_optimizer": False},
         "loss": {"policy_loss": "gspo", "aggregation": "seq-mean-token-mean"}},
    ],
)
def test_checkpoint_resume_gives_identical_steps(
    options: dict[str, object], tiny_moe_model: Path, tmp_path: Path
) -> None:
    vocab = ModelArch.from_hf_dir(tiny_moe_model).vocab_size
    batches = [rl_batch(vocab, size=4, seed=s) for s in range(4)]
    # Weight decay: the optimizer's groups (decayed or not) resume with their own settings.
    cfg = TrainerConfig(optim={"lr": 1e-3, "weight_decay": 0.1}, micro_batch_size=4, **options)
    with learner(tiny_moe_model, cfg) as e:
        # Two steps before the checkpoint: Adam's step count (its bias correction) must resume
        # as 2, not as the placeholder state's 1 that loading starts from.
        e.rl_step(batches[0])
        e.rl_step(batches[1])
        saved = e.save_checkpoint(tmp_path / "ckpt")
        expected = [e.rl_step(b) for b in batches[2:]]
        expected_lp = e.logprobs(batches[0])["logprobs"]
    assert latest_checkpoint(tmp_path / "ckpt") == saved
    with learner(tiny_moe_model, cfg) as e:
        assert e.load_checkpoint(saved) == 2
        resumed = [e.rl_step(b) for b in batches[2:]]
        resumed_lp = e.logprobs(batches[0])["logprobs"]
    for a, b in zip(expected, resumed):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    assert torch.equal(expected_lp, resumed_lp)


def test_keep_checkpoints_deletes_all_but_the_newest(tiny_dense_model: Path, tmp_path: Path) -> None:
    vocab = ModelArch.from_hf_dir(tiny_dense_model).vocab_size
    batch = rl_batch(vocab, size=4)
    ckpt = tmp_path / "ckpt"
    with learner(tiny_dense_model, TrainerConfig(micro_batch_size=4)) as e:
        saved = []
        for _ in range(3):
            e.rl_step(batch)
            saved.append(e.save_checkpoint(ckpt, keep=2))
    assert sorted(ckpt.iterdir()) == saved[1:]
    # A deletion cut short (a crash) leaves `step_N.tmp`, never taken for a checkpoint, and
    # the next save's pruning removes it.
    cut_short = ckpt / f"{saved[0].name}.tmp"
    cut_short.mkdir()
    assert latest_checkpoint(ckpt) == saved[2]
    with learner(tiny_dense_model, TrainerConfig(micro_batch_size=4)) as e:
        assert e.load_checkpoint(latest_checkpoint(ckpt)) == 3
        e.rl_step(batch)
        saved.append(e.save_checkpoint(ckpt, keep=2))
    assert sorted(ckpt.iterdir()) == saved[2:] and not cut_short.exists()


def test_export_is_loaded_by_transformers_with_the_trained_weights(
    tiny_moe_model: Path, tmp_path: Path
) -> None:
    vocab = ModelArch.from_hf_dir(tiny_moe_model).vocab_size
    batch = rl_batch(vocab, size=4)
    with learner(tiny_moe_model, TrainerConfig(optim={"lr": 1e-3}, micro_batch_size=4)) as e:
        e.rl_step(batch)
        ours = e.logprobs(batch)["logprobs"]
        out = e.export_hf(tmp_path / "export")
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=batch.tokens).logits, -1)
    ref = ref[:, :-1].gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    assert (ours[:, 1:] - ref).abs().max() < 1e-5


def test_kl_to_the_starting_policy_grows_from_zero(tiny_dense_model: Path) -> None:
    vocab = ModelArch.from_hf_dir(tiny_dense_model).vocab_size
    batch = rl_batch(vocab, size=4)
    cfg = TrainerConfig(optim={"lr": 1e-3}, micro_batch_size=4, loss={"kl_coef": 0.1})
    with learner(tiny_dense_model, cfg) as e:
        start = e.logprobs(batch)["logprobs"]
        first, second = e.rl_step(batch), e.rl_step(batch)
        trained = e.logprobs(batch)["logprobs"]
        reference = e._reference_logprobs(e._micro_batches(batch))[0]
        assert torch.equal(e.logprobs(batch)["logprobs"], trained)  # weights swapped back
    assert first["ref_kl"] == 0.0 and second["ref_kl"] > 0  # the reference is the start
    assert torch.equal(reference, start[:, 1:]) and not torch.equal(trained, start)


def _gloo_threads() -> int:
    tasks = Path("/proc/self/task")
    return sum((t / "comm").read_text().startswith(("gloo", "pt_gloo")) for t in tasks.iterdir())


def test_a_closed_learner_frees_its_model_and_process_groups(tiny_moe_model: Path) -> None:
    """Megatron keeps cycles through autograd nodes, which gc cannot see: DDP's gradient hooks
    hold the DDP, and the MoE dispatcher keeps its last `probs`, whose graph reaches them. Before
    `Learner.release` every learner stayed alive after its `with` block, with its ~20 gloo groups
    and their threads (a CI session reached 1,700 threads polling)."""
    vocab = ModelArch.from_hf_dir(tiny_moe_model).vocab_size
    before = _gloo_threads()
    with learner(tiny_moe_model, TrainerConfig(optim={"lr": 1e-3}, routing_replay=True)) as e:
        e.rl_step(rl_batch(vocab, size=4, length=24))
        model = weakref.ref(e.model)
        assert _gloo_threads() > before + 10  # the groups this test is about
    del e
    gc.collect()
    assert model() is None
    assert _gloo_threads() <= before
