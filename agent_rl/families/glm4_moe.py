"""GLM-4.5/4.6 (`Glm4MoeForCausalLM`): MoE with a shared expert, a sigmoid router with a score
correction bias, partial rotary embeddings, dense first layers, q/k/v bias, optional q/k norm.

The router: sigmoid scores, the top-k chosen on scores plus `e_score_correction_bias` (one
group: `n_group` > 1 is refused), weighted by the scores without it, renormalised iff
`norm_topk_prob`, times `routed_scaling_factor`. megatron-core's sigmoid router with an expert
bias computes the same and always renormalises (top-k > 1), so `norm_topk_prob = false` is
refused; the bias stays as loaded (`moe_router_bias_update_rate` 0: the engine routes with the
checkpoint's bias). The first `first_k_dense_replace` layers have a dense MLP
(`intermediate_size` wide), the rest the experts plus `n_shared_experts` shared experts of
`moe_intermediate_size` each (one shared MLP, their sum wide). Rotary embeddings cover the
first `partial_rotary_factor` of each head (megatron's `rotary_percent`), half-rotated as in
Llama.

Its native MTP/NextN layers (`num_nextn_predict_layers`, layers `num_hidden_layers` on) are the
MTP draft (`trainer.mtp.layers`: megatron-core's MTP modules, `Family.native_mtp`), served by
SGLang as `Glm4MoeForCausalLMNextN` from the target's directory. Preset: `tiny-glm4-moe`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from agent_rl.families.arch import ModelArch
from agent_rl.families.base import Family, rope_parameters, sigmoid_router_moe
from agent_rl.kernel.errors import ConfigError


class Glm4Moe(Family):
    model_type = "glm4_moe"
    architecture = "Glm4MoeForCausalLM"
    config_class = "Glm4MoeConfig"
    draft = "mtp"
    mtp_draft_architecture = "Glm4MoeForCausalLMNextN"
    native_mtp = True
    presets: ClassVar = {
        "tiny-glm4-moe": {"num_hidden_layers": 3, "options": {
            "first_k_dense_replace": 1, "n_shared_experts": 1, "partial_rotary_factor": 0.5,
            "routed_scaling_factor": 2.5, "use_qk_norm": True,
        }},
    }  # fmt: skip
    preset_options = ("first_k_dense_replace", "n_shared_experts", "partial_rotary_factor",
                      "routed_scaling_factor", "use_qk_norm")  # fmt: skip

    def read_config(self, hf: Any, path: Path) -> ModelArch:
        # q/k/v bias and q/k norm are each model's choice here, where other families fix them.
        return replace(super().read_config(hf, path), qkv_bias=bool(hf.attention_bias),
                       qk_norm=bool(hf.use_qk_norm))  # fmt: skip

    def check_attention_bias(self, hf: Any, path: Path) -> None:
        """GLM's `attention_bias` is a bias on q/k/v only (o_proj has none): supported."""

    def read_rope(self, hf: Any, path: Path) -> dict[str, Any]:
        rope = rope_parameters(hf)
        if rope.get("rope_type", "default") != "default" or rope.get("rope_theta") is None:
            raise ConfigError(f"{path}: only default rotary embeddings with rope_theta are supported")
        partial = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
        return {"rope_theta": float(rope["rope_theta"]), "rotary_percent": float(partial)}

    def read_moe(self, hf: Any, path: Path) -> dict[str, Any]:
        if not hf.norm_topk_prob and hf.num_experts_per_tok > 1:
            raise ConfigError(
                f"{path}: norm_topk_prob=false is not supported (megatron-core's sigmoid router "
                "renormalises the top-k weights)"
            )
        if hf.n_group != 1:
            # GLM-4.5/4.6 route over one group; megatron scores a group by its top
            # (top-k / groups) experts where transformers takes its top 2: unchecked, refused.
            raise ConfigError(f"{path}: n_group={hf.n_group} (group-limited routing) is not supported")
        if not 0 <= hf.first_k_dense_replace < hf.num_hidden_layers:
            raise ConfigError(f"{path}: first_k_dense_replace leaves no MoE layer")
        return {
            "num_experts": hf.n_routed_experts,
            "moe_topk": hf.num_experts_per_tok,
            "moe_ffn_hidden_size": hf.moe_intermediate_size,
            "norm_topk_prob": True,
            "moe_shared_ffn_hidden_size": hf.moe_intermediate_size * hf.n_shared_experts,
            "moe_router_bias": True,
            "moe_scaling_factor": float(hf.routed_scaling_factor),
            "dense_layers": hf.first_k_dense_replace,
        }

    def megatron_config(self, arch: ModelArch) -> dict[str, Any]:
        return sigmoid_router_moe(arch)

    def gpt_model_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        return {"rotary_percent": arch.rotary_percent}

    def layer_spec(self, arch: ModelArch, config: Any) -> Any:
        """A block spec: dense first layers, MoE ones after (megatron's `moe_layer_freq`)."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization="RMSNorm")  # fmt: skip

    def tiny_config(self, preset: Any, common: dict[str, Any]) -> Any:
        from transformers import Glm4MoeConfig

        o = preset.options
        rope = {**common["rope_parameters"],
                "partial_rotary_factor": o.get("partial_rotary_factor", 0.5)}  # fmt: skip
        return Glm4MoeConfig(
            **{**common, "rope_parameters": rope},
            n_routed_experts=preset.num_experts,
            num_experts_per_tok=preset.num_experts_per_tok,
            moe_intermediate_size=preset.moe_intermediate_size,
            n_shared_experts=o.get("n_shared_experts", 1),
            first_k_dense_replace=o.get("first_k_dense_replace", 1),
            routed_scaling_factor=o.get("routed_scaling_factor", 1.0),
            use_qk_norm=o.get("use_qk_norm", False),
            attention_bias=True,
            norm_topk_prob=True,
            n_group=1,
            topk_group=1,
            num_nextn_predict_layers=0,
        )
