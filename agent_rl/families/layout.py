"""The standard decoder layer's weights, HF <-> megatron-core (local spec), for the families
built from it (RMSNorm, SwiGLU, GQA; optional q/k/v bias, per-head q/k norm, routed experts).

Layouts on the megatron side:
- `linear_qkv` is interleaved by query group: for each of the `g` kv heads, its `h/g` query
  heads, then its key head, then its value head ([g * (h/g + 2) * d, hidden]); this is what makes
  a contiguous TP split give every rank whole groups.
- `linear_fc1` is [gate; up] stacked on dim 0 (SwiGLU), per expert for MoE.
Pure reshaping and concatenation, so HF -> mcore -> HF is bit-exact. A family whose layers
differ (shared experts, latent attention) overrides `Family.layer_to_mcore`/`layer_to_hf`.
Imports torch: the families import it when they convert.
"""

from __future__ import annotations

import torch

from agent_rl.families.arch import ModelArch
from agent_rl.kernel.errors import ConfigError

Weights = dict[str, torch.Tensor]


def take(sd: Weights, key: str) -> torch.Tensor:
    """Pop `key`; ConfigError (the weights do not match config.json) where it is missing."""
    try:
        return sd.pop(key)
    except KeyError:
        raise ConfigError(
            f"weight {key!r} is missing: the weights do not match config.json"
        ) from None


def take_stacked(sd: Weights, keys: list[str]) -> torch.Tensor:
    """`take` each of `keys`, concatenated on dim 0. Weights read as asked for
    (trainer.safetensors_io's `LazyWeights`, a big model's load) are read straight into the
    result: a fused MLP weight of a 1B model is most of it, and torch.cat a second copy."""
    pop_stacked = getattr(sd, "pop_stacked", None)
    stacked = pop_stacked(keys) if pop_stacked is not None else None
    return stacked if stacked is not None else torch.cat([take(sd, k) for k in keys], dim=0)


def zero(t: torch.Tensor, name: str) -> None:
    """An EAGLE draft's bias the learner's module does not have must be zero."""
    if t.any():
        raise ConfigError(f"{name} is not zero: the EAGLE draft agent-rl trains has no such bias")


def hf_heads(hf: Weights, attn: str, head_dim: int) -> tuple[int, int]:
    """The (query, key/value) heads of the HF attention under `attn`, read from its
    projections' shapes: an EAGLE draft's may be its own (`trainer.mtp.num_attention_heads`),
    each head the model's `head_dim` wide."""
    q, k = hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"]
    return q.shape[0] // head_dim, k.shape[0] // head_dim


def mcore_heads(sd: Weights, attn: str, arch: ModelArch) -> tuple[int, int]:
    """`hf_heads` for megatron's attention under `attn`: its output projection takes every
    query head, its fused projection gives the query heads and two rows of key/value heads."""
    d = arch.head_dim
    h = sd[attn + "linear_proj.weight"].shape[1] // d
    return h, (sd[attn + "linear_qkv.weight"].shape[0] // d - h) // 2


def layer_in(
    hf: Weights, out: Weights, src: str, dst: str, arch: ModelArch, moe: bool,
    eagle: bool = False, heads: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    """One decoder layer, HF -> megatron (`moe`: with routed experts, a router (and its score
    correction bias) and shared experts where the arch has them; `eagle`: an EAGLE draft's, see
    `layer_out`; `heads`: its (query, key/value) heads where not the model's)."""
    (h, g), d = heads or (arch.num_heads, arch.num_kv_heads), arch.head_dim
    attn = src + "self_attn."
    suffixes = ["weight"] + (["bias"] if arch.qkv_bias else [])
    if eagle and not arch.qkv_bias:
        for name in ("q", "k", "v"):
            zero(take(hf, f"{attn}{name}_proj.bias"), f"{attn}{name}_proj.bias")
    for kind in suffixes:
        q = take(hf, f"{attn}q_proj.{kind}").reshape(g, h // g * d, -1)
        k = take(hf, f"{attn}k_proj.{kind}").reshape(g, d, -1)
        v = take(hf, f"{attn}v_proj.{kind}").reshape(g, d, -1)
        qkv = torch.cat([q, k, v], dim=1).reshape(g * (h // g + 2) * d, -1)
        out[f"{dst}self_attention.linear_qkv.{kind}"] = (
            qkv.squeeze(-1) if kind == "bias" else qkv
        )
    out[dst + "self_attention.linear_proj.weight"] = take(hf, attn + "o_proj.weight")
    if arch.qk_norm and not eagle:
        out[dst + "self_attention.q_layernorm.weight"] = take(hf, attn + "q_norm.weight")
        out[dst + "self_attention.k_layernorm.weight"] = take(hf, attn + "k_norm.weight")
    if not eagle:
        out[dst + "input_layernorm.weight"] = take(hf, src + "input_layernorm.weight")
    ffn_in(hf, out, src, dst, arch, moe)


def ffn_in(hf: Weights, out: Weights, src: str, dst: str, arch: ModelArch, moe: bool) -> None:
    """A decoder layer's feed-forward half, HF -> megatron: its norm, then a dense MLP or (`moe`)
    the router (and its score correction bias), the routed experts and the shared ones where the
    arch has them."""
    out[dst + "pre_mlp_layernorm.weight"] = take(hf, src + "post_attention_layernorm.weight")
    if moe:
        out[dst + "mlp.router.weight"] = take(hf, src + "mlp.gate.weight")
        if arch.moe_router_bias:
            out[dst + "mlp.router.expert_bias"] = take(hf, src + "mlp.gate.e_score_correction_bias")
        for e in range(arch.num_experts):
            mlp_in(hf, out, f"{src}mlp.experts.{e}.", f"{dst}mlp.experts.local_experts.{e}.")
        if arch.moe_shared_ffn_hidden_size:
            mlp_in(hf, out, src + "mlp.shared_experts.", dst + "mlp.shared_experts.")
    else:
        mlp_in(hf, out, src + "mlp.", dst + "mlp.")


def mlp_in(hf: Weights, out: Weights, src: str, dst: str) -> None:
    """A SwiGLU MLP, HF -> megatron: gate and up stacked into `linear_fc1`."""
    out[dst + "linear_fc1.weight"] = take_stacked(
        hf, [src + "gate_proj.weight", src + "up_proj.weight"]
    )
    out[dst + "linear_fc2.weight"] = take(hf, src + "down_proj.weight")


def layer_out(
    sd: Weights, out: Weights, src: str, dst: str, arch: ModelArch, moe: bool,
    eagle: bool = False, heads: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    """One decoder layer, megatron -> HF (`moe` as in `layer_in`). `eagle`: an EAGLE draft's (trainer.mtp_model's
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
    ffn_out(sd, out, src, dst, arch, moe)


def ffn_out(sd: Weights, out: Weights, src: str, dst: str, arch: ModelArch, moe: bool) -> None:
    """The inverse of `ffn_in`."""
    out[dst + "post_attention_layernorm.weight"] = sd[src + "pre_mlp_layernorm.weight"]
    if moe:
        out[dst + "mlp.gate.weight"] = sd[src + "mlp.router.weight"]
        if arch.moe_router_bias:
            out[dst + "mlp.gate.e_score_correction_bias"] = sd[src + "mlp.router.expert_bias"]
        for e in range(arch.num_experts):
            mlp_out(sd, out, f"{src}mlp.experts.local_experts.{e}.", f"{dst}mlp.experts.{e}.")
        if arch.moe_shared_ffn_hidden_size:
            mlp_out(sd, out, src + "mlp.shared_experts.", dst + "mlp.shared_experts.")
    else:
        mlp_out(sd, out, src + "mlp.", dst + "mlp.")


def mlp_out(sd: Weights, out: Weights, src: str, dst: str) -> None:
    """The inverse of `mlp_in`."""
    gate, up = torch.chunk(sd[src + "linear_fc1.weight"], 2, dim=0)
    out[dst + "gate_proj.weight"] = gate
    out[dst + "up_proj.weight"] = up
    out[dst + "down_proj.weight"] = sd[src + "linear_fc2.weight"]
