"""What an HF model directory says about the network: `ModelArch`, read by the model's family.

`ModelArch.from_hf_dir` reads config.json through transformers' AutoConfig (which resolves
aliases such as `rope_parameters.rope_theta` and `num_local_experts`) and hands it to the family
its `model_type` names (agent_rl.families.registry), which refuses what we could not map
exactly. Light to import: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_rl.kernel.errors import ConfigError


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (MLA): queries through a low-rank projection (or a full one),
    keys and values from one shared latent, each head's query/key a part without position
    (`qk_nope_head_dim`) and a rotary part (`qk_rope_head_dim`, the key's shared by all heads)."""

    q_lora_rank: int | None
    """The queries' low rank (None: a full query projection)."""
    kv_lora_rank: int
    """The shared key/value latent's width."""
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_scaling: dict[str, float] | None = None
    """YaRN's settings (`factor`, `original_max_position_embeddings`, `beta_fast`, `beta_slow`,
    `mscale`, `mscale_all_dim`); None: plain rotary embeddings."""


@dataclass(frozen=True)
class ModelArch:
    """What the HF config says about the network, in the terms the converter needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rope_theta: float
    rms_eps: float
    max_positions: int
    qkv_bias: bool
    qk_norm: bool
    tied_embeddings: bool
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = True
    rope_scaling_factor: float | None = None
    """Llama 3's rope scaling factor (its low/high frequency factors are megatron's fixed 1
    and 4); None: unscaled rotary embeddings."""
    rope_original_context: int = 8192
    """Llama 3's rope scaling: the context the model was pre-trained at (its
    `original_max_position_embeddings`), whose wavelengths mark the frequency bands."""
    rotary_percent: float = 1.0
    """The share of each head's dims the rotary embedding turns (the first ones)."""
    dense_layers: int = 0
    """MoE models: how many first layers have a dense MLP (`ffn_hidden_size` wide) instead."""
    moe_shared_ffn_hidden_size: int = 0
    """MoE models: width of the shared experts' MLP beside the routed ones (0: none)."""
    moe_router_bias: bool = False
    """MoE models: whether the router has a score correction bias (`mlp.gate.
    e_score_correction_bias`, megatron's `router.expert_bias`)."""
    moe_scaling_factor: float | None = None
    """MoE models: the factor the routed experts' weights are scaled by (None: 1)."""
    moe_groups: int = 1
    """MoE models: the expert groups of group-limited routing (1: none)."""
    moe_group_topk: int = 1
    """MoE models: the groups each token's experts are chosen from (group-limited routing)."""
    latent: LatentAttention | None = None
    """Multi-head latent attention's shape (DeepSeek-V2/V3), where the model has it instead of
    grouped-query attention (`head_dim` is then its value head, the width of each head's
    attention output)."""
    has_draft: bool = True
    """Whether an MTP draft (`trainer.mtp.layers`) can be built, served and exported for it."""
    eagle_draft: bool = True
    """Whether the MTP draft (`trainer.mtp.layers`) takes the EAGLE layout SGLang serves for a
    dense model (`Qwen2ForCausalLMEagle`: no norms around the draft's projection or after its
    layer, the layer without its input norm or a q/k norm) rather than the MTP one SGLang
    serves from the model's own directory (`Family.mtp_draft_architecture`)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        """The layers with routed experts (each reports its experts for routing replay)."""
        return self.num_layers - self.dense_layers if self.is_moe else 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) routes to experts."""
        return self.is_moe and layer >= self.dense_layers

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelArch:
        """Read `path/config.json` through its family; raise ConfigError naming the problem if
        we cannot map it."""
        from agent_rl.families.registry import get

        hf, kind = read_hf_config(path)
        return get(kind, where=f"{path}: ").read_config(hf, Path(path))


def read_hf_config(path: str | Path) -> tuple[Any, str]:
    """transformers' config of `path` (AutoConfig resolves aliases such as
    `rope_parameters.rope_theta` and `num_local_experts`) and its `model_type`."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not a HuggingFace model directory (no config.json)")
    try:
        hf = AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises many types for a bad config; all mean the same
        reason = " ".join(str(e).split())
        raise ConfigError(f"{path}/config.json is not a valid model config: {reason}") from e
    return hf, hf.model_type
