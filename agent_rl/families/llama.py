"""Llama 3.x (`LlamaForCausalLM`): the standard decoder, no biases, Llama 3's rope scaling,
tied (3.2 1B/3B) or untied embeddings.

Llama 3's rope scaling (`rope_type: llama3`) divides the frequencies whose wavelength exceeds
the pre-training context (`original_max_position_embeddings`) by `factor` and blends those of
the band below it. megatron-core builds it with `factor` free and the rest fixed at Llama 3's
(`low_freq_factor` 1, `high_freq_factor` 4, original context 8192); another original context
is applied to the built model (`finish_model`, with megatron's own formula), other frequency
factors are refused. Its MTP draft is SGLang's EAGLE one in the export's `draft/` only (as for
Qwen3: the target loads every `layers.*` name). Preset: `tiny-llama` (untied, default rope;
the preset options `rope_scaling_factor` and `rope_original_context` give Llama 3's scaling).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from agent_rl.families.arch import ModelArch
from agent_rl.families.base import Family, rope_parameters
from agent_rl.kernel.errors import ConfigError

LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
"""megatron-core's Llama 3 rope scaling, but for the factor and the original context
(RotaryEmbedding._apply_scaling)."""
MEGATRON_ORIGINAL_CONTEXT = 8192
"""The original context megatron-core's GPTModel builds Llama 3's scaling with."""


class Llama(Family):
    model_type = "llama"
    architecture = "LlamaForCausalLM"
    config_class = "LlamaConfig"
    # Untied embeddings (Llama 3.1 8B's choice) and theta 1e4 with the default rope: the
    # variant of the SFT-only checks at the quickstart's size that once scored 0.254 after SFT,
    # where Llama 3.2's tied embeddings or Llama 3's rope scaling (factor 8 from an original
    # context of 512) stayed near 0.03 (docs/trainer.md, "Quickstart-sized RL runs per
    # family", which also says how far that 0.254 reproduced). Both stay under test as
    # variants (`init_model(..., tie_word_embeddings=True, options={"rope_scaling_factor":
    # ..., "rope_original_context": ...})`).
    presets: ClassVar = {
        "tiny-llama": {"tie_word_embeddings": False, "rope_theta": 10000.0},
    }  # fmt: skip
    preset_options = ("rope_scaling_factor", "rope_original_context")

    def read_config(self, hf: Any, path: Path) -> ModelArch:
        if getattr(hf, "mlp_bias", False):
            raise ConfigError(f"{path}: mlp_bias=true is not supported")
        return super().read_config(hf, path)

    def read_rope(self, hf: Any, path: Path) -> dict[str, Any]:
        rope = rope_parameters(hf)
        kind = rope.get("rope_type", "default")
        if kind == "default":
            return super().read_rope(hf, path)
        fixed = {k: float(rope.get(k, v)) for k, v in LLAMA3_FIXED.items()}
        if kind != "llama3" or fixed != LLAMA3_FIXED or rope.get("rope_theta") is None:
            raise ConfigError(
                f"{path}: rope {kind!r} with {fixed} is not supported: default rope, or llama3 "
                f"with {LLAMA3_FIXED} (megatron-core's), any factor and original context"
            )
        original = rope.get("original_max_position_embeddings", MEGATRON_ORIGINAL_CONTEXT)
        return {"rope_theta": float(rope["rope_theta"]),
                "rope_scaling_factor": float(rope["factor"]),
                "rope_original_context": int(original)}  # fmt: skip

    def gpt_model_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        if arch.rope_scaling_factor is None:
            return {}
        return {"rope_scaling": True, "rope_scaling_factor": arch.rope_scaling_factor}

    def finish_model(self, model: Any, arch: ModelArch) -> None:
        """Llama 3's scaling with the model's original context, where it is not the one
        megatron-core's constructor scaled by."""
        if arch.rope_scaling_factor is None or arch.rope_original_context == MEGATRON_ORIGINAL_CONTEXT:
            return
        rope = model.rotary_pos_emb
        import torch

        dims = torch.arange(0, arch.head_dim, 2, dtype=torch.float32, device=rope.inv_freq.device)
        unscaled = 1.0 / (arch.rope_theta ** (dims / arch.head_dim))
        rope.inv_freq = rope._apply_scaling(
            unscaled, factor=arch.rope_scaling_factor, **LLAMA3_FIXED,
            original_max_position_embeddings=arch.rope_original_context)  # fmt: skip

    def tiny_config(self, preset: Any, common: dict[str, Any]) -> Any:
        from transformers import LlamaConfig

        factor = preset.options.get("rope_scaling_factor")  # None: unscaled rope
        if factor is not None:
            original = preset.options.get("rope_original_context", MEGATRON_ORIGINAL_CONTEXT)
            common = {**common, "rope_parameters": {
                **common["rope_parameters"], **LLAMA3_FIXED, "rope_type": "llama3",
                "factor": float(factor), "original_max_position_embeddings": int(original),
            }}  # fmt: skip
        return LlamaConfig(**common, attention_bias=False, mlp_bias=False)
