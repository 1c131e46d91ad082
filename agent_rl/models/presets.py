"""The tiny-model presets: architecture hyper-parameters, light to import (no torch)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

DEFAULT_VOCAB_SIZE = 1024
PresetName = Literal["tiny-dense", "tiny-moe", "quickstart"]
VOCAB_MULTIPLE = 128


class ModelPreset(BaseModel):
    """Architecture of a tiny model; any field can be overridden when calling `init_model`."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    architecture: Literal["qwen2", "qwen3_moe"]
    """HF model family: dense Qwen2 or Qwen3-MoE."""
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
    tokenizer_vocab_size: int = DEFAULT_VOCAB_SIZE
    """Target size of the trained tokenizer; the model's vocab is padded up to a multiple of 128."""


PRESETS: dict[str, ModelPreset] = {
    "tiny-dense": ModelPreset(architecture="qwen2"),
    "tiny-moe": ModelPreset(architecture="qwen3_moe", num_hidden_layers=2),
    # The quickstart's model: about 3x less compute per token than tiny-dense, small enough to
    # learn the calculator task (SFT, then RL) on two CPU cores in minutes. SGLang's CPU path
    # sizes its KV cache by hidden_size / heads, so heads x head_dim must equal hidden_size.
    "quickstart": ModelPreset(
        architecture="qwen2", hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=384,
    ),
}
