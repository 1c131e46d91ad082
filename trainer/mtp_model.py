"""Multi-token prediction (MTP) draft layers trained with the policy (`trainer.mtp.layers`).

megatron-core's MTP block (`transformer/multi_token_prediction.py`) chains k modules after the
decoder: module j takes the previous hidden state at position t (the decoder's, post final norm,
for j = 1) and the embedding of token t+j, and its output, through the shared output layer,
predicts token t+1+j. That is the draft SGLang's Qwen3-MoE MTP model runs (the target's normed
hidden state and the sampled token in, `fc(cat(norm(embed), norm(hidden)))`, one decoder layer,
a norm, the target's head), so the same weights serve as its speculative draft.

GPTModel's own MTP path needs labels and returns a loss; the learner computes its losses from
logits, so `MTPGPTModel` returns `(logits, [hidden states of each depth])` instead, and
`draft_logits` runs the head on a depth's hidden states at the positions the learner scores
(those whose target is a policy token): over every position the draft's head cost about as much
as its decoder layer, for the third or so of positions a step trains it on. With
`detach=True` the MTP modules see the trunk's hidden states, embeddings and output weight
detached: the MTP loss trains the draft only, and the policy's gradients are those of a model
without MTP. The draft's MoE routers route freely (the engine records no draft routing).

trainer.mtp scores the drafts and takes their loss. Imports megatron: import it lazily.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt import GPTModel


class MTPGPTModel(GPTModel):
    """GPTModel whose forward returns `(logits [b, s, V/tp], [k x hidden states [s, b, h]])`
    (the drafts' hidden states in megatron's layout: this rank's chunk of the sequence under
    sequence parallelism), and whose `draft_logits` turns those into logits where asked."""

    mtp_detach: bool = True
    run_drafts: bool = True
    """False: the forward skips the MTP modules and returns no drafts (forwards whose drafts
    would go unused: the learner's logprobs and its KL reference)."""

    def _postprocess(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: Any,
        rotary_pos_emb: Any,
        rotary_pos_cos: Any,
        rotary_pos_sin: Any,
        attention_mask: Any = None,
        packed_seq_params: Any = None,
        sequence_len_offset: Any = None,
        extra_block_kwargs: Any = None,
        inference_context: Any = None,
        padding_mask: Any = None,
        **unused: Any,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # GPTModel.forward passes its keywords by name, and their set grows between megatron-core
        # releases (0.19 adds padding_mask, output_processor, ...): those not used here land in
        # `unused`. padding_mask (0.19+, None unless a caller sets it) goes on to the MTP block.
        if labels is not None or inference_context is not None:
            raise ValueError("MTPGPTModel returns logits only (no labels, no inference context)")
        tied = self.share_embeddings_and_output_weights
        weight = self.shared_embedding_or_output_weight() if tied else None
        if not self.run_drafts:
            logits, _ = self.output_layer(hidden_states, weight=weight)
            return logits.transpose(0, 1).contiguous(), []
        detach = self.mtp_detach
        trunk = hidden_states.detach() if detach else hidden_states

        def embedding(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
            out = self.embedding(input_ids=input_ids, position_ids=position_ids)
            return out.detach() if detach else out

        stacked = self.mtp(
            input_ids=input_ids,
            position_ids=position_ids,
            hidden_states=trunk,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
            embedding=embedding,
            **({} if padding_mask is None else {"padding_mask": padding_mask}),
            **(extra_block_kwargs or {}),
        )
        depths = torch.chunk(stacked, 1 + self.config.mtp_num_layers, dim=0)[1:]
        logits, _ = self.output_layer(hidden_states, weight=weight)
        return logits.transpose(0, 1).contiguous(), list(depths)

    def draft_logits(
        self, hidden: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """A draft's logits [N, V/tp] at (rows[k], positions[k]) of the [b, s] layout, from
        its hidden states as the forward returned them, through the output layer's weight
        (detached with `mtp_detach`), as the output layer would give them there."""
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        # What the (column-parallel) output layer does with its input: under sequence
        # parallelism gather the sequence (grads reduce-scattered back), else pass it on with
        # grads all-reduced over the TP group, each rank holding a slice of the vocabulary.
        if self.config.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
        else:
            hidden = copy_to_tensor_model_parallel_region(hidden)
        tied = self.share_embeddings_and_output_weights
        head = self.shared_embedding_or_output_weight() if tied else self.output_layer.weight
        head = head.detach() if self.mtp_detach else head
        # A half-precision model's outputs reach the learner in fp32 (megatron's Float16Module).
        return torch.nn.functional.linear(hidden[positions, rows].to(head.dtype), head)


def build(
    config: Any,
    spec: Any,
    detach: bool,
    eagle: bool = False,
    ffn_hidden_size: int | None = None,
    attention_heads: tuple[int, int] | None = None,
    **kwargs: Any,
) -> MTPGPTModel:
    """An MTPGPTModel with `config.mtp_num_layers` MTP modules built from the decoder's layer
    spec (`eagle`: in the EAGLE layout, see `eagle_block`, its layers' FFN `ffn_hidden_size`
    wide and their attention `attention_heads` (query, key/value) heads if given); the modules'
    routers are taken out of routing replay."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.transformer.moe.router_replay import RouterReplay

    block = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    if eagle:
        block = eagle_block(block, ffn_hidden_size, attention_heads)
    elif ffn_hidden_size is not None or attention_heads is not None:
        raise ValueError("a draft shape of its own needs the EAGLE layout (a dense model)")
    model = MTPGPTModel(config, spec, mtp_block_spec=block, **kwargs)
    model.mtp_detach = detach
    if detach:
        # Megatron clips by one global grad norm; leaving the drafts' grads out of it (megatron
        # skips `shared` params there) keeps the policy's update exactly what it is without
        # MTP. The clip factor, taken from the policy's grads, still scales the drafts'.
        for param in model.mtp.parameters():
            param.shared = True
    for module in model.mtp.modules():
        replay = getattr(module, "router_replay", None)
        if isinstance(replay, RouterReplay):
            RouterReplay.global_router_replay_instances.remove(replay)
            module.router_replay = None
    return model


def eagle_block(
    block: Any, ffn_hidden_size: int | None = None, attention_heads: tuple[int, int] | None = None
) -> Any:
    """The MTP block spec `block` in the layout of SGLang's EAGLE draft for dense Qwen2/Qwen3
    (`Qwen2ForCausalLMEagle`): `fc(cat(embedding, hidden))` with no norm on either input, one
    decoder layer without its input norm (and without a q/k norm: the draft is a Qwen2 layer),
    and no norm before the shared head. Every norm it drops becomes megatron's IdentityOp, so
    the module computes what that draft computes and exports to it weight for weight.
    `ffn_hidden_size`: the layer's MLP that wide (`trainer.mtp.ffn_hidden_size`), and
    `attention_heads`: its attention with these (query, key/value) heads, each the trunk's
    head_dim wide (`trainer.mtp.num_attention_heads`, `trainer.arch.draft_heads`), not the
    trunk's: the EAGLE draft has a config of its own, which says so."""
    import dataclasses

    from megatron.core.transformer.identity_op import IdentityOp

    from trainer import megatron_cpu

    layer_field = megatron_cpu.mtp_decoder_layer()
    specs = []
    for spec in block.layer_specs:
        layer = getattr(spec.submodules, layer_field)
        attention = layer.submodules.self_attention
        attention = dataclasses.replace(attention, submodules=dataclasses.replace(
            attention.submodules, q_layernorm=IdentityOp, k_layernorm=IdentityOp))
        layer = dataclasses.replace(layer, submodules=dataclasses.replace(
            layer.submodules, input_layernorm=IdentityOp, self_attention=attention))
        own: dict[str, int] = {}
        if ffn_hidden_size is not None:
            own["ffn_hidden_size"] = ffn_hidden_size
        if attention_heads is not None:
            own["num_attention_heads"], own["num_query_groups"] = attention_heads
        if own:
            layer = dataclasses.replace(layer, module=_own_shape(layer.module, own))
        submodules = dataclasses.replace(spec.submodules, enorm=IdentityOp, hnorm=IdentityOp,
                                         layer_norm=IdentityOp, **{layer_field: layer})
        specs.append(dataclasses.replace(spec, submodules=submodules))
    return dataclasses.replace(block, layer_specs=specs)


def _own_shape(layer: type, own: dict[str, int]) -> type:
    """The transformer layer class `layer`, built with the config fields `own` (its MLP's
    width, its attention's heads) in place of the model's: megatron builds an MTP module's
    layer from the model's config, and the layer's MLP and attention read their shapes there."""
    import copy

    class DraftLayer(layer):  # type: ignore[misc, valid-type]
        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            config = copy.copy(config)  # not dataclasses.replace: no second __post_init__
            for name, value in own.items():
                setattr(config, name, value)
            super().__init__(config, *args, **kwargs)

    return DraftLayer
