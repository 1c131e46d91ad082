"""The tiny-model presets: architecture hyper-parameters, light to import (no torch).

Each family names its own presets (`Family.presets`, agent_rl.families); `PRESETS` gathers them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from agent_rl.families import FAMILIES, all_families, get

DEFAULT_VOCAB_SIZE = 1024
PresetName = str
VOCAB_MULTIPLE = 128


class ModelPreset(BaseModel):
    """Architecture of a tiny model; any field can be overridden when calling `init_model`."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    architecture: str
    """HF model family (its `model_type`, one of agent_rl.families.FAMILIES)."""
    hidden_size: int = 256
    """Width of the residual stream."""
    num_hidden_layers: int = 4
    """Number of decoder layers."""
    num_attention_heads: int = 4
    """Query heads; hidden_size / heads is the head dim unless head_dim is set."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 64
    """Per-head dimension."""
    intermediate_size: int = 512
    """Dense MLP width (and the dense layers of the MoE model)."""
    num_experts: int = 8
    """MoE only: experts per layer."""
    num_experts_per_tok: int = 2
    """MoE only: experts routed per token (top-k)."""
    moe_intermediate_size: int = 128
    """MoE only: width of each expert's MLP."""
    max_position_embeddings: int = 4096
    """Longest sequence (prompt + completion) the model accepts."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    tie_word_embeddings: bool = False
    """Whether the output layer shares the embedding's weights."""
    options: dict[str, Any] = {}
    """Settings of the family's own, read by its `tiny_config` (agent_rl.families; e.g.
    llama's `rope_scaling_factor`)."""
    tokenizer_vocab_size: int = DEFAULT_VOCAB_SIZE
    """Target size of the trained tokenizer; the model's vocab is padded up to a multiple of 128."""


    @field_validator("architecture")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in FAMILIES:
            raise ValueError(f"unknown architecture {value!r}: one of {', '.join(FAMILIES)}")
        return value

    @model_validator(mode="after")
    def _own_options(self) -> ModelPreset:
        known = get(self.architecture).preset_options
        unknown = sorted(set(self.options) - set(known))
        if unknown:
            raise ValueError(f"{self.architecture} takes no options {unknown}; its own: "
                             f"{', '.join(known) or 'none'}")
        return self


PRESETS: dict[str, ModelPreset] = {
    name: ModelPreset(architecture=family.model_type, **fields)
    for family in all_families()
    for name, fields in family.presets.items()
}
