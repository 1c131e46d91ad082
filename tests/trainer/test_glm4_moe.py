"""The glm4_moe family through the trainer (fp32, CPU, real megatron-core): the learner computes
what transformers' Glm4MoeForCausalLM computes (a dense first layer, a shared expert, the sigmoid
router with a nonzero score correction bias and a routed scaling factor, partial rotary, q/k/v
bias and q/k norm); a trained learner's export loads back bit-exact, and into transformers with
the same logits; SGLang's CPU engine serves it with the learner's logprobs, its routed experts
replayed in the learner."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Glm4MoeForCausalLM

from agent_rl.config import TrainerConfig
from agent_rl.engine.launcher import EngineServer
from agent_rl.models import init_model
from tests.trainer._batches import rl_batch
from tests.trainer._exports import (
    assert_engine_logprobs_and_experts_replay,
    assert_loads_back_exactly,
)
from tests.trainer.test_parallel import (
    _assert_exports_agree,
    _baseline,
    _compare,
    _launch,
    _metrics,
)
from trainer import hf_convert
from trainer.arch import ModelArch, Parallel
from trainer.learner import learner, load_hf_weights
from trainer.model import build_gpt_model


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-glm4-moe with a random score correction bias (transformers initialises it to zero,
    which would leave the bias untested): large enough to change which experts are chosen."""
    model = init_model(tmp_path_factory.mktemp("glm") / "tiny-glm4-moe", "tiny-glm4-moe")
    weights = load_file(model / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in weights:
        if name.endswith("e_score_correction_bias"):
            weights[name] = torch.rand(weights[name].shape, generator=g) * 0.5
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    return model


def test_logits_match_transformers_glm4_moe(glm_dir: Path, solo: None) -> None:
    arch = ModelArch.from_hf_dir(glm_dir)
    assert arch.is_moe and arch.dense_layers == 1 and arch.moe_shared_ffn_hidden_size > 0
    assert arch.qkv_bias and arch.qk_norm and arch.rotary_percent == 0.5
    model = build_gpt_model(arch, Parallel()).eval()
    load_hf_weights(model, arch, glm_dir)
    hf = AutoModelForCausalLM.from_pretrained(glm_dir, dtype=torch.float32).eval()
    assert isinstance(hf, Glm4MoeForCausalLM)
    ids = torch.randint(0, arch.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(96).expand(2, -1), None)
        theirs = hf(input_ids=ids).logits
    diff = (ours - theirs).abs().max().item()
    print(f"glm4_moe: max |logit diff| {diff:.2e}")
    assert diff < 1e-5
    # The bias matters: without it transformers routes otherwise and its logits move.
    for layer in hf.model.layers[arch.dense_layers:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - ours).abs().max().item() > 1e-3


def test_a_trained_export_loads_back_bit_exact_and_into_transformers(
    glm_dir: Path, tmp_path: Path
) -> None:
    vocab = ModelArch.from_hf_dir(glm_dir).vocab_size
    batch = rl_batch(vocab, size=4)
    with learner(glm_dir, TrainerConfig(optim={"lr": 1e-3}, micro_batch_size=4)) as e:
        e.rl_step(batch)
        ours = e.logprobs(batch)["logprobs"]
        trained = {k: v.clone() for k, v in e.hf_state_dict().items()}
        out = e.export_hf(tmp_path / "export")
    exported = hf_convert.read_safetensors(out)
    assert set(exported) == set(trained) == set(hf_convert.read_safetensors(glm_dir))
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    start = hf_convert.read_safetensors(glm_dir)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(exported[bias], start[bias])  # the engine routes with the checkpoint's
    assert not torch.equal(exported["model.norm.weight"], start["model.norm.weight"])  # trained
    assert_loads_back_exactly(out, exported, batch, ours, "glm4_moe")


@pytest.mark.slow
def test_sglang_serves_it_with_the_learners_logprobs_and_its_experts_replay(
    glm_dir: Path, sglang_server_factory: Callable[..., EngineServer]
) -> None:
    """SGLang's CPU engine serving tiny-glm4-moe (correction bias and all) samples tokens whose
    logprobs are the learner's, with the engine's routed experts replayed in the learner (R3:
    SGLang reports a row per decoder layer, the dense first one included, which replay drops).
    An engine of its own: ~30 s to start."""
    assert_engine_logprobs_and_experts_replay(glm_dir, sglang_server_factory, "tiny-glm4-moe")


@pytest.mark.slow
def test_ep2_and_tp2_match_one_process(glm_dir: Path, tmp_path: Path) -> None:
    """Expert parallelism (the router's bias and the shared expert on every rank) and tensor
    parallelism (sequence parallel; partial rotary and q/k norm on each rank's heads, the q/k/v
    bias split with them) train as one process does, a checkpoint resumes bit-exact, the exports
    agree (tests/trainer/test_parallel.py's runs and tolerances). Under TP=2 a few elements of
    the dense layer's attention, whose gradients are within rounding of zero, export up to
    1.5e-4 away (Adam's eps amplifying another reduction order: `_assert_exports_agree`); the
    same export with its o_proj's two row-parallel halves gathered in the other order is
    refused."""
    base, base_dir = _baseline(glm_dir, tmp_path / "one")
    assert 0 < base[0]["routing_mismatch_fraction"] <= 1  # the replayed experts are not free routing
    _launch(glm_dir, tmp_path, "ep2", "tp2")
    for run in ("ep2", "tp2"):
        _compare(base, _metrics(tmp_path / run), base_dir, tmp_path / run)
    one = hf_convert.read_safetensors(base_dir / "export")
    tp2 = hf_convert.read_safetensors(tmp_path / "tp2" / "export")
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    tp2[o_proj] = torch.cat(tp2[o_proj].chunk(2, dim=1)[::-1], dim=1)
    with pytest.raises(AssertionError):
        _assert_exports_agree(one, tp2)
