"""The native NextN/MTP layers of glm4_moe and deepseek_v3 as the MTP draft (`trainer.mtp.layers`;
fp32, CPU, real megatron-core): a learner with one MTP module trains, its export carries the
module as model layer `num_hidden_layers` (`eh_proj`, `enorm`, `hnorm`, `shared_head.norm` beside
the family's decoder layer; config.json's `num_nextn_predict_layers` = 1) and loads back bit-exact
(and, without MTP, as the policy alone); a checkpoint's copies of the trunk's embedding and head
in that layer are dropped. The draft's logits equal those of transformers' own MTP module
(`transformers.modeling_layers.MtpModel`, what its assisted generation drafts with:
`head(norm(layer(eh_proj(cat(enorm(embed(t+1)), hnorm(h_t))))))`, the family's decoder layer,
h_t the trunk's final normed hidden state) holding the export's NextN layer. SGLang's own NextN
draft class for the family (`Glm4MoeForCausalLMNextN`, `DeepseekV3ForCausalLMNextN`), loading the
export as a launch does or the draft buckets of an in-memory sync (`distributed`, `tensor`), fills
every parameter but the target's shared embedding and head from it and takes every weight of the
NextN layer; SGLang's target on the same files skips the layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from agent_rl.config import TrainerConfig
from agent_rl.models import init_model
from tests._engine_scripts import EngineScripts
from tests.trainer._batches import rl_batch
from trainer import hf_convert
from trainer.arch import ModelArch, Parallel
from trainer.learner import learner, load_hf_weights
from trainer.model import build_gpt_model

PRESETS = {"glm4_moe": "tiny-glm4-moe", "deepseek_v3": "tiny-deepseek_v3"}


@pytest.fixture(scope="module", params=sorted(PRESETS))
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The family's tiny preset, one RL step with one MTP module, exported: the start, the
    export and the learner's own weights."""
    tmp = tmp_path_factory.mktemp(request.param)
    start = init_model(tmp / "start", PRESETS[request.param])
    batch = rl_batch(ModelArch.from_hf_dir(start).vocab_size, size=4)
    cfg = TrainerConfig(optim={"lr": 1e-3}, micro_batch_size=2, mtp={"layers": 1})
    with learner(start, cfg) as e:
        metrics = e.rl_step(batch)
        weights = {k: v.clone() for k, v in e.hf_state_dict().items()}
        export = e.export_hf(tmp / "export")
    return {"start": start, "export": export, "weights": weights, "metrics": metrics,
            "cfg": cfg}  # fmt: skip


def test_a_trained_draft_exports_as_the_nextn_layer_and_loads_back_bit_exact(trained: dict) -> None:
    export, weights = trained["export"], trained["weights"]
    assert trained["metrics"]["mtp_loss"] > 0
    arch = ModelArch.from_hf_dir(export)
    n = arch.num_layers
    assert json.loads((export / "config.json").read_text())["num_nextn_predict_layers"] == 1
    exported = hf_convert.read_safetensors(export)
    nextn = {k for k in exported if k.startswith(f"model.layers.{n}.")}
    assert {f"model.layers.{n}.{name}" for name in
            ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
             "input_layernorm.weight", "mlp.gate.e_score_correction_bias")} <= nextn  # fmt: skip
    assert not any(k.startswith(("mtp.", f"model.layers.{n + 1}.")) for k in exported)
    assert set(exported) == set(weights)
    assert all(torch.equal(exported[k], weights[k]) for k in weights)
    with learner(export, trained["cfg"]) as back:
        again = back.hf_state_dict()
    assert set(again) == set(exported)
    assert all(torch.equal(again[k], exported[k]) for k in exported)
    # Without MTP, the policy alone (the NextN layer skipped, as SGLang's target skips it).
    with learner(export, TrainerConfig()) as policy:
        alone = policy.hf_state_dict()
    assert set(alone) == set(exported) - nextn
    assert all(torch.equal(alone[k], exported[k]) for k in alone)


def test_a_checkpoints_copies_of_the_embedding_and_head_are_dropped(
    trained: dict, tmp_path: Path
) -> None:
    """DeepSeek-V3's checkpoint carries `embed_tokens` and `shared_head.head` in its NextN
    layer, copies of the trunk's: megatron's MTP module shares the trunk's."""
    src = tmp_path / "upstream"
    src.mkdir()
    for f in trained["export"].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    n = ModelArch.from_hf_dir(src).num_layers
    tensors[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    tensors[f"model.layers.{n}.shared_head.head.weight"] = head
    save_file({k: v.clone() for k, v in tensors.items()}, src / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    with learner(src, trained["cfg"]) as e:
        again = e.hf_state_dict()
    assert set(again) == set(trained["weights"])
    assert all(torch.equal(again[k], trained["weights"][k]) for k in again)


def test_the_drafts_logits_are_the_nextn_layers_with_transformers_decoder_layer(
    trained: dict, solo: None
) -> None:
    export = trained["export"]
    arch = ModelArch.from_hf_dir(export)
    seq = 40
    model = build_gpt_model(arch, Parallel(), mtp_layers=1).eval()
    load_hf_weights(model, arch, export, mtp_layers=1)
    ids = torch.randint(0, arch.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, depths = model(ids, torch.arange(seq).expand(2, -1), None)
        rows = torch.arange(2).repeat_interleave(seq - 1)
        positions = torch.arange(seq - 1).repeat(2)
        ours = model.draft_logits(depths[0], rows, positions).view(2, seq - 1, -1)
        theirs = _reference_draft_logits(export, ids)
    diff = (ours - theirs).abs().max().item()
    print(f"{arch.model_type}: NextN draft max |logit diff| {diff:.2e}")
    assert diff < 1e-5
    assert theirs.abs().max().item() > 1e-2  # not a vacuous comparison


def _reference_draft_logits(export: Path, ids: torch.Tensor) -> torch.Tensor:
    """The NextN layer's logits at positions 0..s-2 (each predicting token t+2) from
    transformers' own MTP module (`MtpModel`: `eh_proj(cat(enorm(embed), hnorm(h)))`, the
    family's decoder layer, its post norm, the main model's head) over the export's trunk. Its
    decoder layer is layer `num_hidden_layers` of the export as transformers loads it into a
    model one layer deeper (its checkpoint conversions: fused experts), its own weights the
    export's by name."""
    from transformers.modeling_layers import MtpModel

    trunk = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    embedding = trunk.model.embed_tokens.weight.clone()
    n = trunk.config.num_hidden_layers
    deeper = AutoModelForCausalLM.from_pretrained(
        export, config=AutoConfig.from_pretrained(export, num_hidden_layers=n + 1),
        dtype=torch.float32)  # fmt: skip
    own = hf_convert.read_safetensors(export)
    assert torch.equal(deeper.model.layers[n].input_layernorm.weight,
                       own[f"model.layers.{n}.input_layernorm.weight"])  # fmt: skip
    mtp = MtpModel(trunk, 1).eval()
    module = mtp.layers[0]
    module.mtp_block.load_state_dict(deeper.model.layers[n].state_dict())
    with torch.no_grad():
        for mine, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                             ("post_norm", "shared_head.norm")):  # fmt: skip
            getattr(module, mine).weight.copy_(own[f"model.layers.{n}.{theirs}.weight"])
    assert torch.equal(trunk.model.embed_tokens.weight, embedding)  # shared, not re-initialised
    seq = ids.shape[1] - 1
    hidden = trunk.model(input_ids=ids).last_hidden_state[:, :seq]
    positions = torch.arange(seq).expand(ids.shape[0], -1)
    out = mtp.forward_layer(0, hidden, positions, None, input_ids=ids[:, 1:])
    return mtp._project_to_logits(out)


def test_sglang_s_own_nextn_draft_takes_every_weight_of_the_nextn_layer_from_every_source(
    trained: dict, engine_scripts: EngineScripts, tmp_path: Path
) -> None:
    """SGLang's NextN class for the family (tests/trainer/_sglang_mtp_draft.py, in the engine
    environment: every parameter NaN, then its own `load_weights`), loading the export's files
    as a launch does and the draft buckets of both in-memory syncs (`selector: "draft"`, as
    SGLang's flattened bucket receives them), ends each time with no parameter unfilled but the
    embedding and head it shares with the target at serve time, and every tensor of the
    export's NextN layer is in it as it was exported: as a parameter of its own, or a block of
    rows of the one SGLang fuses it into (q/k/v, gate/up, the experts' w13/w2, MLA's q_a with
    kv_a). The syncs send the draft the NextN layer, all of it and nothing else, under the
    export's names, and the target none of it. SGLang's target model on the export's files
    fills every parameter from the trunk's weights, the NextN layer skipped."""
    from tests.trainer._syncs import save_draft_buckets, sglang_draft_loads
    from trainer.weight_sync.memory import parts

    export, weights = trained["export"], trained["weights"]
    n = ModelArch.from_hf_dir(export).num_layers
    nextn = {k for k in weights if k.startswith(f"model.layers.{n}.")}
    drafts = save_draft_buckets(weights, tmp_path / "buckets.pt")
    assert len(drafts) > 1 and sorted(k for b in drafts for k in b) == sorted(nextn)
    targets = [k for b, selector in parts(weights, 64 << 10) if selector == "target" for k, _ in b]
    assert sorted(targets) == sorted(weights.keys() - nextn)
    loaded = sglang_draft_loads(export, engine_scripts, tmp_path)
    assert sorted(loaded) == ["disk", "distributed", "target", "tensor"]
    target = loaded.pop("target")
    ours = hf_convert.read_safetensors(export)
    assert len(nextn) > 20 and all(torch.equal(ours[k], weights[k]) for k in nextn)
    shared = {"model.embed_tokens.weight", "lm_head.weight"}
    for source, draft in loaded.items():
        assert shared <= draft.keys(), source
        unfilled = [k for k, t in draft.items() if k not in shared and torch.isnan(t).any()]
        assert not unfilled and len(draft) > len(shared) + 10, (source, unfilled)
        params = [t for k, t in draft.items() if k not in shared]
        missing = [k for k in nextn if not any(_holds(p, ours[k]) for p in params)]
        assert not missing, (source, missing)
    assert not [k for k, t in target.items() if torch.isnan(t).any()]
    for name in ("model.norm.weight", "model.layers.0.self_attn.o_proj.weight",
                 f"model.layers.{n - 1}.mlp.gate.weight"):  # fmt: skip
        assert torch.equal(target[name], ours[name]), name


def _holds(param: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether `tensor` is `param`, or a block of consecutive rows of it (of its last dimension,
    for a fused [experts, rows, columns] one: every expert's rows follow the previous one's)."""
    if tensor.dim() != param.dim() and not (tensor.dim() == 2 and param.dim() == 3):
        return False
    width = tensor.shape[-1] if tensor.dim() > 1 else 1
    if param.shape[-1] != width and tensor.dim() > 1:
        return False
    rows, block = param.reshape(-1, width), tensor.reshape(-1, width)
    if len(block) > len(rows):
        return False
    starts = (rows == block[0]).all(dim=1).nonzero().flatten().tolist()
    return any(torch.equal(rows[i : i + len(block)], block) for i in starts)
