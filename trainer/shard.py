"""Cut a full megatron state dict into this rank's TP/EP shard, and gather it back.

The full layout is the one trainer.hf_convert produces (TP=1, EP=1). A parameter that megatron
splits over tensor parallelism carries `tensor_model_parallel=True` and `partition_dim`; we cut
contiguous chunks along that dim, except for SwiGLU `linear_fc1`, whose [gate; up] halves are
each cut and re-stacked (rank r holds [gate_r; up_r]). Experts are numbered locally on each
expert-parallel rank: local expert i of EP rank r is global expert r * E/ep + i; expert weights
use the expert-tensor-parallel group. Everything else is replicated.

`gather_full_state_dict` runs collectives: every rank of the model-parallel groups must call
it, in the same order. It returns the full dict on every rank (fine for the model sizes a
single host exports; a large model would stream per tensor instead).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from agent_rl.errors import ConfigError
from trainer.arch import ModelArch

_LOCAL_EXPERT = re.compile(r"local_experts\.(\d+)\.")


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


def _global_name(name: str, arch: ModelArch) -> str:
    from megatron.core import parallel_state as ps

    local = _expert_index(name)
    if local is None:
        return name
    per_rank = arch.num_experts // ps.get_expert_model_parallel_world_size()
    index = ps.get_expert_model_parallel_rank() * per_rank + local
    return _LOCAL_EXPERT.sub(f"local_experts.{index}.", name, count=1)


def _cut(full: torch.Tensor, dim: int, rank: int, size: int, gated: bool) -> torch.Tensor:
    if gated:
        return torch.cat([h.chunk(size, dim)[rank] for h in full.chunk(2, dim)], dim)
    return full.chunk(size, dim)[rank]


def load_full_state_dict(
    model: torch.nn.Module, full: dict[str, torch.Tensor], arch: ModelArch, keep: str | None = None
) -> None:
    """Copy this rank's shard of `full` into `model`'s parameters; every parameter must be
    covered, except those under the prefix `keep`, which keep their values when `full` has none."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = _global_name(_strip(name), arch)
            if keep is not None and key.startswith(keep) and key not in full:
                continue
            if key not in full:
                raise ConfigError(f"no weight for {key!r}: the weights do not match the model")
            tensor = full[key]
            if getattr(param, "tensor_model_parallel", False):
                _, rank, size = _groups(_expert_index(name) is not None)
                tensor = _cut(
                    tensor, param.partition_dim, rank, size, name.endswith("linear_fc1.weight")
                )
            if tuple(tensor.shape) != tuple(param.shape):
                raise ConfigError(
                    f"{key}: shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}"
                )
            param.copy_(tensor)


def gather_full_state_dict(model: torch.nn.Module, arch: ModelArch) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict, assembled on every rank from the TP/EP shards."""
    from megatron.core import parallel_state as ps

    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            tensor = param.detach().clone()
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
                            f"local_experts.{r * per_rank + local}.", _strip(name), count=1
                        )
                    ] = part
            else:
                out[_strip(name)] = tensor
    return out


def _gather_tp(t: torch.Tensor, dim: int, size: int, group: object, gated: bool) -> torch.Tensor:
    pieces = t.chunk(2, dim) if gated else (t,)
    gathered = []
    for piece in pieces:
        parts = [torch.empty_like(piece) for _ in range(size)]
        dist.all_gather(parts, piece.contiguous(), group=group)
        gathered.append(torch.cat(parts, dim))
    return torch.cat(gathered, dim)


def _strip(name: str) -> str:
    """Parameter name without DDP/Float16Module wrappers' `module.` prefixes."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name
