"""The policy model: a megatron-core GPTModel for a HuggingFace model of a known family.

`transformer_config` turns an arch plus parallel sizes into megatron's TransformerConfig;
`build_gpt_model` builds the model with the local layer spec (no TransformerEngine needed); the
learner fills it from the HF safetensors (`trainer.hf_convert`, `trainer.shard`). Numerics follow
the HF reference: RMSNorm, SwiGLU, rotary embeddings with `rotary_base = rope_theta`, GQA, and
what the arch turns on (q/k/v bias, per-head q/k RMSNorm, routed experts); the rest is the
family's (`Family.megatron_config`: a router's settings; `Family.gpt_model_kwargs`: rope
scaling; `Family.finish_model`: what megatron's constructor fixes; agent_rl.families).
Parallel state (TP/PP/EP) must be initialised before `build_gpt_model`; with PP > 1 each rank
builds its pipeline stage's layers (megatron numbers them globally, `layer_number`), the
embedding on the first stage and the final norm and output layer on the last.
"""

from __future__ import annotations

import torch

from agent_rl import families
from trainer import megatron_cpu
from trainer.arch import ModelArch, Parallel, check_parallel


def transformer_config(
    arch: ModelArch, par: Parallel, dtype: torch.dtype = torch.float32, mtp_layers: int = 0,
    initialize: bool = True,
):
    """megatron TransformerConfig matching the HF model; fusions off (they need CUDA kernels).
    `initialize` False: megatron leaves the weights as allocated (`perform_initialization`)."""
    family = families.get(arch.model_type)
    check_parallel(arch, par, mtp_layers)
    return family.megatron_config_class()(
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
        perform_initialization=initialize,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        # Stages tell each other the shape of each micro-batch's activations: packed rows and a
        # step's last padded micro-batch differ from the others.
        variable_seq_lengths=par.pp > 1,
        # The MoE dispatcher (alltoall: the one that takes variable sequence lengths; megatron
        # checks the setting for dense models too).
        moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=par.ep,
        # Megatron requires sequence parallelism for MoE with TP (the dispatcher expects it).
        sequence_parallel=par.tp > 1 and arch.is_moe,
        mtp_num_layers=mtp_layers or None,
        **family.megatron_config(arch),
    )


def build_gpt_model(
    arch: ModelArch,
    par: Parallel,
    dtype: torch.dtype = torch.float32,
    mtp_layers: int = 0,
    mtp_detach: bool = True,
    mtp_ffn_hidden_size: int | None = None,
    mtp_attention_heads: tuple[int, int] | None = None,
    initialize: bool = True,
):
    """A randomly initialised GPTModel for this rank's shard; fill it with `load_hf_weights`.
    `initialize` False: its weights are left as allocated, for a load that fills every one
    (megatron's CPU initialisation builds each weight in fp32 first and casts it: with bf16
    weights, an embedding-sized transient of twice the embedding's bytes, and every page of
    the model touched before the load replaces them).
    With `mtp_layers` k > 0, a `trainer.mtp_model.MTPGPTModel` with k MTP modules, whose forward
    returns the draft logits of each depth beside the logits (a dense model's EAGLE draft with
    its FFN `mtp_ffn_hidden_size` wide and its attention `mtp_attention_heads` (query,
    key/value) heads, if given)."""
    megatron_cpu.apply()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(arch, par, dtype, mtp_layers, initialize)
    if arch.is_moe:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        # Routers register in a process-global list; only this model's may be in it.
        RouterReplay.clear_global_router_replay_instances()
    spec = families.get(arch.model_type).layer_spec(arch, config)
    kwargs = dict(
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_positions,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        share_embeddings_and_output_weights=arch.tied_embeddings,
        parallel_output=True,
        **families.get(arch.model_type).gpt_model_kwargs(arch),
        # This pipeline stage's part: the embedding on the first, the head on the last.
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    if not mtp_layers:
        model = GPTModel(config, spec, **kwargs)
    else:
        from trainer import mtp_model

        model = mtp_model.build(config, spec, mtp_detach, eagle=arch.eagle_draft,
                                ffn_hidden_size=mtp_ffn_hidden_size,
                                attention_heads=mtp_attention_heads, **kwargs)
    families.get(arch.model_type).finish_model(model, arch)
    return model
