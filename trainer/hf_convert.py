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

MTP draft modules (`trainer.mtp_layers`, megatron `mtp.layers.{j}.*`) map to the `mtp.*` names
SGLang's Qwen3-MoE MTP draft loads (`mtp_prefix`, `_MTP_MODULE`; their decoder layer as the
trunk's layers map).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from agent_rl.errors import ConfigError
from trainer import megatron_cpu
from trainer.arch import ModelArch


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the `*.safetensors` files in `path`."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path} has no *.safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                out[key] = handle.get_tensor(key)
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


def is_draft(name: str) -> bool:
    """Whether HF weight `name` belongs to the MTP draft (`mtp.*`), which a speculative engine
    loads into its draft model and its target skips."""
    return name.startswith("mtp.")


def mtp_prefix(module: int) -> str:
    """HF prefix of MTP module `module`: `mtp.` for the first (the one SGLang's draft reads),
    `mtp.{j}.` for the later ones, which SGLang's loader skips (no such parameters)."""
    return "mtp." if module == 0 else f"mtp.{module}."


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
    has_mtp = any(k.startswith("mtp.") for k in hf)
    for j in range(mtp_layers if has_mtp else 0):
        src, dst = mtp_prefix(j), f"mtp.layers.{j}."
        for hf_name, mcore_name in _MTP_MODULE:
            out[dst + mcore_name] = _take(hf, src + hf_name)
        _layer_in(hf, out, src + "layers.0.", f"{dst}{megatron_cpu.mtp_decoder_layer()}.", arch)
    if not mtp_layers:
        # An export with a draft, loaded without one (as SGLang's target model does).
        hf = {k: v for k, v in hf.items() if not k.startswith("mtp.")}
    if hf:
        raise ConfigError(
            f"unexpected weights {sorted(hf)[:5]}: the weights do not match config.json"
        )
    return out


def _layer_in(
    hf: dict[str, torch.Tensor], out: dict[str, torch.Tensor], src: str, dst: str, arch: ModelArch
) -> None:
    h, g, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    attn = src + "self_attn."
    suffixes = ["weight"] + (["bias"] if arch.qkv_bias else [])
    for kind in suffixes:
        q = _take(hf, f"{attn}q_proj.{kind}").reshape(g, h // g * d, -1)
        k = _take(hf, f"{attn}k_proj.{kind}").reshape(g, d, -1)
        v = _take(hf, f"{attn}v_proj.{kind}").reshape(g, d, -1)
        qkv = torch.cat([q, k, v], dim=1).reshape(g * (h // g + 2) * d, -1)
        out[f"{dst}self_attention.linear_qkv.{kind}"] = (
            qkv.squeeze(-1) if kind == "bias" else qkv
        )
    out[dst + "self_attention.linear_proj.weight"] = _take(hf, attn + "o_proj.weight")
    if arch.qk_norm:
        out[dst + "self_attention.q_layernorm.weight"] = _take(hf, attn + "q_norm.weight")
        out[dst + "self_attention.k_layernorm.weight"] = _take(hf, attn + "k_norm.weight")
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
    MTP modules, if any, go under `mtp_prefix(j)` (module 0 in the names SGLang's Qwen3-MoE
    MTP draft reads)."""
    out = {
        "model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
        "model.norm.weight": sd["decoder.final_layernorm.weight"],
    }
    if not arch.tied_embeddings:
        out["lm_head.weight"] = sd["output_layer.weight"]
    for i in range(arch.num_layers):
        _layer_out(sd, out, f"decoder.layers.{i}.", f"model.layers.{i}.", arch)
    j = 0
    while f"mtp.layers.{j}.eh_proj.weight" in sd:
        src, dst = f"mtp.layers.{j}.", mtp_prefix(j)
        for hf_name, mcore_name in _MTP_MODULE:
            out[dst + hf_name] = sd[src + mcore_name]
        _layer_out(sd, out, f"{src}{megatron_cpu.mtp_decoder_layer()}.", dst + "layers.0.", arch)
        j += 1
    return out


def _layer_out(
    sd: dict[str, torch.Tensor], out: dict[str, torch.Tensor], src: str, dst: str, arch: ModelArch
) -> None:
    h, g, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    attn = dst + "self_attn."
    for kind in ["weight"] + (["bias"] if arch.qkv_bias else []):
        qkv = sd[f"{src}self_attention.linear_qkv.{kind}"].reshape(g, (h // g + 2) * d, -1)
        q, k, v = torch.split(qkv, [h // g * d, d, d], dim=1)
        for name, part, rows in (("q", q, h * d), ("k", k, g * d), ("v", v, g * d)):
            t = part.reshape(rows, -1)
            out[f"{attn}{name}_proj.{kind}"] = t.squeeze(-1) if kind == "bias" else t
    out[attn + "o_proj.weight"] = sd[src + "self_attention.linear_proj.weight"]
    if arch.qk_norm:
        out[attn + "q_norm.weight"] = sd[src + "self_attention.q_layernorm.weight"]
        out[attn + "k_norm.weight"] = sd[src + "self_attention.k_layernorm.weight"]
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
    copied from the model directory training started from, so engines load `out_dir` as is."""
    out_dir, source_dir = Path(out_dir), Path(source_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: (v.to(dtype) if dtype else v).detach().contiguous().clone() for k, v in hf.items()
    }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
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
