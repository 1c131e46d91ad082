"""The deepseek_v3 family through the trainer (fp32, CPU, real megatron-core): the learner computes
what transformers' DeepseekV3ForCausalLM computes (multi-head latent attention with low-rank
queries or a full query projection, YaRN or plain rotary embeddings, a dense first layer, a
shared expert, the sigmoid router with a nonzero score correction bias, group-limited top-k and a
routed scaling factor); a trained learner's export loads back bit-exact, and into transformers
with the same logits; packed micro-batches rotate each token by its own position in every
latent attention layer."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM

from agent_rl.config import TrainerConfig
from agent_rl.engine.launcher import EngineServer
from agent_rl.kernel.errors import ConfigError
from agent_rl.models import init_model
from tests.trainer._batches import rl_batch
from tests.trainer._exports import (
    assert_engine_logprobs_and_experts_replay,
    assert_loads_back_exactly,
)
from trainer import hf_convert
from trainer.arch import ModelArch, Parallel
from trainer.learner import learner, load_hf_weights
from trainer.packing import per_token_rope
from trainer.model import build_gpt_model


def _random_bias(model: Path) -> Path:
    """transformers initialises the score correction bias to zero, which would leave it
    untested: a random one, large enough to change which experts (and groups) are chosen."""
    weights = load_file(model / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in weights:
        if name.endswith("e_score_correction_bias"):
            weights[name] = torch.rand(weights[name].shape, generator=g) * 0.5
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    return model


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-deepseek_v3 as its preset makes it (low-rank queries, YaRN, 4 groups of 4 experts,
    top-4 from the best 2 groups), with a random correction bias."""
    return _random_bias(init_model(tmp_path_factory.mktemp("ds") / "tiny-deepseek_v3",
                                   "tiny-deepseek_v3"))  # fmt: skip


@pytest.fixture(scope="module")
def ds_plain_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Moonlight's and Kimi-K2's variant: a full query projection, plain rotary embeddings,
    one expert group."""
    options = {"kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
               "v_head_dim": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
               "routed_scaling_factor": 2.5}  # fmt: skip
    out = tmp_path_factory.mktemp("ds") / "plain"
    return _random_bias(init_model(out, "tiny-deepseek_v3", seed=1, options=options))


def _logits_diff(model_dir: Path) -> tuple[float, torch.Tensor, Any, torch.Tensor]:
    """Max |logit diff| of the learner against transformers' class on 2 x 96 random tokens,
    with the learner's logits, transformers' model and the tokens."""
    arch = ModelArch.from_hf_dir(model_dir)
    model = build_gpt_model(arch, Parallel()).eval()
    load_hf_weights(model, arch, model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert isinstance(hf, DeepseekV3ForCausalLM)
    ids = torch.randint(0, arch.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(96).expand(2, -1), None)
        theirs = hf(input_ids=ids).logits
    return (ours - theirs).abs().max().item(), ours, hf, ids


def test_logits_match_transformers_deepseek_v3(ds_dir: Path, solo: None) -> None:
    arch = ModelArch.from_hf_dir(ds_dir)
    assert arch.latent is not None and arch.latent.q_lora_rank and arch.latent.rope_scaling
    assert arch.dense_layers == 1 and arch.moe_shared_ffn_hidden_size > 0
    assert (arch.moe_groups, arch.moe_group_topk, arch.moe_topk) == (4, 2, 4)
    diff, ours, hf, ids = _logits_diff(ds_dir)
    print(f"deepseek_v3 (q_lora_rank, YaRN, groups): max |logit diff| {diff:.2e}")
    assert diff < 1e-5
    # Group-limited routing and the bias matter: without either transformers routes otherwise.
    gates = [layer.mlp.gate for layer in hf.model.layers[arch.dense_layers:]]
    for gate in gates:
        gate.num_group = gate.topk_group = 1
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - ours).abs().max().item() > 1e-3
    for gate in gates:
        gate.num_group, gate.topk_group = arch.moe_groups, arch.moe_group_topk
        gate.e_score_correction_bias.zero_()
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - ours).abs().max().item() > 1e-3


def test_logits_match_transformers_full_query_plain_rope(ds_plain_dir: Path, solo: None) -> None:
    arch = ModelArch.from_hf_dir(ds_plain_dir)
    assert arch.latent is not None and arch.latent.q_lora_rank is None
    assert arch.latent.rope_scaling is None and arch.moe_groups == 1
    diff, *_ = _logits_diff(ds_plain_dir)
    print(f"deepseek_v3 (full q_proj, plain rope, one group): max |logit diff| {diff:.2e}")
    assert diff < 1e-5


def test_a_trained_export_loads_back_bit_exact_and_into_transformers(
    ds_dir: Path, tmp_path: Path
) -> None:
    vocab = ModelArch.from_hf_dir(ds_dir).vocab_size
    batch = rl_batch(vocab, size=4)
    with learner(ds_dir, TrainerConfig(optim={"lr": 1e-3}, micro_batch_size=4)) as e:
        e.rl_step(batch)
        ours = e.logprobs(batch)["logprobs"]
        trained = {k: v.clone() for k, v in e.hf_state_dict().items()}
        out = e.export_hf(tmp_path / "export")
    exported = hf_convert.read_safetensors(out)
    start = hf_convert.read_safetensors(ds_dir)
    assert set(exported) == set(trained) == set(start)
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(exported[bias], start[bias])  # the engine routes with the checkpoint's
    for name in ("q_b_proj", "kv_b_proj", "kv_a_proj_with_mqa"):  # the latent attention trained
        key = f"model.layers.0.self_attn.{name}.weight"
        assert not torch.equal(exported[key], start[key]), key
    assert_loads_back_exactly(out, exported, batch, ours, "deepseek_v3")


def test_packed_micro_batches_rotate_each_token_by_its_own_position(ds_dir: Path) -> None:
    """Latent attention has a rotary embedding per layer (YaRN's returns its cos/sin factor
    beside): in a packed row each layer's rotates each token by its position in its own
    sequence, and packed sequences score as their padded rows do."""
    arch = ModelArch.from_hf_dir(ds_dir)
    batch = rl_batch(arch.vocab_size, size=4, length=40, seed=3)
    scores = []
    for cfg in ({"micro_batch_size": 4}, {"max_tokens_per_micro_batch": 80}):
        with learner(ds_dir, TrainerConfig(**cfg)) as e:
            scores.append(e.logprobs(batch)["logprobs"])
            model = e.module
    mask = batch.loss_mask.bool()
    diff = (scores[0] - scores[1])[mask].abs().max().item()
    print(f"deepseek_v3: packed vs padded max |logprob diff| {diff:.2e}")
    assert diff < 1e-5
    positions = torch.tensor([[0, 1, 2, 0, 1, 5]])
    ropes = [layer.self_attention.rotary_pos_emb for layer in model.decoder.layers]
    assert len(ropes) == arch.num_layers and not hasattr(model, "rotary_pos_emb")
    with per_token_rope(model, positions):
        for rope in ropes:
            emb, factor = rope(6)
            whole, same = rope.__class__.forward(rope, 6)
            assert emb.shape == (6, 1, 1, arch.latent.qk_rope_head_dim) and factor == same
            assert torch.equal(emb[:, 0], whole[positions[0], 0])
    assert torch.equal(ropes[0](6)[0], whole)  # its own forward again


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"rope_interleave": False}, "rope_interleave=false"),
        ({"rms_norm_eps": 1e-5}, "rms_norm_eps"),
        ({"num_experts_per_tok": 2}, "n_group=4 with topk_group=2"),
        ({"norm_topk_prob": False}, "norm_topk_prob=false"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                              "original_max_position_embeddings": 1024,
                              "mscale_all_dim": 1.0}}, "mscale_all_dim but no mscale"),
    ],
)  # fmt: skip
def test_what_it_cannot_map_is_refused(
    ds_dir: Path, tmp_path: Path, edit: dict[str, object], match: str
) -> None:
    config = json.loads((ds_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ConfigError, match=match):
        ModelArch.from_hf_dir(tmp_path)


# The published configs, trimmed to what the family reads (their sizes, router and rope).
_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "tie_word_embeddings": False, "attention_bias": False, "num_nextn_predict_layers": 0,
}
_MOONLIGHT = {**_DEEPSEEK_V3, "vocab_size": 163840, "hidden_size": 2048,
              "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
              "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2,
              "n_routed_experts": 64, "routed_scaling_factor": 2.446, "q_lora_rank": None,
              "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6,
              "first_k_dense_replace": 1, "max_position_embeddings": 8192, "rope_theta": 50000,
              "rope_scaling": None}  # fmt: skip


@pytest.mark.parametrize("config", [_DEEPSEEK_V3, _MOONLIGHT], ids=["DeepSeek-V3", "Moonlight"])
def test_the_published_configs_read_and_build_megatron_s_config(
    config: dict[str, object], tmp_path: Path, solo: None
) -> None:
    """DeepSeek-V3's (8 groups, top-8 from 4, YaRN factor 40) and Moonlight's (a full q_proj,
    one group, plain rope) configs map; their FP8 release is refused in one line."""
    from trainer.model import transformer_config

    (tmp_path / "config.json").write_text(json.dumps(config))
    arch = ModelArch.from_hf_dir(tmp_path)
    mc = transformer_config(arch, Parallel())
    assert mc.multi_latent_attention and mc.kv_lora_rank == config["kv_lora_rank"]
    assert mc.q_lora_rank == config["q_lora_rank"]
    if config is _DEEPSEEK_V3:
        assert (mc.moe_router_num_groups, mc.moe_router_group_topk) == (8, 4)
        assert mc.rope_type == "yarn" and mc.rotary_scaling_factor == 40 and mc.mscale_all_dim == 1
        assert arch.dense_layers == 3 and mc.moe_router_topk_scaling_factor == 2.5
    else:
        assert mc.moe_router_num_groups is None and mc.rope_type == "rope"
    fp8 = {**config, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}
    (tmp_path / "config.json").write_text(json.dumps(fp8))
    with pytest.raises(ConfigError, match="quantized checkpoint \\(fp8"):
        ModelArch.from_hf_dir(tmp_path)


def test_bench_convert_s_deepseek_v3_config_loads_and_exports_every_weight(tmp_path: Path) -> None:
    """bench/convert.py's 1B-class DeepSeek-V3-shaped model (its checkpoint names from
    transformers' class, per-expert as stored), at a quarter of its width and three of its
    layers: the bench's own load and export phases (each in a process of its own) take every
    tensor of its shards and write each back under its name and shape."""
    import importlib.util
    import sys

    bench = Path(__file__).resolve().parents[2] / "bench" / "convert.py"
    spec = importlib.util.spec_from_file_location("bench_convert", bench)
    convert = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(convert)  # type: ignore[union-attr]
    full = convert.CONFIGS["deepseek_v3"]
    convert.CONFIGS["deepseek_v3"] = {**full, "hidden_size": 256, "vocab_size": 8000,
                                      "intermediate_size": 704, "moe_intermediate_size": 128,
                                      "num_hidden_layers": 3}  # fmt: skip
    model = tmp_path / "model"
    convert.make(model, "deepseek_v3")
    assert ModelArch.from_hf_dir(model).num_experts == full["n_routed_experts"]
    for phase in ("load", "export"):
        done = subprocess.run([sys.executable, str(bench), "--phase", phase, str(model),
                               str(tmp_path / phase)], capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    stored, exported = (hf_convert.read_safetensors(d) for d in (model, tmp_path / "export"))
    assert len(stored) > 3 * full["n_routed_experts"]
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in stored.items()}


@pytest.mark.slow
def test_sglang_serves_it_with_the_learners_logprobs_and_its_experts_replay(
    ds_dir: Path, sglang_server_factory: Callable[..., EngineServer]
) -> None:
    """SGLang's CPU engine serving tiny-deepseek_v3 (latent attention, YaRN, group-limited
    routing with a correction bias) samples tokens whose logprobs are the learner's, with the
    engine's routed experts replayed in the learner (R3; SGLang reports a row per decoder layer,
    the dense first one included, which replay drops). An engine of its own: ~30 s to start."""
    assert_engine_logprobs_and_experts_replay(ds_dir, sglang_server_factory, "tiny-deepseek_v3")


@pytest.mark.slow
def test_ep2_and_tp2_match_one_process(ds_dir: Path, tmp_path: Path) -> None:
    """Expert parallelism (the router's bias, its groups and the shared expert on every rank)
    and tensor parallelism (the latent projections column-parallel, their outputs gathered)
    train as one process does, a checkpoint resumes bit-exact, the exports agree
    (tests/trainer/test_parallel.py's runs and tolerances)."""
    from tests.trainer.test_parallel import _baseline, _compare, _launch, _metrics

    base, base_dir = _baseline(ds_dir, tmp_path / "one")
    assert 0 < base[0]["routing_mismatch_fraction"] <= 1  # the replayed experts are not free routing
    _launch(ds_dir, tmp_path, "ep2", "tp2")
    for run in ("ep2", "tp2"):
        print(run)
        _compare(base, _metrics(tmp_path / run), base_dir, tmp_path / run)
