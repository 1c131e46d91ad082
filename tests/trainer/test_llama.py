"""The llama family through the trainer (fp32, CPU, real megatron-core): the learner computes
what transformers' LlamaForCausalLM computes, Llama 3's rope scaling included, with tied and
untied embeddings; a trained learner's export loads back bit-exact, and into transformers with
the same logits; every weight sync (disk, distributed, tensor) brings SGLang's CPU engine the
learner's weights, which it then samples with the learner's logprobs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from agent_rl.config import TrainerConfig
from agent_rl.engine.launcher import EngineServer
from agent_rl.models import init_model
from agent_rl.models.presets import PRESETS
from agent_rl.sglang.client import EngineClient
from agent_rl.sglang.generation import Generation
from tests.trainer._batches import rl_batch
from tests.trainer._exports import assert_loads_back_exactly
from tests.trainer._syncs import assert_every_sync_serves_the_learner
from trainer import hf_convert, shard
from trainer.batch import Batch
from trainer.arch import ModelArch, Parallel
from trainer.learner import learner, load_hf_weights
from trainer.model import build_gpt_model


ROPE_ORIGINAL_CONTEXT = {"tiny-llama": PRESETS["tiny-llama"].options.get("rope_original_context"),
                         "tiny-llama-tied": 512, "untied-8192": 8192}  # fmt: skip
"""Each variant's Llama 3 rope scaling: the original context it scales from (None: unscaled)."""


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-llama-tied", "untied-8192"])
def llama_dir(
    request: pytest.FixtureRequest,
    tiny_llama_model: Path,
    tiny_llama_tied_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """tiny-llama as its preset makes it (untied, like Llama 3.1 8B); tied (like Llama 3.2
    1B/3B) with its rope scaled to its tiny context, which the built model applies; and untied
    with Llama 3.2's own rope (theta 5e5, factor 32 from 8192: megatron-core's constructor
    scales it)."""
    if request.param == "tiny-llama":
        return tiny_llama_model
    if request.param == "tiny-llama-tied":
        return tiny_llama_tied_model
    return init_model(tmp_path_factory.mktemp("llama") / "untied-8192", "tiny-llama", seed=1,
                      tie_word_embeddings=False, num_hidden_layers=2, rope_theta=500000.0,
                      options={"rope_scaling_factor": 32.0, "rope_original_context": 8192})  # fmt: skip


def test_logits_match_transformers_llama(llama_dir: Path, solo: None) -> None:
    arch = ModelArch.from_hf_dir(llama_dir)
    assert arch.model_type == "llama" and not arch.qkv_bias and not arch.qk_norm
    assert arch.tied_embeddings == (llama_dir.name == "tiny-llama-tied")
    model = build_gpt_model(arch, Parallel()).eval()
    load_hf_weights(model, arch, llama_dir)
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    assert isinstance(hf, LlamaForCausalLM)
    # Where Llama 3's scaling is on it is transformers': it rescales most of the low
    # frequencies, from the original context the config names.
    original = ROPE_ORIGINAL_CONTEXT[llama_dir.name]
    assert (arch.rope_scaling_factor is None) == (original is None)
    ours_freq, theirs_freq = model.rotary_pos_emb.inv_freq, hf.model.rotary_emb.inv_freq
    unscaled = 1.0 / arch.rope_theta ** (torch.arange(0, arch.head_dim, 2).float() / arch.head_dim)
    assert torch.equal(ours_freq, theirs_freq)
    if original is None:
        assert torch.allclose(ours_freq, unscaled)
    else:
        assert arch.rope_original_context == original
        assert (ours_freq != unscaled).sum() >= arch.head_dim // 8
    ids = torch.randint(0, arch.vocab_size, (2, 192), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(192).expand(2, -1), None)
        theirs = hf(input_ids=ids).logits
    diff = (ours - theirs).abs().max().item()
    print(f"{llama_dir.name}: max |logit diff| {diff:.2e}")
    assert diff < 1e-5


def test_a_trained_export_loads_back_bit_exact_and_into_transformers(
    llama_dir: Path, tmp_path: Path
) -> None:
    vocab = ModelArch.from_hf_dir(llama_dir).vocab_size
    batch = rl_batch(vocab, size=4)
    with learner(llama_dir, TrainerConfig(optim={"lr": 1e-3}, micro_batch_size=4)) as e:
        e.rl_step(batch)
        ours = e.logprobs(batch)["logprobs"]
        trained = {k: v.clone() for k, v in e.hf_state_dict().items()}
        out = e.export_hf(tmp_path / "export")
    exported = hf_convert.read_safetensors(out)
    assert ("lm_head.weight" in exported) != ModelArch.from_hf_dir(llama_dir).tied_embeddings
    assert set(exported) == set(trained)
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    start = hf_convert.read_safetensors(llama_dir)
    assert not torch.equal(start["model.norm.weight"], exported["model.norm.weight"])  # trained
    assert_loads_back_exactly(out, exported, batch, ours, llama_dir.name)


def test_round_trip_of_the_full_state_dict_is_exact(llama_dir: Path, solo: None) -> None:
    arch = ModelArch.from_hf_dir(llama_dir)
    model = build_gpt_model(arch, Parallel())
    load_hf_weights(model, arch, llama_dir)
    original = hf_convert.read_safetensors(llama_dir)
    back = hf_convert.mcore_to_hf(shard.gather_full_state_dict(model, arch), arch)
    assert set(back) == set(original)
    assert all(torch.equal(back[k], original[k]) for k in original)


@pytest.mark.slow
def test_every_weight_sync_then_sglang_samples_with_the_learners_logprobs(
    tiny_llama_tied_model: Path, sglang_server_factory: Callable[..., EngineServer]
) -> None:
    """SGLang's CPU engine (an engine of its own: ~30 s to start), started on the base weights of
    the tied variant (the embedding is its output layer; its rope scaled from 512: the paths
    an engine loads differently), serves the learner's after each weight sync (disk,
    distributed, tensor; a step before each), then samples tokens whose logprobs are the
    learner's."""
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 7, 300, 12, 13, 14, 15]]
    server = sglang_server_factory(tiny_llama_tied_model)
    with learner(tiny_llama_tied_model, TrainerConfig(optim={"lr": 1e-3}, micro_batch_size=4)) as e:

        async def sample() -> list[Generation]:
            async with EngineClient(server.url) as client:
                params = {"temperature": 1.0, "max_new_tokens": 24, "sampling_seed": 0}
                return [await client.generate(p, params) for p in prompts]

        try:
            assert_every_sync_serves_the_learner(e, server.url, "tiny-llama")
            generations = asyncio.run(sample())
        finally:
            server.stop()  # its ~2 GB back before the rest of the session
        batch = Batch.from_sequences(
            [p + g.output_ids for p, g in zip(prompts, generations)],
            loss_masks=[[0.0] * len(p) + [1.0] * len(g.output_ids)
                        for p, g in zip(prompts, generations)],
            rollout_logprobs=[[0.0] * len(p) + list(g.logprobs or [])
                              for p, g in zip(prompts, generations)],
            advantages=[1.0, -1.0, 0.5],
        )  # fmt: skip
        ours = e.logprobs(batch)["logprobs"]
    mask = batch.loss_mask
    diff = (ours - batch.rollout_logprobs).abs() * mask
    mean = float(diff.sum() / mask.sum())
    print(f"trainer vs SGLang (tied tiny-llama, after the syncs): mean |logprob diff| {mean:.2e}, "
          f"max {diff.max().item():.2e} over {int(mask.sum())} tokens")
    assert mask.sum() >= 3 * 8 and mean <= 1e-5
