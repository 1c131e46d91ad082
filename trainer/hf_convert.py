"""HF <-> megatron-core weight names and layouts for the Qwen2 / Qwen3 / Qwen3-MoE families.

Both directions work on *full* (unsharded, TP=1/EP=1 layout) state dicts; trainer.shard cuts
and gathers the per-rank pieces. The HF side is the on-disk checkpoint format that SGLang and
transformers load: per-projection q/k/v, gate/up/down, per-expert
`mlp.experts.{e}.{gate,up,down}_proj.weight`, no `lm_head.weight` when embeddings are tied.

Layouts on the megatron side (local spec):
- `linear_qkv` is interleaved by query group: for each of the `g` kv heads, its `h/g` query
  heads, then its key head, then its value head ([g * (h/g + 2) * d, hidden]); this is what makes
  a contiguous TP split give every rank whole groups.
- `linear_fc1` is [gate; up] stacked on dim 0 (SwiGLU), per expert for MoE.
Conversion is pure reshaping and concatenation, so HF -> mcore -> HF is bit-exact.

MTP draft modules (`trainer.mtp.layers`, megatron `mtp.layers.{j}.*`) map to the names SGLang's
draft for the model loads (`mtp_prefix`; their decoder layer as the trunk's layers map):
- Qwen3-MoE: `mtp.*` (`_MTP_MODULE`), read by its `Qwen3MoeForCausalLMMTP` from the target's own
  directory;
- dense Qwen2/Qwen3 (`ModelArch.eagle_draft`): module 0 as `fc.{weight,bias}` and `layers.0.*`
  (no norms but the layer's post-attention one; q/k/v biases, zero where the model has none),
  the names `Qwen2ForCausalLMEagle` reads. `write_hf_dir` writes the draft as a directory of its
  own, `draft/` (`EAGLE_DRAFT_DIR`), with the draft's config: the `--speculative-draft-model-path`
  a launch takes. For Qwen2 the export also carries the draft beside the target's weights, in a
  file of its own (`EAGLE_BESIDE_FILE`), which SGLang's Qwen2 target skips, so a disk update
  (one directory for target and draft) updates both; SGLang's Qwen3 target would load
  `layers.*` into its own layers and fails on names it does not know, so a Qwen3 export keeps
  the draft in `draft/` only (`EAGLE_BESIDE_TARGET`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from agent_rl.sglang.speculative import EAGLE_DRAFT_ARCHITECTURE, EAGLE_DRAFT_DIR
from agent_rl.kernel.errors import ConfigError
from trainer import megatron_cpu
from trainer.arch import ModelArch


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the `*.safetensors` files in `path`, and those of an EAGLE draft in
    `path/draft/` that are not beside them."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path} has no *.safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in [*files, *sorted((Path(path) / EAGLE_DRAFT_DIR).glob("*.safetensors"))]:
        with safe_open(str(f), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                out.setdefault(key, handle.get_tensor(key))
    return out


def _take(sd: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    try:
        return sd.pop(key)
    except KeyError:
        raise ConfigError(
            f"weight {key!r} is missing: the weights do not match config.json"
        ) from None


# One MTP module, HF name -> megatron name; its decoder layer maps as the trunk's layers do.
# SGLang's Qwen3-MoE MTP draft (Qwen3MoeForCausalLMMTP) reads module 0 under `mtp.`.
_MTP_MODULE = (
    ("fc.weight", "eh_proj.weight"),
    ("pre_fc_norm_embedding.weight", "enorm.weight"),
    ("pre_fc_norm_hidden.weight", "hnorm.weight"),
    ("norm.weight", "final_layernorm.weight"),
)


EAGLE_BESIDE_TARGET = ("qwen2",)
"""Model types whose export also carries the EAGLE draft beside the target's weights (see the
module docstring)."""
EAGLE_BESIDE_FILE = "draft.safetensors"
"""The file beside `model.safetensors` that carries it: SGLang loads every safetensors file of a
directory without an index (target and draft alike, each taking its own names), transformers
only `model.safetensors`, whose prefix-less names it would otherwise load the draft's
`layers.0.*` from into the target's first layer."""


def is_draft(name: str) -> bool:
    """Whether HF weight `name` belongs to the MTP draft (`mtp.*`; a dense model's EAGLE
    module `fc.*`, `layers.0.*`), which a speculative engine loads into its draft model and its
    target skips."""
    return name.startswith(("mtp.", "fc.", "layers."))


def mtp_prefix(module: int, eagle: bool = False) -> str:
    """HF prefix of MTP module `module`: for the first (the one SGLang's draft reads) `mtp.`,
    or none in the EAGLE layout; `mtp.{j}.` for the later ones, which SGLang's loaders skip (no
    such parameters)."""
    return f"mtp.{module}." if module else ("" if eagle else "mtp.")


def hf_to_mcore(
    hf: dict[str, torch.Tensor], arch: ModelArch, mtp_layers: int = 0
) -> dict[str, torch.Tensor]:
    """Full megatron state dict from an HF one. Every HF tensor must be used exactly once,
    except `mtp.*` weights when `mtp_layers` is 0; with `mtp_layers` k, weights without any
    `mtp.*` give a dict without MTP modules (the learner keeps their initialisation)."""
    hf = dict(hf)
    out = {
        "embedding.word_embeddings.weight": _take(hf, "model.embed_tokens.weight"),
        "decoder.final_layernorm.weight": _take(hf, "model.norm.weight"),
    }
    if arch.tied_embeddings:
        hf.pop("lm_head.weight", None)  # some writers store the tied copy anyway
    else:
        out["output_layer.weight"] = _take(hf, "lm_head.weight")
    for i in range(arch.num_layers):
        _layer_in(hf, out, f"model.layers.{i}.", f"decoder.layers.{i}.", arch)
    has_mtp = any(is_draft(k) for k in hf)
    eagle = arch.eagle_draft
    if mtp_layers and eagle and has_mtp and "fc.weight" not in hf:
        raise ConfigError(
            "these weights carry an MTP-layout draft (mtp.*), but a dense model's draft is an "
            "EAGLE one (fc.*, layers.0.*, as agent-rl exports it since SGLang serves that): "
            "start from weights without the draft, or with trainer.mtp.layers = 0"
        )
    for j in range(mtp_layers if has_mtp else 0):
        src, dst = mtp_prefix(j, eagle), f"mtp.layers.{j}."
        layer = f"{dst}{megatron_cpu.mtp_decoder_layer()}."
        if eagle:
            out[dst + "eh_proj.weight"] = _take(hf, src + "fc.weight")
            _zero(_take(hf, src + "fc.bias"), src + "fc.bias")
        else:
            for hf_name, mcore_name in _MTP_MODULE:
                out[dst + mcore_name] = _take(hf, src + hf_name)
        heads = _hf_heads(hf, src + "layers.0.self_attn.", arch.head_dim) if eagle else None
        _layer_in(hf, out, src + "layers.0.", layer, arch, eagle=eagle, heads=heads)
    if not mtp_layers:
        # An export with a draft, loaded without one (as SGLang's target model does).
        hf = {k: v for k, v in hf.items() if not is_draft(k)}
    if hf:
        raise ConfigError(
            f"unexpected weights {sorted(hf)[:5]}: the weights do not match config.json"
        )
    return out


def _zero(t: torch.Tensor, name: str) -> None:
    """An EAGLE draft's bias the learner's module does not have must be zero."""
    if t.any():
        raise ConfigError(f"{name} is not zero: the EAGLE draft agent-rl trains has no such bias")


def _hf_heads(hf: dict[str, torch.Tensor], attn: str, head_dim: int) -> tuple[int, int]:
    """The (query, key/value) heads of the HF attention under `attn`, read from its
    projections' shapes: an EAGLE draft's may be its own (`trainer.mtp.num_attention_heads`),
    each head the model's `head_dim` wide."""
    q, k = hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"]
    return q.shape[0] // head_dim, k.shape[0] // head_dim


def _mcore_heads(sd: dict[str, torch.Tensor], attn: str, arch: ModelArch) -> tuple[int, int]:
    """`_hf_heads` for megatron's attention under `attn`: its output projection takes every
    query head, its fused projection gives the query heads and two rows of key/value heads."""
    d = arch.head_dim
    h = sd[attn + "linear_proj.weight"].shape[1] // d
    return h, (sd[attn + "linear_qkv.weight"].shape[0] // d - h) // 2


def _layer_in(
    hf: dict[str, torch.Tensor], out: dict[str, torch.Tensor], src: str, dst: str,
    arch: ModelArch, eagle: bool = False, heads: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    """One decoder layer, HF -> megatron (`eagle`: an EAGLE draft's, see `_layer_out`; `heads`:
    its (query, key/value) heads where not the model's)."""
    (h, g), d = heads or (arch.num_heads, arch.num_kv_heads), arch.head_dim
    attn = src + "self_attn."
    suffixes = ["weight"] + (["bias"] if arch.qkv_bias else [])
    if eagle and not arch.qkv_bias:
        for name in ("q", "k", "v"):
            _zero(_take(hf, f"{attn}{name}_proj.bias"), f"{attn}{name}_proj.bias")
    for kind in suffixes:
        q = _take(hf, f"{attn}q_proj.{kind}").reshape(g, h // g * d, -1)
        k = _take(hf, f"{attn}k_proj.{kind}").reshape(g, d, -1)
        v = _take(hf, f"{attn}v_proj.{kind}").reshape(g, d, -1)
        qkv = torch.cat([q, k, v], dim=1).reshape(g * (h // g + 2) * d, -1)
        out[f"{dst}self_attention.linear_qkv.{kind}"] = (
            qkv.squeeze(-1) if kind == "bias" else qkv
        )
    out[dst + "self_attention.linear_proj.weight"] = _take(hf, attn + "o_proj.weight")
    if arch.qk_norm and not eagle:
        out[dst + "self_attention.q_layernorm.weight"] = _take(hf, attn + "q_norm.weight")
        out[dst + "self_attention.k_layernorm.weight"] = _take(hf, attn + "k_norm.weight")
    if not eagle:
        out[dst + "input_layernorm.weight"] = _take(hf, src + "input_layernorm.weight")
    out[dst + "pre_mlp_layernorm.weight"] = _take(hf, src + "post_attention_layernorm.weight")
    if arch.is_moe:
        out[dst + "mlp.router.weight"] = _take(hf, src + "mlp.gate.weight")
        for e in range(arch.num_experts):
            _mlp_in(hf, out, f"{src}mlp.experts.{e}.", f"{dst}mlp.experts.local_experts.{e}.")
    else:
        _mlp_in(hf, out, src + "mlp.", dst + "mlp.")


def _mlp_in(hf: dict[str, torch.Tensor], out: dict[str, torch.Tensor], src: str, dst: str) -> None:
    gate, up = _take(hf, src + "gate_proj.weight"), _take(hf, src + "up_proj.weight")
    out[dst + "linear_fc1.weight"] = torch.cat([gate, up], dim=0)
    out[dst + "linear_fc2.weight"] = _take(hf, src + "down_proj.weight")


def mcore_to_hf(sd: dict[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """HF state dict (on-disk names) from a full megatron one; the inverse of `hf_to_mcore`.
    MTP modules, if any, go under `mtp_prefix(j)` (module 0 in the names SGLang's draft for
    the model reads; see the module docstring)."""
    out = {
        "model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
        "model.norm.weight": sd["decoder.final_layernorm.weight"],
    }
    if not arch.tied_embeddings:
        out["lm_head.weight"] = sd["output_layer.weight"]
    for i in range(arch.num_layers):
        _layer_out(sd, out, f"decoder.layers.{i}.", f"model.layers.{i}.", arch)
    j = 0
    eagle = arch.eagle_draft
    while f"mtp.layers.{j}.eh_proj.weight" in sd:
        src, dst = f"mtp.layers.{j}.", mtp_prefix(j, eagle)
        layer = f"{src}{megatron_cpu.mtp_decoder_layer()}."
        if eagle:
            fc = sd[src + "eh_proj.weight"]
            out[dst + "fc.weight"] = fc
            out[dst + "fc.bias"] = fc.new_zeros(fc.shape[0])  # SGLang's fc has one, ours none
        else:
            for hf_name, mcore_name in _MTP_MODULE:
                out[dst + hf_name] = sd[src + mcore_name]
        heads = _mcore_heads(sd, layer + "self_attention.", arch) if eagle else None
        _layer_out(sd, out, layer, dst + "layers.0.", arch, eagle=eagle, heads=heads)
        j += 1
    return out


def _layer_out(
    sd: dict[str, torch.Tensor], out: dict[str, torch.Tensor], src: str, dst: str,
    arch: ModelArch, eagle: bool = False, heads: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    """One decoder layer, megatron -> HF. `eagle`: an EAGLE draft's (trainer.mtp_model's
    `eagle_block`) as SGLang's Qwen2 EAGLE layer reads it: no input norm or q/k norm, and q/k/v
    biases, zero where the model has none. `heads`: its (query, key/value) heads where not the
    model's."""
    (h, g), d = heads or (arch.num_heads, arch.num_kv_heads), arch.head_dim
    attn = dst + "self_attn."
    for kind in ["weight"] + (["bias"] if arch.qkv_bias else []):
        qkv = sd[f"{src}self_attention.linear_qkv.{kind}"].reshape(g, (h // g + 2) * d, -1)
        q, k, v = torch.split(qkv, [h // g * d, d, d], dim=1)
        for name, part, rows in (("q", q, h * d), ("k", k, g * d), ("v", v, g * d)):
            t = part.reshape(rows, -1)
            out[f"{attn}{name}_proj.{kind}"] = t.squeeze(-1) if kind == "bias" else t
    if eagle and not arch.qkv_bias:
        weight = sd[f"{src}self_attention.linear_qkv.weight"]
        for name, rows in (("q", h * d), ("k", g * d), ("v", g * d)):
            out[f"{attn}{name}_proj.bias"] = weight.new_zeros(rows)
    out[attn + "o_proj.weight"] = sd[src + "self_attention.linear_proj.weight"]
    if arch.qk_norm and not eagle:
        out[attn + "q_norm.weight"] = sd[src + "self_attention.q_layernorm.weight"]
        out[attn + "k_norm.weight"] = sd[src + "self_attention.k_layernorm.weight"]
    if not eagle:
        out[dst + "input_layernorm.weight"] = sd[src + "input_layernorm.weight"]
    out[dst + "post_attention_layernorm.weight"] = sd[src + "pre_mlp_layernorm.weight"]
    if arch.is_moe:
        out[dst + "mlp.gate.weight"] = sd[src + "mlp.router.weight"]
        for e in range(arch.num_experts):
            _mlp_out(sd, out, f"{src}mlp.experts.local_experts.{e}.", f"{dst}mlp.experts.{e}.")
    else:
        _mlp_out(sd, out, src + "mlp.", dst + "mlp.")


def _mlp_out(sd: dict[str, torch.Tensor], out: dict[str, torch.Tensor], src: str, dst: str) -> None:
    gate, up = torch.chunk(sd[src + "linear_fc1.weight"], 2, dim=0)
    out[dst + "gate_proj.weight"] = gate
    out[dst + "up_proj.weight"] = up
    out[dst + "down_proj.weight"] = sd[src + "linear_fc2.weight"]


def write_hf_dir(
    hf: dict[str, torch.Tensor],
    out_dir: str | Path,
    source_dir: str | Path,
    dtype: torch.dtype | None = None,
) -> None:
    """Write `model.safetensors` plus the non-weight files (config, tokenizer, generation config)
    copied from the model directory training started from, so engines load `out_dir` as is.
    With an EAGLE draft (a dense model's `fc.weight`), also `out_dir/draft/`: the draft's
    weights alone, with the config SGLang builds `Qwen2ForCausalLMEagle` from, and for Qwen2
    the draft's weights beside the target's in `EAGLE_BESIDE_FILE`."""
    out_dir, source_dir = Path(out_dir), Path(source_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: (v.to(dtype) if dtype else v).detach().contiguous().clone() for k, v in hf.items()
    }
    eagle = "fc.weight" in tensors
    model_type = json.loads((source_dir / "config.json").read_text()).get("model_type")
    draft = {k: v for k, v in tensors.items() if eagle and is_draft(k)}
    target = {k: v for k, v in tensors.items() if k not in draft}
    save_file(target, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    beside = out_dir / EAGLE_BESIDE_FILE
    if draft and model_type in EAGLE_BESIDE_TARGET:
        save_file(draft, str(beside), metadata={"format": "pt"})
    else:
        beside.unlink(missing_ok=True)  # an earlier export's, into the same directory
    for f in source_dir.iterdir():
        if (
            f.is_file()
            and not f.name.endswith(".safetensors")
            and f.name != "model.safetensors.index.json"
        ):
            (out_dir / f.name).write_bytes(f.read_bytes())
    if dtype is not None:
        config = json.loads((out_dir / "config.json").read_text())
        config["dtype"] = str(dtype).removeprefix("torch.")
        (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if eagle:
        _write_eagle_draft(draft, out_dir)


def _write_eagle_draft(draft: dict[str, torch.Tensor], out_dir: Path) -> None:
    """`out_dir/draft/`: the EAGLE draft's modules `draft` (module 0 is the one SGLang serves; it
    skips the later ones, `mtp.{j}.*`) and the target's config as SGLang's
    `Qwen2ForCausalLMEagle` takes it (one layer, the draft's MLP width and attention heads; its
    embedding and head are the target's, shared at serve time), with the tokenizer files beside
    it."""
    draft_dir = out_dir / EAGLE_DRAFT_DIR
    draft_dir.mkdir(exist_ok=True)
    save_file(draft, str(draft_dir / "model.safetensors"), metadata={"format": "pt"})
    for f in out_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            (draft_dir / f.name).write_bytes(f.read_bytes())
    config = json.loads((out_dir / "config.json").read_text())
    # The draft's MLP may be narrower than the target's (trainer.mtp.ffn_hidden_size), its
    # attention have fewer heads (trainer.mtp.num_attention_heads), each as wide as the
    # target's: read from the tensors, so the config cannot disagree with them.
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads, kv_heads = _hf_heads(draft, "layers.0.self_attn.", head_dim)
    config.update(architectures=[EAGLE_DRAFT_ARCHITECTURE], model_type="qwen2",
                  num_hidden_layers=1,
                  intermediate_size=draft["layers.0.mlp.down_proj.weight"].shape[1],
                  num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim)  # fmt: skip
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:1]
    (draft_dir / "config.json").write_text(json.dumps(config, indent=2))
