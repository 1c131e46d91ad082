"""The policy model: a megatron-core GPTModel built from a HuggingFace Qwen2/Qwen3/Qwen3-MoE directory.

`ModelArch.from_hf_dir` reads config.json (through transformers' AutoConfig, which resolves
aliases such as `rope_parameters.rope_theta` and `num_local_experts`) into the handful of numbers
the conversion needs, and refuses architectures whose weights we could not map exactly.
`transformer_config` turns an arch plus parallel sizes into megatron's TransformerConfig;
`build_gpt_model` builds the model with the local layer spec (no TransformerEngine needed) and
`load_hf_weights` fills it from the HF safetensors. Numerics follow the HF reference: RMSNorm,
SwiGLU, rotary embeddings with `rotary_base = rope_theta`, GQA, Qwen2's q/k/v bias, Qwen3's
per-head q/k RMSNorm, and Qwen3-MoE's softmax top-k router (renormalised iff `norm_topk_prob`).
Parallel state (TP/PP/EP) must be initialised before `build_gpt_model`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from agent_rl.errors import ConfigError
from trainer import cpu_compat

SUPPORTED = ("qwen2", "qwen3", "qwen3_moe")


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

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelArch:
        """Read `path/config.json`; raise ConfigError naming the problem if we cannot map it."""
        from transformers import AutoConfig

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path} is not a HuggingFace model directory (no config.json)")
        try:
            hf = AutoConfig.from_pretrained(path)
        except Exception as e:  # transformers raises many types for a bad config; all mean the same
            reason = " ".join(str(e).split())
            raise ConfigError(f"{path}/config.json is not a valid model config: {reason}") from e
        kind = hf.model_type
        if kind not in SUPPORTED:
            raise ConfigError(
                f"{path}: model_type {kind!r} is not supported; use one of {SUPPORTED}"
            )
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        rope = getattr(hf, "rope_parameters", None) or {}
        rope_theta = rope.get("rope_theta", getattr(hf, "rope_theta", None))
        if rope.get("rope_type", "default") != "default" or rope_theta is None:
            raise ConfigError(
                f"{path}: only default rotary embeddings with rope_theta are supported"
            )
        if getattr(hf, "use_sliding_window", False):
            raise ConfigError(f"{path}: sliding-window attention is not supported")
        if hf.hidden_act != "silu":
            raise ConfigError(f"{path}: hidden_act {hf.hidden_act!r} is not supported (silu only)")
        if kind != "qwen2" and getattr(hf, "attention_bias", False):
            raise ConfigError(f"{path}: attention_bias=true (bias on o_proj) is not supported")
        moe: dict[str, int | bool] = {}
        if kind == "qwen3_moe":
            if hf.mlp_only_layers or hf.decoder_sparse_step != 1:
                raise ConfigError(f"{path}: mixed dense/MoE layers are not supported")
            moe = {
                "num_experts": hf.num_experts,
                "moe_topk": hf.num_experts_per_tok,
                "moe_ffn_hidden_size": hf.moe_intermediate_size,
                "norm_topk_prob": bool(hf.norm_topk_prob),
            }
        return cls(
            model_type=kind,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=hf.num_key_value_heads,
            head_dim=head_dim,
            ffn_hidden_size=hf.intermediate_size,
            rope_theta=float(rope_theta),
            rms_eps=hf.rms_norm_eps,
            max_positions=hf.max_position_embeddings,
            qkv_bias=kind == "qwen2",
            qk_norm=kind in ("qwen3", "qwen3_moe"),
            tied_embeddings=bool(hf.tie_word_embeddings),
            **moe,  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class Parallel:
    """Model-parallel sizes; data parallelism is whatever the world size leaves."""

    tp: int = 1
    pp: int = 1
    ep: int = 1


def check_parallel(arch: ModelArch, par: Parallel) -> None:
    """Raise ConfigError when the model cannot be split as asked."""
    if par.pp != 1:
        raise ConfigError(
            "pipeline parallel size > 1 is not supported by the trainer yet: set pp=1"
        )
    for what, n in (
        ("attention heads", arch.num_heads),
        ("kv heads", arch.num_kv_heads),
        ("vocab size", arch.vocab_size),
        ("ffn size", arch.ffn_hidden_size),
    ):
        if n % par.tp:
            raise ConfigError(f"tp={par.tp} does not divide the model's {what} ({n})")
    if par.ep > 1 and (not arch.is_moe or arch.num_experts % par.ep):
        raise ConfigError(f"ep={par.ep} needs a MoE model whose expert count it divides")


def transformer_config(arch: ModelArch, par: Parallel, dtype: torch.dtype = torch.float32):
    """megatron TransformerConfig matching the HF model; fusions off (they need CUDA kernels)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_parallel(arch, par)
    moe: dict[str, object] = {}
    if arch.is_moe:
        moe = {
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
            "moe_token_dispatcher_type": "alltoall",
            "moe_grouped_gemm": False,
            # The replay hook is inert until a replay action is set (trainer.replay).
            "moe_enable_routing_replay": True,
        }
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        layernorm_epsilon=arch.rms_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        expert_model_parallel_size=par.ep,
        # Megatron requires sequence parallelism for MoE with TP (the dispatcher expects it).
        sequence_parallel=par.tp > 1 and arch.is_moe,
        **moe,
    )


def build_gpt_model(arch: ModelArch, par: Parallel, dtype: torch.dtype = torch.float32):
    """A randomly initialised GPTModel for this rank's shard; fill it with `load_hf_weights`."""
    cpu_compat.apply()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(arch, par, dtype)
    if arch.is_moe:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        # Routers register in a process-global list; only this model's may be in it.
        RouterReplay.clear_global_router_replay_instances()
    spec = get_gpt_layer_local_spec(
        num_experts=arch.num_experts or None, qk_layernorm=arch.qk_norm, normalization="RMSNorm"
    )
    return GPTModel(
        config,
        spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_positions,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        share_embeddings_and_output_weights=arch.tied_embeddings,
        parallel_output=True,
    )


def load_hf_weights(model: torch.nn.Module, arch: ModelArch, path: str | Path) -> None:
    """Copy the HF safetensors in `path` into this rank's shard of `model` (exactly, no casts
    beyond the model dtype); raise ConfigError if the files do not match the config."""
    from trainer import hf_convert, shard

    full = hf_convert.hf_to_mcore(hf_convert.read_safetensors(path), arch)
    shard.load_full_state_dict(model, full, arch)
