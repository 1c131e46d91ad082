"""HF <-> megatron-core weight names on full state dicts, for every family; `write_hf_dir`.

Both directions work on *full* (unsharded, TP=1/EP=1 layout) state dicts; trainer.shard cuts
and gathers the per-rank pieces. The HF side is the on-disk checkpoint format that SGLang and
transformers load: per-projection q/k/v, gate/up/down, per-expert
`mlp.experts.{e}.{gate,up,down}_proj.weight`, no `lm_head.weight` when embeddings are tied.
This module maps the embedding, the head and the MTP modules, and walks the decoder layers;
each layer's names and layouts are its family's (`Family.layer_to_mcore`/`layer_to_hf`, the
standard layout in agent_rl/families/layout.py). Conversion is pure reshaping and
concatenation, so HF -> mcore -> HF is bit-exact.

MTP draft modules (`trainer.mtp.layers`, megatron `mtp.layers.{j}.*`) map to the names SGLang's
draft for the model loads (`mtp_prefix`; their decoder layer as the trunk's layers map):
- a family whose draft is its own `mtp.*` weights (`Family.draft = "mtp"`, Qwen3-MoE): module 0
  under `mtp.` (`_MTP_MODULE`), read by SGLang's draft class for it
  (`Family.mtp_draft_architecture`) from the target's own directory;
- a family with native NextN layers (`Family.native_mtp`: GLM-4.5, DeepSeek-V3): module j is
  model layer `num_hidden_layers + j` (`_NEXTN_MODULE`, its decoder layer's weights under the
  same prefix), counted by config.json's `num_nextn_predict_layers`, which an export sets. Some
  checkpoints also carry copies of the trunk's embedding and head there (`_NEXTN_SHARED`): a
  load drops them (megatron's MTP module shares the trunk's, as SGLang's draft shares the
  target's at serve time) and an export writes none;
- an EAGLE draft (`ModelArch.eagle_draft`, the dense families): module 0 as `fc.{weight,bias}`
  and `layers.0.*` (no norms but the layer's post-attention one; q/k/v biases, zero where the
  model has none), the names `Qwen2ForCausalLMEagle` reads. `write_hf_dir` writes the draft as a
  directory of its own, `draft/` (`EAGLE_DRAFT_DIR`), with the draft's config: the
  `--speculative-draft-model-path` a launch takes. Where the target skips names it does not
  know (`Family.eagle_beside_target`, Qwen2) the export also carries the draft beside the
  target's weights, in a file of its own (`EAGLE_BESIDE_FILE`), so a disk update (one directory
  for target and draft) updates both; other targets would load `layers.*` into their own
  layers, so their export keeps the draft in `draft/` only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, MutableMapping
from pathlib import Path

import torch
from safetensors import safe_open

from agent_rl import families
from agent_rl.families.layout import hf_heads, mcore_heads, take, zero
from agent_rl.sglang.speculative import (
    EAGLE_DRAFT_ARCHITECTURE,
    EAGLE_DRAFT_DIR,
    EAGLE_DRAFT_MODEL_TYPE,
)
from agent_rl.kernel.errors import ConfigError
from trainer import megatron_cpu
from trainer.arch import ModelArch
from trainer.safetensors_io import LazyWeights, save_streaming


def _weight_files(path: str | Path) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path} has no *.safetensors weights")
    return [*files, *sorted((Path(path) / EAGLE_DRAFT_DIR).glob("*.safetensors"))]


def lazy_safetensors(path: str | Path) -> LazyWeights:
    """`read_safetensors`'s tensors, each read from its file when asked for (a load streams)."""
    return LazyWeights(_weight_files(path))


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the `*.safetensors` files in `path`, and those of an EAGLE draft in
    `path/draft/` that are not beside them."""
    out: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        with safe_open(str(f), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                out.setdefault(key, handle.get_tensor(key))
    return out


# One MTP module, HF name -> megatron name; its decoder layer maps as the trunk's layers do.
# SGLang's Qwen3-MoE MTP draft (Qwen3MoeForCausalLMMTP) reads module 0 under `mtp.`.
_MTP_MODULE = (
    ("fc.weight", "eh_proj.weight"),
    ("pre_fc_norm_embedding.weight", "enorm.weight"),
    ("pre_fc_norm_hidden.weight", "hnorm.weight"),
    ("norm.weight", "final_layernorm.weight"),
)


# One native NextN layer (`Family.native_mtp`), HF name -> megatron name, under
# `model.layers.{num_hidden_layers + j}.` beside its decoder layer's own weights.
_NEXTN_MODULE = (
    ("eh_proj.weight", "eh_proj.weight"),
    ("enorm.weight", "enorm.weight"),
    ("hnorm.weight", "hnorm.weight"),
    ("shared_head.norm.weight", "final_layernorm.weight"),
)
_NEXTN_SHARED = ("embed_tokens.weight", "shared_head.head.weight")
"""Copies of the trunk's embedding and head a NextN layer may carry (DeepSeek-V3's do)."""


EAGLE_BESIDE_FILE = "draft.safetensors"
"""The file beside `model.safetensors` that carries it: SGLang loads every safetensors file of a
directory without an index (target and draft alike, each taking its own names), transformers
only `model.safetensors`, whose prefix-less names it would otherwise load the draft's
`layers.0.*` from into the target's first layer."""


def is_draft(name: str, arch: ModelArch | None = None) -> bool:
    """Whether HF weight `name` belongs to the MTP draft (`mtp.*`; a dense model's EAGLE
    module `fc.*`, `layers.0.*`; given the `arch`, a native NextN layer's
    `model.layers.{i}.*`, i >= its layers), which a speculative engine loads into its draft
    model and its target skips."""
    if name.startswith(("mtp.", "fc.", "layers.")):
        return True
    if arch is None or not families.get(arch.model_type).native_mtp:
        return False
    parts = name.split(".", 3)
    layer = parts[2] if parts[:2] == ["model", "layers"] else ""
    return layer.isdigit() and int(layer) >= arch.num_layers


def draft_names(names: Iterable[str]) -> set[str]:
    """The MTP draft's weights among the HF weight `names` of one state dict, told from the
    names alone (an in-memory sync has no config.json): `is_draft`'s, and every weight of a
    native NextN layer, the model layer that carries the NextN module's own `eh_proj`
    (`_NEXTN_MODULE`; no decoder layer has one), under the names SGLang's NextN draft loads
    as an export carries them."""
    names = list(names)
    nextn = tuple(n.removesuffix("eh_proj.weight") for n in names
                  if n.startswith("model.layers.") and n.endswith(".eh_proj.weight"))  # fmt: skip
    return {n for n in names if is_draft(n) or n.startswith(nextn)}


def load_groups(names: Iterable[str]) -> list[list[str]]:
    """The HF weight `names` of one state dict in order, in groups that SGLang must load in one
    `load_weights` call (any family's `Family.sglang_fused`: a group's later members moved up
    beside its first), every other name a group of its own."""
    names = list(names)
    present, placed = set(names), set()
    fused = [group for family in families.all_families() for group in family.sglang_fused]
    out = []
    for name in names:
        if name in placed:
            continue
        group = [name]
        for suffixes in fused:
            end = next((s for s in suffixes if name.endswith("." + s)), None)
            if end is not None:
                prefix = name.removesuffix(end)
                group = [prefix + s for s in suffixes if prefix + s in present]
                break
        out.append([n for n in group if n not in placed])
        placed.update(group)
    return out


def mtp_prefix(module: int, eagle: bool = False) -> str:
    """HF prefix of MTP module `module`: for the first (the one SGLang's draft reads) `mtp.`,
    or none in the EAGLE layout; `mtp.{j}.` for the later ones, which SGLang's loaders skip (no
    such parameters)."""
    return f"mtp.{module}." if module else ("" if eagle else "mtp.")


def _draft_layout(arch: ModelArch, module: int) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    """MTP module `module`'s HF prefix, its decoder layer's, and its own weights' HF ->
    megatron names (none for an EAGLE module, whose `fc` the callers map)."""
    if families.get(arch.model_type).native_mtp:
        prefix = f"model.layers.{arch.num_layers + module}."
        return prefix, prefix, _NEXTN_MODULE
    prefix = mtp_prefix(module, arch.eagle_draft)
    return prefix, prefix + "layers.0.", () if arch.eagle_draft else _MTP_MODULE


def hf_to_mcore(
    hf: dict[str, torch.Tensor] | LazyWeights,
    arch: ModelArch,
    mtp_layers: int = 0,
    out: MutableMapping[str, torch.Tensor] | None = None,
) -> MutableMapping[str, torch.Tensor]:
    """Full megatron state dict from an HF one, put into `out` (a new dict if None) tensor by
    tensor, in order: with `LazyWeights` in and a `shard.ParamSink` out a load streams, one
    layer's tensors in memory at a time. Every HF tensor must be used exactly once, except
    `mtp.*` weights when `mtp_layers` is 0; with `mtp_layers` k, weights without any `mtp.*`
    give a dict without MTP modules (the learner keeps their initialisation)."""
    hf, family = hf.copy(), families.get(arch.model_type)
    out = {} if out is None else out
    out["embedding.word_embeddings.weight"] = take(hf, "model.embed_tokens.weight")
    out["decoder.final_layernorm.weight"] = take(hf, "model.norm.weight")
    if arch.tied_embeddings:
        hf.pop("lm_head.weight", None)  # some writers store the tied copy anyway
    else:
        out["output_layer.weight"] = take(hf, "lm_head.weight")
    for i in range(arch.num_layers):
        family.layer_to_mcore(hf, out, f"model.layers.{i}.", f"decoder.layers.{i}.", arch,
                              arch.is_moe_layer(i))  # fmt: skip
    has_mtp = any(is_draft(k, arch) for k in hf)
    eagle = arch.eagle_draft
    if mtp_layers and eagle and has_mtp and "fc.weight" not in hf:
        raise ConfigError(
            "these weights carry an MTP-layout draft (mtp.*), but a dense model's draft is an "
            "EAGLE one (fc.*, layers.0.*, as agent-rl exports it since SGLang serves that): "
            "start from weights without the draft, or with trainer.mtp.layers = 0"
        )
    for j in range(mtp_layers if has_mtp else 0):
        (src, src_layer, names), dst = _draft_layout(arch, j), f"mtp.layers.{j}."
        layer = f"{dst}{megatron_cpu.mtp_decoder_layer()}."
        if eagle:
            out[dst + "eh_proj.weight"] = take(hf, src + "fc.weight")
            zero(take(hf, src + "fc.bias"), src + "fc.bias")
        for hf_name, mcore_name in names:
            out[dst + mcore_name] = take(hf, src + hf_name)
        for shared in _NEXTN_SHARED if family.native_mtp else ():
            if src + shared in hf:
                del hf[src + shared]  # not read: a vocabulary-sized copy
        heads = hf_heads(hf, src_layer + "self_attn.", arch.head_dim) if eagle else None
        family.layer_to_mcore(hf, out, src_layer, layer, arch, arch.is_moe, eagle=eagle,
                              heads=heads)  # fmt: skip
    # Without MTP layers, an export's draft is skipped (as SGLang's target model does).
    left = [k for k in hf if mtp_layers or not is_draft(k, arch)]
    if left:
        raise ConfigError(
            f"unexpected weights {sorted(left)[:5]}: the weights do not match config.json"
        )
    return out


def mcore_to_hf(sd: dict[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """HF state dict (on-disk names) from a full megatron one; the inverse of `hf_to_mcore`.
    MTP modules, if any, go under `mtp_prefix(j)` (module 0 in the names SGLang's draft for
    the model reads; see the module docstring)."""
    family = families.get(arch.model_type)
    out = {
        "model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
        "model.norm.weight": sd["decoder.final_layernorm.weight"],
    }
    if not arch.tied_embeddings:
        out["lm_head.weight"] = sd["output_layer.weight"]
    for i in range(arch.num_layers):
        family.layer_to_hf(sd, out, f"decoder.layers.{i}.", f"model.layers.{i}.", arch,
                           arch.is_moe_layer(i))  # fmt: skip
    j = 0
    eagle = arch.eagle_draft
    while f"mtp.layers.{j}.eh_proj.weight" in sd:
        src, (dst, dst_layer, names) = f"mtp.layers.{j}.", _draft_layout(arch, j)
        layer = f"{src}{megatron_cpu.mtp_decoder_layer()}."
        if eagle:
            fc = sd[src + "eh_proj.weight"]
            out[dst + "fc.weight"] = fc
            out[dst + "fc.bias"] = fc.new_zeros(fc.shape[0])  # SGLang's fc has one, ours none
        for hf_name, mcore_name in names:
            out[dst + hf_name] = sd[src + mcore_name]
        heads = mcore_heads(sd, layer + "self_attention.", arch) if eagle else None
        family.layer_to_hf(sd, out, layer, dst_layer, arch, arch.is_moe, eagle=eagle,
                           heads=heads)  # fmt: skip
        j += 1
    return out


def write_hf_dir(
    hf: dict[str, torch.Tensor],
    out_dir: str | Path,
    source_dir: str | Path,
    dtype: torch.dtype | None = None,
) -> None:
    """Write `model.safetensors` plus the non-weight files (config, tokenizer, generation config)
    copied from the model directory training started from, so engines load `out_dir` as is.
    With an EAGLE draft (a dense model's `fc.weight`), also `out_dir/draft/`: the draft's
    weights alone, with the config SGLang builds `Qwen2ForCausalLMEagle` from, and where the
    family allows (`Family.eagle_beside_target`) the draft's weights beside the target's in
    `EAGLE_BESIDE_FILE`."""
    out_dir, source_dir = Path(out_dir), Path(source_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Written tensor by tensor (each cast and made contiguous in turn): `hf` may be views of
    # the live parameters, and a copy of them all first would be a second model in memory.
    eagle = "fc.weight" in hf
    model_type = json.loads((source_dir / "config.json").read_text()).get("model_type")
    draft = {k: v for k, v in hf.items() if eagle and is_draft(k)}
    target = {k: v for k, v in hf.items() if k not in draft}
    save_streaming(target, out_dir / "model.safetensors", {"format": "pt"}, dtype)
    beside = out_dir / EAGLE_BESIDE_FILE
    if draft and families.get(model_type).eagle_beside_target:
        save_streaming(draft, beside, {"format": "pt"}, dtype)
    else:
        beside.unlink(missing_ok=True)  # an earlier export's, into the same directory
    for f in source_dir.iterdir():
        if (
            f.is_file()
            and not f.name.endswith(".safetensors")
            and f.name != "model.safetensors.index.json"
        ):
            (out_dir / f.name).write_bytes(f.read_bytes())
    config = json.loads((out_dir / "config.json").read_text())
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    if families.get(model_type).native_mtp:
        # The NextN layers it carries: SGLang's target skips layers past num_hidden_layers
        # only when this says there are some, and its NextN draft reads them by it.
        config["num_nextn_predict_layers"] = sum(k.endswith(".eh_proj.weight") for k in hf)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if eagle:
        _write_eagle_draft(draft, out_dir, dtype)


def _write_eagle_draft(
    draft: dict[str, torch.Tensor], out_dir: Path, dtype: torch.dtype | None = None
) -> None:
    """`out_dir/draft/`: the EAGLE draft's modules `draft` (module 0 is the one SGLang serves; it
    skips the later ones, `mtp.{j}.*`) and the target's config as SGLang's
    `Qwen2ForCausalLMEagle` takes it (one layer, the draft's MLP width and attention heads; its
    embedding and head are the target's, shared at serve time), with the tokenizer files beside
    it."""
    draft_dir = out_dir / EAGLE_DRAFT_DIR
    draft_dir.mkdir(exist_ok=True)
    save_streaming(draft, draft_dir / "model.safetensors", {"format": "pt"}, dtype)
    for f in out_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            (draft_dir / f.name).write_bytes(f.read_bytes())
    config = json.loads((out_dir / "config.json").read_text())
    # The draft's MLP may be narrower than the target's (trainer.mtp.ffn_hidden_size), its
    # attention have fewer heads (trainer.mtp.num_attention_heads), each as wide as the
    # target's: read from the tensors, so the config cannot disagree with them.
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads, kv_heads = hf_heads(draft, "layers.0.self_attn.", head_dim)
    config.update(architectures=[EAGLE_DRAFT_ARCHITECTURE], model_type=EAGLE_DRAFT_MODEL_TYPE,
                  num_hidden_layers=1,
                  intermediate_size=draft["layers.0.mlp.down_proj.weight"].shape[1],
                  num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim)  # fmt: skip
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:1]
    (draft_dir / "config.json").write_text(json.dumps(config, indent=2))
