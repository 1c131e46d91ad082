"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention, every layer's MLP routed experts.

The router is a softmax over all experts, top-k, renormalised iff `norm_topk_prob`; megatron
without pre-softmax takes the top-k logits then a softmax, the same as renormalised
probabilities. Mixed dense/MoE layers (`mlp_only_layers`, `decoder_sparse_step`) are refused.
Its MTP draft is the model's own `mtp.*` weights, served by SGLang as `Qwen3MoeForCausalLMMTP`
from the target's directory. Preset: `tiny-moe`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from agent_rl.families.arch import ModelArch
from agent_rl.families.base import Family
from agent_rl.kernel.errors import ConfigError


class Qwen3Moe(Family):
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    config_class = "Qwen3MoeConfig"
    qk_norm = True
    draft = "mtp"
    mtp_draft_architecture = "Qwen3MoeForCausalLMMTP"
    presets: ClassVar = {"tiny-moe": {"num_hidden_layers": 2}}

    def read_moe(self, hf: Any, path: Path) -> dict[str, Any]:
        if hf.mlp_only_layers or hf.decoder_sparse_step != 1:
            raise ConfigError(f"{path}: mixed dense/MoE layers are not supported")
        return {
            "num_experts": hf.num_experts,
            "moe_topk": hf.num_experts_per_tok,
            "moe_ffn_hidden_size": hf.moe_intermediate_size,
            "norm_topk_prob": bool(hf.norm_topk_prob),
        }

    def megatron_config(self, arch: ModelArch) -> dict[str, Any]:
        return {
            "num_moe_experts": arch.num_experts,
            "moe_router_topk": arch.moe_topk,
            "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
            # HF: softmax over all experts, top-k, renormalise iff norm_topk_prob. Megatron without
            # pre-softmax takes top-k logits then softmax: the same as renormalised probabilities.
            "moe_router_pre_softmax": not arch.norm_topk_prob,
            "moe_router_score_function": "softmax",
            "moe_router_dtype": "fp32",
            "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0,
            "moe_grouped_gemm": False,
            # The replay hook is inert until a replay action is set (trainer.routing_replay).
            "moe_enable_routing_replay": True,
        }

    def tiny_config(self, preset: Any, common: dict[str, Any]) -> Any:
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common,
            num_experts=preset.num_experts,
            num_experts_per_tok=preset.num_experts_per_tok,
            moe_intermediate_size=preset.moe_intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )

    def tiny_config_json(self, preset: Any, config: dict[str, Any]) -> None:
        # transformers 5.2x writes `num_local_experts`; SGLang and converters read `num_experts`.
        config["num_experts"] = preset.num_experts
