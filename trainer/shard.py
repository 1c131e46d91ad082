"""Cut a full megatron state dict into this rank's TP/PP/EP shard, and gather it back.

The full layout is the one trainer.hf_convert produces (TP=1, PP=1, EP=1). A parameter that
megatron splits over tensor parallelism carries `tensor_model_parallel=True` and
`partition_dim`; we cut contiguous chunks along that dim, except for SwiGLU `linear_fc1`, whose
[gate; up] halves are each cut and re-stacked (rank r holds [gate_r; up_r]). Experts are
numbered locally on each expert-parallel rank: local expert i of EP rank r is global expert
r * E/ep + i; expert weights use the expert-tensor-parallel group. A pipeline stage holds a
slice of the decoder layers, numbered locally from 0 (`decoder.layers.i` is global layer
`layer_number - 1` of its first layer + i), the embedding on the first stage and the final norm
and output layer on the last; with tied embeddings the last stage's output layer is a copy of
the embedding (megatron keeps the two equal), loaded from it and left out of the gather.
Everything else is replicated.

`gather_full_state_dict` runs collectives: every rank must call it, in the same order. It
returns the full dict on every rank (fine for the model sizes a single host exports; a large
model would stream per tensor instead).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, MutableMapping

import torch
import torch.distributed as dist

from agent_rl.kernel.errors import ConfigError
from trainer.arch import ModelArch

_LOCAL_EXPERT = re.compile(r"local_experts\.(\d+)\.")
_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_TIED_COPY = "output_layer.weight"
"""The last pipeline stage's copy of tied embeddings."""


def _expert_index(name: str) -> int | None:
    m = _LOCAL_EXPERT.search(name)
    return int(m.group(1)) if m else None


def _groups(is_expert: bool) -> tuple[object, int, int]:
    from megatron.core import parallel_state as ps

    if is_expert:
        return (
            ps.get_expert_tensor_parallel_group(),
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size(),
        )
    return (
        ps.get_tensor_model_parallel_group(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
    )


def layer_offset(model: torch.nn.Module) -> int:
    """Global index of this pipeline stage's first decoder layer."""
    decoder = getattr(model, "decoder", None)
    layers = getattr(decoder, "layers", None)
    return int(layers[0].layer_number) - 1 if layers else 0


def _stage_name(name: str, offset: int) -> str:
    """A parameter name with the stage's local decoder layer index made global."""
    m = _LOCAL_LAYER.match(name)
    return f"decoder.layers.{offset + int(m.group(1))}.{name[m.end():]}" if m else name


def _global_name(name: str, arch: ModelArch, offset: int = 0) -> str:
    from megatron.core import parallel_state as ps

    name = _stage_name(name, offset)
    local = _expert_index(name)
    if local is None:
        return name
    per_rank = arch.num_experts // ps.get_expert_model_parallel_world_size()
    index = ps.get_expert_model_parallel_rank() * per_rank + local
    return _LOCAL_EXPERT.sub(f"local_experts.{index}.", name, count=1)


def _tied_copy(name: str, arch: ModelArch) -> bool:
    """The last stage's copy of tied embeddings (its own output layer only under PP > 1)."""
    return arch.tied_embeddings and name == _TIED_COPY


def _cut(full: torch.Tensor, dim: int, rank: int, size: int, gated: bool) -> torch.Tensor:
    if gated:
        return torch.cat([h.chunk(size, dim)[rank] for h in full.chunk(2, dim)], dim)
    return full.chunk(size, dim)[rank]


def load_full_state_dict(
    model: torch.nn.Module, full: dict[str, torch.Tensor], arch: ModelArch, keep: str | None = None
) -> None:
    """Copy this rank's shard of `full` into `model`'s parameters; every parameter must be
    covered, except those under the prefix `keep`, which keep their values when `full` has none."""
    sink = ParamSink(model, arch, keep)
    for key in sink.wanted():
        if key in full:
            sink[key] = full[key]
    sink.finish()


class ParamSink(MutableMapping[str, torch.Tensor]):
    """A write-only full state dict: a tensor stored under its megatron name is cut to this
    rank's shard and copied into the parameter(s) it fills at once, so a converter writing into
    it streams (a name this rank has no parameter for is dropped). `finish` then checks that
    every parameter was filled, except those under the prefix `keep`. `adopt`: the tensors put
    in are the sink's (read for it, nobody else holds them), so one that already is the
    parameter's whole value (same shape and dtype, contiguous, one parameter, no TP cut)
    becomes its storage instead of being copied (a tenth of a 1B model's load)."""

    def __init__(
        self, model: torch.nn.Module, arch: ModelArch, keep: str | None = None,
        adopt: bool = False,
    ) -> None:  # fmt: skip
        offset = layer_offset(model)
        self._targets: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for name, param in _weights(model):
            key = _global_name(_strip(name), arch, offset)
            if _tied_copy(key, arch):
                key = "embedding.word_embeddings.weight"
            self._targets.setdefault(key, []).append((name, param))
        self._keep, self._adopt, self._done = keep, adopt, set[str]()

    def wanted(self) -> list[str]:
        """The full names this rank's parameters take, in the model's order."""
        return list(self._targets)

    def __setitem__(self, key: str, tensor: torch.Tensor) -> None:
        targets = self._targets.get(key, ())
        with torch.no_grad():
            if self._adopt and _adoptable(targets, tensor):
                targets[0][1].data = tensor  # no copy: the tensor is the sink's to keep
            else:
                for name, param in targets:
                    _copy_into(name, param, key, tensor)
        if key in self._targets:
            self._done.add(key)

    def finish(self) -> None:
        for key in self._targets:
            if key in self._done or (self._keep is not None and key.startswith(self._keep)):
                continue
            raise ConfigError(f"no weight for {key!r}: the weights do not match the model")

    def __getitem__(self, key: str) -> torch.Tensor:
        raise TypeError(f"ParamSink is write-only ({key!r}): read the model's parameters")

    def __delitem__(self, key: str) -> None:
        raise TypeError(f"ParamSink is write-only ({key!r})")

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._done))

    def __len__(self) -> int:
        return len(self._done)


def _adoptable(targets: list[tuple[str, torch.Tensor]] | tuple, tensor: torch.Tensor) -> bool:
    if len(targets) != 1:
        return False
    name, param = targets[0]
    return (
        (not getattr(param, "tensor_model_parallel", False)
         or _groups(_expert_index(name) is not None)[2] == 1)
        and tensor.dtype == param.dtype
        and tuple(tensor.shape) == tuple(param.shape)
        and tensor.is_contiguous()
        and not tensor.requires_grad
    )


def _copy_into(name: str, param: torch.Tensor, key: str, tensor: torch.Tensor) -> None:
    """Copy this rank's shard of the full `tensor` (megatron name `key`) into `param`."""
    if getattr(param, "tensor_model_parallel", False):
        _, rank, size = _groups(_expert_index(name) is not None)
        tensor = _cut(tensor, param.partition_dim, rank, size, name.endswith("linear_fc1.weight"))
    if tuple(tensor.shape) != tuple(param.shape):
        hint = ""
        if key.startswith("mtp.") and ".mlp." in key:
            hint = ("; the draft's MLP width is trainer.mtp.ffn_hidden_size (the "
                    "weights' draft/config.json gives theirs as intermediate_size)")
        elif key.startswith("mtp.") and ".self_attention." in key:
            hint = ("; the draft's attention heads are trainer.mtp.num_attention_heads "
                    "(the weights' draft/config.json gives theirs as "
                    "num_attention_heads)")
        raise ConfigError(
            f"{key}: shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}{hint}"
        )
    param.copy_(tensor)


def gather_full_state_dict(model: torch.nn.Module, arch: ModelArch, *,
                           copy: bool = True) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict, assembled on every rank from the TP/PP/EP shards.
    `copy=False`: a tensor that needs no gathering is the parameter itself (detached), which
    the next optimizer step changes in place."""
    from megatron.core import parallel_state as ps

    offset = layer_offset(model)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in _weights(model):
            if _tied_copy(_strip(name), arch):
                continue  # the first stage's embedding is the same weight
            tensor = param.detach().clone() if copy else param.detach()
            is_expert = _expert_index(name) is not None
            if getattr(param, "tensor_model_parallel", False):
                group, _, size = _groups(is_expert)
                if size > 1:
                    tensor = _gather_tp(
                        tensor, param.partition_dim, size, group, name.endswith("linear_fc1.weight")
                    )
            if is_expert and ps.get_expert_model_parallel_world_size() > 1:
                group = ps.get_expert_model_parallel_group()
                parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, tensor, group=group)
                per_rank = arch.num_experts // len(parts)
                local = _expert_index(name)
                for r, part in enumerate(parts):
                    out[
                        _LOCAL_EXPERT.sub(
                            f"local_experts.{r * per_rank + local}.",
                            _stage_name(_strip(name), offset),
                            count=1,
                        )
                    ] = part
            else:
                out[_stage_name(_strip(name), offset)] = tensor
    if ps.get_pipeline_model_parallel_world_size() > 1:
        out = _gather_stages(out)
    return out


def _gather_stages(own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every pipeline stage's tensors on every rank of the pipeline group: each stage in turn
    broadcasts its names, shapes and dtypes, then its tensors."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    me = ps.get_pipeline_model_parallel_rank()
    device = next(iter(own.values())).device
    out: dict[str, torch.Tensor] = {}
    for stage, src in enumerate(dist.get_process_group_ranks(group)):
        meta = [[(k, tuple(v.shape), v.dtype) for k, v in own.items()] if stage == me else None]
        dist.broadcast_object_list(meta, src=src, group=group)
        for key, shape, dtype in meta[0]:
            tensor = own[key] if stage == me else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=src, group=group)
            out[key] = tensor
    return out


def _gather_tp(t: torch.Tensor, dim: int, size: int, group: object, gated: bool) -> torch.Tensor:
    pieces = t.chunk(2, dim) if gated else (t,)
    gathered = []
    for piece in pieces:
        parts = [torch.empty_like(piece) for _ in range(size)]
        dist.all_gather(parts, piece.contiguous(), group=group)
        gathered.append(torch.cat(parts, dim))
    return torch.cat(gathered, dim)


_WEIGHT_BUFFERS = (".router.expert_bias",)
"""Buffers that are weights of the model, loaded and exported like parameters: a sigmoid
router's score correction bias (megatron keeps it out of the optimizer, as a buffer)."""


def _weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters, then the buffers that are weights (`_WEIGHT_BUFFERS`)."""
    yield from model.named_parameters()
    for name, buffer in model.named_buffers():
        if name.endswith(_WEIGHT_BUFFERS):
            yield name, buffer


def _strip(name: str) -> str:
    """Parameter name without DDP/Float16Module wrappers' `module.` prefixes."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name
