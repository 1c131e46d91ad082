"""DeepSeek-V3 (`DeepseekV3ForCausalLM`; Kimi-K2 and Moonlight share its shape): multi-head
latent attention, MoE with shared experts and group-limited sigmoid routing, dense first layers.

Attention is MLA, megatron-core's `MLASelfAttention` (`MLATransformerConfig`, the local spec's
`multi_latent_attention`): queries through a low-rank projection `q_a_proj` (`q_lora_rank`; or a
full `q_proj`), its RMSNorm and `q_b_proj`; keys and values from one latent `kv_a_proj_with_mqa`
(`kv_lora_rank` wide, plus the rotary key shared by every head), its RMSNorm and `kv_b_proj`.
The weights map one to one, each projection megatron's of the same layout (`linear_q_down_proj`,
`linear_q_up_proj`, `linear_kv_down_proj`, `linear_kv_up_proj`; the latents' norms megatron's
`q_layernorm` and `kv_layernorm`). The rotary dims of each query and of the shared key are
interleaved pairs (`rope_interleave`, which megatron's MLA assumes: it de-interleaves them as
transformers does); rotary embeddings are plain or YaRN (`factor`, `beta_fast`, `beta_slow`,
`mscale`, `mscale_all_dim`, `original_max_position_embeddings`: megatron's `rope_type = "yarn"`,
which scales the softmax by `mscale_all_dim`'s factor squared as transformers does).

The router: sigmoid scores, experts chosen on scores plus `e_score_correction_bias` within the
`topk_group` best of `n_group` groups, weighted by the scores without the bias, renormalised,
times `routed_scaling_factor` (megatron's sigmoid router with an expert bias, kept as loaded, and
its group-limited top-k). transformers scores a group by its top 2 experts, megatron by its top
(top-k / `topk_group`): equal for DeepSeek-V3's 8 / 4 and whenever `n_group` is 1 (Kimi-K2,
Moonlight); other group settings are refused, and so is `norm_topk_prob = false` (megatron
renormalises). The first `first_k_dense_replace` layers have a dense MLP.

Refused besides: `rope_interleave = false` (megatron's MLA de-interleaves), an RMSNorm epsilon
other than 1e-6 (transformers' latent norms keep that default while megatron's take the
model's), attention biases, a YaRN `attention_factor` or `mscale_all_dim` without `mscale`.
Its NextN/MTP layers (`num_nextn_predict_layers`, layers `num_hidden_layers` on) are the MTP
draft (`trainer.mtp.layers`: megatron-core's MTP modules, MLA and experts as the last layer's;
`Family.native_mtp`), served by SGLang as `DeepseekV3ForCausalLMNextN` from the target's
directory. Cannot yet: FP8 checkpoints. Preset: `tiny-deepseek_v3`.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

from agent_rl.families.arch import LatentAttention, ModelArch
from agent_rl.families.base import Family, Weights, rope_parameters, sigmoid_router_moe
from agent_rl.kernel.errors import ConfigError

LATENT_EPS = 1e-6
"""transformers' RMSNorm epsilon for the query and key/value latents (not the model's)."""

# One MLA layer's projections and latent norms, HF name -> megatron name (both under attention).
_LATENT = (
    ("q_a_proj.weight", "linear_q_down_proj.weight"),
    ("q_a_layernorm.weight", "q_layernorm.weight"),
    ("q_b_proj.weight", "linear_q_up_proj.weight"),
    ("kv_a_proj_with_mqa.weight", "linear_kv_down_proj.weight"),
    ("kv_a_layernorm.weight", "kv_layernorm.weight"),
    ("kv_b_proj.weight", "linear_kv_up_proj.weight"),
    ("o_proj.weight", "linear_proj.weight"),
)
_FULL_Q = (("q_proj.weight", "linear_q_proj.weight"),)
"""Without `q_lora_rank`: one query projection instead of the low-rank pair and its norm."""

_YARN = {"original_max_position_embeddings": None, "beta_fast": 32.0, "beta_slow": 1.0,
         "mscale": 1.0, "mscale_all_dim": 0.0}  # fmt: skip
"""YaRN's settings beside `factor` and their defaults where a config leaves them out."""


@cache
def _full_query_attention() -> type:
    """megatron-core's MLA for a model without a query latent (`q_lora_rank` None: a plain
    `q_proj`, as Moonlight's). megatron-core 0.19 resolves its projections from the latent
    norms' setting and, with them on and no query latent, asks for a query projection fused
    with a norm (TransformerEngine's) that DeepSeek's architecture does not have; here the query
    projection is the spec's plain one and only the key/value latent has its norm. (0.16 does
    not ask: the override is not called there.)"""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class FullQueryAttention(MLASelfAttention):
        def _resolve_qk_norm_config(self, submodules: Any) -> dict[str, Any]:
            return dict(linear_q_proj=submodules.linear_q_proj, linear_q_up_proj=IdentityOp,
                        linear_kv_up_proj=submodules.linear_kv_up_proj,
                        q_layernorm=IdentityOp, kv_layernorm=submodules.kv_layernorm)  # fmt: skip

    return FullQueryAttention


def _core_attention() -> type:
    """megatron-core's local core attention for MLA. Its MLA builds the core attention with the
    query/key and value widths (`k_channels`, `v_channels`), which only TransformerEngine's takes;
    the local one computes the same from the tensors it is given, its output as wide as
    `kv_channels` per head (`ModelArch.head_dim`: the value head here)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LatentCoreAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: int | None = None,
                     v_channels: int | None = None, **kwargs: Any) -> None:  # fmt: skip
            super().__init__(*args, **kwargs)
            assert v_channels in (None, self.config.kv_channels), (v_channels, self.config)

    return LatentCoreAttention


class DeepseekV3(Family):
    model_type = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    config_class = "DeepseekV3Config"
    draft = "mtp"
    mtp_draft_architecture = "DeepseekV3ForCausalLMNextN"
    native_mtp = True
    # SGLang's loader keeps `q_a_proj` (or `kv_a_proj_with_mqa`) until the other comes, within
    # one `load_weights` call, then loads both into `fused_qkv_a_proj_with_mqa`.
    sglang_fused = (("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),)
    # DeepSeek-V3's shape, shrunk: low-rank queries, a first dense layer, 16 experts in 4
    # groups (top-4 from the best 2 groups, DeepSeek-V3's 8 from 4 of 8 halved), a shared
    # expert, scaling factor 2.5, YaRN.
    presets: ClassVar = {
        "tiny-deepseek_v3": {"num_hidden_layers": 3, "num_attention_heads": 4,
                             "num_key_value_heads": 4, "num_experts": 16,
                             "num_experts_per_tok": 4, "moe_intermediate_size": 64,
                             "options": {"q_lora_rank": 96, "kv_lora_rank": 64,
                                         "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
                                         "v_head_dim": 32, "n_group": 4, "topk_group": 2,
                                         "n_shared_experts": 1, "first_k_dense_replace": 1,
                                         "routed_scaling_factor": 2.5,
                                         "yarn_factor": 4.0}},
    }  # fmt: skip
    preset_options = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                      "v_head_dim", "n_group", "topk_group", "n_shared_experts",
                      "first_k_dense_replace", "routed_scaling_factor",
                      "yarn_factor")  # fmt: skip

    # --- HF config -> ModelArch -------------------------------------------------------------

    def read_config(self, hf: Any, path: Path) -> ModelArch:
        quantized = getattr(hf, "quantization_config", None)
        if quantized:
            kind = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
            raise ConfigError(f"{path}: a quantized checkpoint ({kind}; DeepSeek-V3 ships FP8) "
                              "is not supported: start from its bf16 weights")  # fmt: skip
        if not getattr(hf, "rope_interleave", True):
            raise ConfigError(f"{path}: rope_interleave=false is not supported (megatron-core's "
                              "latent attention takes the rotary dims as interleaved pairs)")
        if hf.rms_norm_eps != LATENT_EPS:
            raise ConfigError(
                f"{path}: rms_norm_eps={hf.rms_norm_eps} is not supported: transformers' latent "
                f"norms use {LATENT_EPS} whatever the model's, megatron-core's the model's"
            )
        arch = super().read_config(hf, path)
        latent = LatentAttention(
            q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
            qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim,
            v_head_dim=hf.v_head_dim, rope_scaling=self._yarn(hf, path),
        )  # fmt: skip
        # The latents' RMSNorms are megatron's q/k layernorms (the local spec builds them so);
        # every head has its own keys and values, expanded from the latent; `head_dim` is
        # megatron's kv_channels, the width of each head's attention output: the value head.
        return replace(arch, num_kv_heads=arch.num_heads, qk_norm=True, latent=latent,
                       head_dim=hf.v_head_dim)  # fmt: skip

    def read_rope(self, hf: Any, path: Path) -> dict[str, Any]:
        rope = rope_parameters(hf)
        kind = rope.get("rope_type", "default")
        if kind not in ("default", "yarn") or rope["rope_theta"] is None:
            raise ConfigError(f"{path}: rotary embeddings: default or yarn with rope_theta")
        return {"rope_theta": float(rope["rope_theta"])}

    def _yarn(self, hf: Any, path: Path) -> dict[str, float] | None:
        """YaRN's settings as megatron-core takes them; None for plain rotary embeddings."""
        rope = rope_parameters(hf)
        if rope.get("rope_type", "default") != "yarn":
            return None
        if rope.get("attention_factor") is not None or not rope.get("truncate", True):
            raise ConfigError(f"{path}: yarn with attention_factor or truncate=false is not "
                              "supported")  # fmt: skip
        yarn = {k: rope.get(k) if rope.get(k) is not None else v for k, v in _YARN.items()}
        if yarn["original_max_position_embeddings"] is None:
            raise ConfigError(f"{path}: yarn without original_max_position_embeddings")
        factor = rope.get("factor") or hf.max_position_embeddings / yarn[
            "original_max_position_embeddings"]  # transformers' default  # fmt: skip
        # transformers' cos/sin factor is mscale's over mscale_all_dim's only when both are set
        # (else 0.1 ln(factor) + 1, megatron's with mscale 1 over none), its softmax factor
        # mscale_all_dim's squared: megatron takes both from the same two numbers.
        if rope.get("mscale_all_dim") and not rope.get("mscale"):
            raise ConfigError(f"{path}: yarn with mscale_all_dim but no mscale is not supported")
        if not rope.get("mscale_all_dim"):
            yarn.update(mscale=1.0, mscale_all_dim=0.0)
        return {"factor": float(factor), **{k: float(v) for k, v in yarn.items()}}

    def read_moe(self, hf: Any, path: Path) -> dict[str, Any]:
        # DeepSeek's own config.json names its router (what SGLang reads; transformers assumes it).
        own = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
        for key, value in own.items():
            if getattr(hf, key, value) != value:
                raise ConfigError(f"{path}: {key}={getattr(hf, key)!r} is not supported "
                                  f"({value!r}, DeepSeek-V3's, only)")  # fmt: skip
        if not hf.norm_topk_prob and hf.num_experts_per_tok > 1:
            raise ConfigError(
                f"{path}: norm_topk_prob=false is not supported (megatron-core's sigmoid router "
                "renormalises the top-k weights)"
            )
        groups, group_topk = hf.n_group or 1, hf.topk_group or 1
        if group_topk >= groups:
            groups = group_topk = 1  # every group chosen: plain top-k
        uneven = hf.n_routed_experts % groups or hf.num_experts_per_tok != 2 * group_topk
        if groups > 1 and uneven:
            raise ConfigError(
                f"{path}: n_group={groups} with topk_group={group_topk} and "
                f"num_experts_per_tok={hf.num_experts_per_tok} is not supported: transformers "
                "scores a group by its best 2 experts, megatron-core by its best "
                "num_experts_per_tok / topk_group (equal when that is 2, as in DeepSeek-V3)"
            )
        if not 0 <= hf.first_k_dense_replace < hf.num_hidden_layers:
            raise ConfigError(f"{path}: first_k_dense_replace leaves no MoE layer")
        return {
            "num_experts": hf.n_routed_experts,
            "moe_topk": hf.num_experts_per_tok,
            "moe_ffn_hidden_size": hf.moe_intermediate_size,
            "norm_topk_prob": True,
            "moe_shared_ffn_hidden_size": hf.moe_intermediate_size * (hf.n_shared_experts or 0),
            "moe_router_bias": True,
            "moe_scaling_factor": float(hf.routed_scaling_factor),
            "moe_groups": groups,
            "moe_group_topk": group_topk,
            "dense_layers": hf.first_k_dense_replace,
        }

    # --- megatron-core ----------------------------------------------------------------------

    def megatron_config_class(self) -> type:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig

    def megatron_config(self, arch: ModelArch) -> dict[str, Any]:
        latent = arch.latent
        assert latent is not None
        yarn = latent.rope_scaling
        rope: dict[str, Any] = {"rope_type": "rope", "mscale": 1.0, "mscale_all_dim": 0.0}
        if yarn is not None:
            rope = {"rope_type": "yarn", "rotary_scaling_factor": yarn["factor"],
                    "original_max_position_embeddings":
                        int(yarn["original_max_position_embeddings"]),
                    "beta_fast": yarn["beta_fast"], "beta_slow": yarn["beta_slow"],
                    "mscale": yarn["mscale"], "mscale_all_dim": yarn["mscale_all_dim"]}  # fmt: skip
        grouped = arch.moe_groups > 1
        return {
            "multi_latent_attention": True,
            "q_lora_rank": latent.q_lora_rank,
            "kv_lora_rank": latent.kv_lora_rank,
            "qk_head_dim": latent.qk_nope_head_dim,
            "qk_pos_emb_head_dim": latent.qk_rope_head_dim,
            "v_head_dim": latent.v_head_dim,
            "rotary_base": arch.rope_theta,
            **rope,
            **sigmoid_router_moe(arch),
            "moe_router_num_groups": arch.moe_groups if grouped else None,
            "moe_router_group_topk": arch.moe_group_topk if grouped else None,
        }

    def layer_spec(self, arch: ModelArch, config: Any) -> Any:
        """A block spec: dense first layers, MoE ones after, every one's attention MLA with
        megatron's local core attention (`_core_attention`) and its down projections whole on
        every tensor-parallel rank, as TransformerEngine's spec has them. (The local spec splits
        them over the ranks and gathers their outputs, and then each rank's gradient of the
        shared rotary key holds its own heads' part alone: under TP=2 the first step's gradient
        norm was 7e-5 off one process's.)"""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        from megatron.core.post_training.modelopt.layers import Linear
        from megatron.core.transformer.identity_op import IdentityOp

        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                           normalization="RMSNorm")  # fmt: skip
        for layer in block.layer_specs:
            attention = layer.submodules.self_attention.submodules
            attention.core_attention = _core_attention()
            # A plain linear on the sequence-parallel shard, its gradient summed over the TP
            # group (it tags its weight sequence_parallel); MLA gathers the rotary key.
            attention.linear_q_down_proj = attention.linear_kv_down_proj = Linear
            if config.q_lora_rank is None:
                # No query latent, so no norm of it (megatron-core 0.19 refuses a norm it would
                # not use; 0.16 just leaves it unbuilt).
                attention.q_layernorm = IdentityOp
                layer.submodules.self_attention.module = _full_query_attention()
        return block

    # --- weights ------------------------------------------------------------------------------

    def _attention(self, arch: ModelArch) -> tuple[tuple[str, str], ...]:
        assert arch.latent is not None
        return _LATENT if arch.latent.q_lora_rank else _FULL_Q + _LATENT[3:]

    def layer_to_mcore(
        self, hf: Weights, out: Weights, src: str, dst: str, arch: ModelArch, moe: bool,
        eagle: bool = False, heads: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        from agent_rl.families import layout

        for hf_name, mcore_name in self._attention(arch):
            out[f"{dst}self_attention.{mcore_name}"] = layout.take(hf, f"{src}self_attn.{hf_name}")
        out[dst + "input_layernorm.weight"] = layout.take(hf, src + "input_layernorm.weight")
        layout.ffn_in(hf, out, src, dst, arch, moe)

    def layer_to_hf(
        self, sd: Weights, out: Weights, src: str, dst: str, arch: ModelArch, moe: bool,
        eagle: bool = False, heads: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        from agent_rl.families import layout

        for hf_name, mcore_name in self._attention(arch):
            out[f"{dst}self_attn.{hf_name}"] = sd[f"{src}self_attention.{mcore_name}"]
        out[dst + "input_layernorm.weight"] = sd[src + "input_layernorm.weight"]
        layout.ffn_out(sd, out, src, dst, arch, moe)

    # --- tiny presets -------------------------------------------------------------------------

    def tiny_config(self, preset: Any, common: dict[str, Any]) -> Any:
        from transformers import DeepseekV3Config

        o = preset.options
        rope = dict(common["rope_parameters"])
        if o.get("yarn_factor"):
            rope.update(rope_type="yarn", factor=float(o["yarn_factor"]),
                        original_max_position_embeddings=preset.max_position_embeddings // 4,
                        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)  # fmt: skip
        common = {k: v for k, v in common.items() if k != "head_dim"}  # qk_rope_head_dim's
        return DeepseekV3Config(
            **{**common, "rope_parameters": rope},
            n_routed_experts=preset.num_experts,
            num_experts_per_tok=preset.num_experts_per_tok,
            moe_intermediate_size=preset.moe_intermediate_size,
            n_shared_experts=o.get("n_shared_experts", 1),
            first_k_dense_replace=o.get("first_k_dense_replace", 1),
            routed_scaling_factor=o.get("routed_scaling_factor", 1.0),
            n_group=o.get("n_group", 1),
            topk_group=o.get("topk_group", 1),
            q_lora_rank=o.get("q_lora_rank"),
            kv_lora_rank=o.get("kv_lora_rank", 64),
            qk_nope_head_dim=o.get("qk_nope_head_dim", 32),
            qk_rope_head_dim=o.get("qk_rope_head_dim", 16),
            v_head_dim=o.get("v_head_dim", 32),
            norm_topk_prob=True,
            rope_interleave=True,
            attention_bias=False,
            rms_norm_eps=LATENT_EPS,
            num_nextn_predict_layers=0,
        )

    def tiny_config_json(self, preset: Any, config: dict[str, Any]) -> None:
        # DeepSeek-V3's config.json names its router and MoE layer spacing; transformers drops
        # them (it assumes them), SGLang reads them.
        config.update(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1)
