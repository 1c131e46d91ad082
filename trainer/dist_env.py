"""Process group and megatron parallel state for the trainer.

Launched by torchrun, the usual RANK/WORLD_SIZE/MASTER_* variables describe the job; launched
as a plain process, we become a world of one on a free loopback port. The backend is gloo on
CPU and nccl on GPU. `init` is idempotent within a process, and `teardown` undoes it so tests
can rebuild with other parallel sizes.
"""

from __future__ import annotations

import gc
import os
import socket

import torch
import torch.distributed as dist

from agent_rl.kernel.errors import ConfigError
from trainer import megatron_cpu
from trainer.arch import Parallel


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init(par: Parallel, seed: int = 0) -> None:
    """Initialise torch.distributed (if needed) and megatron's TP/PP/EP groups for `par`."""
    megatron_cpu.apply()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend)
        else:
            # Not under torchrun: a world of one on a fresh loopback port; the environment is
            # left alone so child processes (torchrun) do not inherit a fake RANK.
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
            )
    world = dist.get_world_size()
    if world % (par.tp * par.pp) or world % (par.ep * par.pp):
        raise ConfigError(
            f"world size {world} is not divisible by tp*pp={par.tp * par.pp} "
            f"and ep*pp={par.ep * par.pp}"
        )
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        expert_model_parallel_size=par.ep,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def teardown() -> None:
    """Destroy megatron's groups and the process group (tests; clean shutdown)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    # What destroy_model_parallel leaves holding a group (megatron-core 0.16: the intra-partial
    # data-parallel groups; the rotary embedding's cached forward keeps its module, and so its
    # context-parallel group): a group lives, with its gloo threads, while anything holds it.
    for name, value in list(vars(ps).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(ps, name, None)
    getattr(RotaryEmbedding.forward, "cache_clear", lambda: None)()
    if dist.is_initialized():
        dist.destroy_process_group()
    # A group's threads stop when its last reference goes; models hold theirs in cycles.
    gc.collect()
