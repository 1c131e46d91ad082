"""The Megatron model computes what transformers computes on the same HF weights, and the
weight conversion is exact both ways (fp32, CPU, real megatron-core)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from agent_rl.config import TrainerConfig
from agent_rl.kernel.errors import ConfigError
from trainer import hf_convert, shard
from trainer.arch import ModelArch, Parallel
from trainer.learner import Learner, load_hf_weights
from trainer.model import build_gpt_model


def _megatron(model_dir: Path) -> tuple[ModelArch, torch.nn.Module]:
    arch = ModelArch.from_hf_dir(model_dir)
    model = build_gpt_model(arch, Parallel()).eval()
    load_hf_weights(model, arch, model_dir)
    return arch, model


@pytest.mark.parametrize("preset", ["tiny_dense_model", "tiny_moe_model"])
def test_logits_and_logprobs_match_transformers(
    preset: str, request: pytest.FixtureRequest, solo: None
) -> None:
    model_dir = request.getfixturevalue(preset)
    arch, model = _megatron(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, arch.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(64).expand(2, -1), None)
        theirs = hf(input_ids=ids).logits
    logit_diff = (ours - theirs).abs().max().item()
    lp = torch.log_softmax(ours, -1).gather(-1, ids[:, 1:, None])
    ref = torch.log_softmax(theirs, -1).gather(-1, ids[:, 1:, None])
    lp_diff = (lp - ref).abs().max().item()
    print(f"{preset}: max |logit diff| {logit_diff:.2e}, max |logprob diff| {lp_diff:.2e}")
    assert logit_diff < 1e-5 and lp_diff < 1e-5


@pytest.mark.parametrize("preset", ["tiny_dense_model", "tiny_moe_model"])
def test_hf_mcore_hf_round_trip_is_exact(
    preset: str, request: pytest.FixtureRequest, solo: None
) -> None:
    model_dir = request.getfixturevalue(preset)
    arch, model = _megatron(model_dir)
    original = hf_convert.read_safetensors(model_dir)
    back = hf_convert.mcore_to_hf(shard.gather_full_state_dict(model, arch), arch)
    assert set(back) == set(original)
    assert all(torch.equal(back[k], original[k]) for k in original)


def test_qwen2_specifics_are_read(tiny_dense_model: Path) -> None:
    arch = ModelArch.from_hf_dir(tiny_dense_model)
    assert arch.model_type == "qwen2" and arch.qkv_bias and not arch.qk_norm and not arch.is_moe
    assert arch.head_dim == 64 and arch.vocab_size % 128 == 0


def test_qwen3_moe_specifics_are_read(tiny_moe_model: Path) -> None:
    arch = ModelArch.from_hf_dir(tiny_moe_model)
    assert arch.qk_norm and not arch.qkv_bias and arch.num_experts == 8 and arch.moe_topk == 2


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"num_hidden_layers": 5, "layer_types": ["full_attention"] * 5},
            "missing: the weights do not match",
        ),
        ({"intermediate_size": 256}, "does not fit"),
        ({"num_hidden_layers": 5}, "not a valid model config"),
    ],
)
def test_weights_that_do_not_match_the_config_fail_with_one_line(
    change: dict[str, object], message: str, tiny_dense_model: Path, tmp_path: Path, solo: None
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(tiny_dense_model, bad)
    config = json.loads((bad / "config.json").read_text())
    config.update(change)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        arch = ModelArch.from_hf_dir(bad)
        load_hf_weights(build_gpt_model(arch, Parallel()), arch, bad)


def test_not_a_model_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no config.json"):
        ModelArch.from_hf_dir(tmp_path)


def test_parallel_sizes_are_checked(tiny_dense_model: Path) -> None:
    from trainer.arch import check_parallel

    arch = ModelArch.from_hf_dir(tiny_dense_model)
    with pytest.raises(ConfigError, match="tp=3"):
        check_parallel(arch, Parallel(tp=3))
    with pytest.raises(ConfigError, match="ep=2 needs a MoE model"):
        check_parallel(arch, Parallel(ep=2))
    with pytest.raises(ConfigError, match="pp=3 does not divide the model's 4 layers"):
        check_parallel(arch, Parallel(pp=3))
    check_parallel(arch, Parallel(tp=2, pp=2))
    # MTP drafts under PP would need the embedding on the last stage: refused, one message.
    with pytest.raises(ConfigError, match="mtp_layers > 0 with pp > 1 is not supported"):
        check_parallel(arch, Parallel(pp=2), mtp_layers=1)
    with pytest.raises(ConfigError, match="mtp_layers > 0 with pp > 1 is not supported"):
        Learner(tiny_dense_model, TrainerConfig(parallel={"pp": 2}, mtp={"layers": 1}))  # before any process group


def test_megatron_fusions_run_eagerly_on_cpu() -> None:
    """`import trainer` keeps megatron's `jit_fuser` (torch.compile) off on CPU: megatron's own
    fused functions are plain ones, and a process that imports the trainer's learner and loop
    never imports torch's dynamo or inductor (~3 s of CPU per trainer process). That last holds
    for megatron-core 0.16 (Python 3.11); 0.19's inference-only MoE router decorates with
    torch.compile itself, so there dynamo is imported all the same."""
    code = (
        "import json, sys\n"
        "import trainer.learner, trainer.loop\n"
        "import megatron.core.jit as jit\n"
        "from megatron.core.package_info import __version__\n"
        "print(json.dumps({'dynamo': 'torch._dynamo' in sys.modules,\n"
        "                  'inductor': 'torch._inductor' in sys.modules,\n"
        "                  'fuser': jit.jit_fuser is jit.noop_decorator, 'version': __version__}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["fuser"] is True
    if got["version"].startswith("0.16."):
        assert (got["dynamo"], got["inductor"]) == (False, False)
