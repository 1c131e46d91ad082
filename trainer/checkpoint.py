"""Checkpoints: model + optimizer + step as megatron dist_checkpointing directories.

`save` writes `directory/step_N` through `step_N.tmp`, renamed once complete, so a checkpoint
directory exists only whole; `latest_checkpoint` finds the newest one; `load` restores a
learner's model, optimizer and step from one. Every rank calls `save` and `load` (they run
collectives). The optimizer state is saved "dp_reshardable": it loads under another DP size
with the same TP/PP/EP.

`dist_checkpointing.save` collects its writers' results through a queue from a
`multiprocessing` manager that megatron starts ("spawn") on the first save and never stops
(megatron.core.dist_checkpointing.strategies.filesystem_async). A trainer that exits normally
shuts it down; a SIGKILLed one (a preempted job, a test killing a rank) would leave it running
forever, an orphan holding a fresh interpreter's worth of memory (~290 MB seen). So before the
first save, megatron gets a queue from a manager of ours whose server process watches its
parent and exits once that is gone. Spawning means a script that saves must guard its entry
point with `if __name__ == "__main__"`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import threading
import time
from multiprocessing.managers import SyncManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agent_rl.kernel.errors import ConfigError

WATCH_INTERVAL_S = 1.0

_manager: SyncManager | None = None


def save(module: torch.nn.Module, optimizer: Any, step: int, directory: str | Path,
         keep: int | None = None) -> Path:
    """Write `module`, `optimizer` and `step` into `directory/step_N`; return that path. With
    `keep`, only the newest `keep` checkpoints stay once it is complete (`prune`)."""
    from megatron.core import dist_checkpointing

    final = Path(directory) / f"step_{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    _install_results_queue()
    dist_checkpointing.save(_sharded_state(module, optimizer, step), str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        if keep is not None:
            prune(directory, keep)
    dist.barrier()
    return final


def prune(directory: str | Path, keep: int) -> list[Path]:
    """Delete every complete checkpoint under `directory` but the newest `keep`; return those
    deleted. Each is first renamed `step_N.tmp`, so one half deleted (a crash meanwhile) is
    never taken for a checkpoint; such leftovers older than the newest checkpoint (of a deletion
    or a save cut short) go too. Only right after a save, where no other save is under way."""
    if keep < 1:
        raise ValueError("keep at least one checkpoint")
    complete = _complete(directory)
    old = complete[:-keep]
    for path in old:
        doomed = path.with_name(path.name + ".tmp")
        shutil.rmtree(doomed, ignore_errors=True)
        path.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    for left in Path(directory).glob("step_*.tmp"):
        if complete and left.name.removesuffix(".tmp") < complete[-1].name:
            shutil.rmtree(left, ignore_errors=True)
    return old


def load(module: torch.nn.Module, optimizer: Any, path: str | Path) -> int:
    """Restore `module` and `optimizer` from a `save` directory; return its step."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"checkpoint {path} does not exist")
    inner = [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    # Hyperparameters are the config's, not the checkpoint's (a resume may change them), and
    # megatron's dp_reshardable load gives every param group the last saved group's: the
    # draft's `mtp_lr` would become the policy's.
    settings = [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
                for o in inner]
    loaded = dist_checkpointing.load(_sharded_state(module, optimizer, 0, loading=True), str(path))
    step = int(loaded["step"])
    with torch.no_grad():  # fp32 main params are views of the (grad-requiring) model params
        module.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        for o, groups in zip(inner, settings):
            for group, kept in zip(o.param_groups, groups):
                group.update(kept)
        # Without Apex/TE, megatron gives every param's Adam state the *same* `step` tensor,
        # which torch's Adam then increments once per param per step, and the distributed
        # optimizer's dp_reshardable load then copies the placeholder state's step (1) into
        # it. Adam took one step per learner step: each param gets its own step tensor.
        for o in inner:
            for state in o.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = torch.full_like(state["step"], float(step))
    return step


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete `step_N` directory under `directory`, if any."""
    steps = _complete(directory)
    return steps[-1] if steps else None


def _complete(directory: str | Path) -> list[Path]:
    """The complete `step_N` directories under `directory`, oldest first."""
    return sorted(
        p for p in Path(directory).glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
    )


def _sharded_state(
    module: torch.nn.Module, optimizer: Any, step: int, loading: bool = False
) -> dict[str, Any]:
    # "dp_reshardable": optimizer state loads under another DP size (same TP/EP). 0.16's
    # default format is rejected by its own saver, and "fully_reshardable" cannot load a
    # torch-Adam state (it drops `step`); model weights alone reshard freely.
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
    if loading:
        # Without Apex/TE, megatron reads Adam's `step` from existing state, so a fresh
        # optimizer needs placeholder state (megatron's own helper) before it can load.
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
                opt._init_optimizer_states_with_dummy_values()
    model_state = module.sharded_state_dict(metadata=metadata)  # type: ignore[operator]
    optimizer_state = optimizer.sharded_state_dict(model_state, is_loading=loading, metadata=metadata)
    return {"model": model_state, "optimizer": optimizer_state, "step": step}


def _install_results_queue() -> None:
    """Give megatron's checkpoint writer a results queue that cannot outlive this process.
    Idempotent; a no-op where megatron keeps no such queue."""
    global _manager
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if _manager is not None or getattr(filesystem_async, "_results_queue", False) is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=_exit_with_parent, initargs=(os.getpid(),))
    _manager = manager
    filesystem_async._results_queue = manager.Queue()


def _exit_with_parent(parent: int) -> None:
    """In the manager's server process: exit once `parent` is gone (adopted by another)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_INTERVAL_S)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
