"""Llama 3.x (`LlamaForCausalLM`): the standard decoder, no biases, Llama 3's rope scaling,
tied (3.2 1B/3B) or untied embeddings.

Llama 3's rope scaling (`rope_type: llama3`) divides the low frequencies by `factor` and blends
the middle band; megatron-core builds it with `factor` free and the other settings fixed at
Llama 3's (`low_freq_factor` 1, `high_freq_factor` 4, `original_max_position_embeddings` 8192),
so a config with other values is refused. Its MTP draft is SGLang's EAGLE one in the export's
`draft/` only (as for Qwen3: the target loads every `layers.*` name). Preset: `tiny-llama`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from agent_rl.families.arch import ModelArch
from agent_rl.families.base import Family, rope_parameters
from agent_rl.kernel.errors import ConfigError

LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # fmt: skip
"""megatron-core's Llama 3 rope scaling, all but the factor (RotaryEmbedding._apply_scaling)."""


class Llama(Family):
    model_type = "llama"
    architecture = "LlamaForCausalLM"
    config_class = "LlamaConfig"
    # Llama 3.2 1B's shape, shrunk: tied embeddings, rope_theta 500000, rope scaling factor 32.
    presets: ClassVar = {
        "tiny-llama": {"tie_word_embeddings": True, "rope_theta": 500000.0,
                       "options": {"rope_scaling_factor": 32.0}},
    }  # fmt: skip
    preset_options = ("rope_scaling_factor",)

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
                f"with {LLAMA3_FIXED} (megatron-core's) and any factor"
            )
        return {"rope_theta": float(rope["rope_theta"]),
                "rope_scaling_factor": float(rope["factor"])}  # fmt: skip

    def gpt_model_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        if arch.rope_scaling_factor is None:
            return {}
        return {"rope_scaling": True, "rope_scaling_factor": arch.rope_scaling_factor}

    def tiny_config(self, preset: Any, common: dict[str, Any]) -> Any:
        from transformers import LlamaConfig

        factor = preset.options.get("rope_scaling_factor")  # None: unscaled rope
        if factor is not None:
            common = {**common, "rope_parameters": {
                **common["rope_parameters"], **LLAMA3_FIXED, "rope_type": "llama3",
                "factor": float(factor),
            }}  # fmt: skip
        return LlamaConfig(**common, attention_bias=False, mlp_bias=False)
