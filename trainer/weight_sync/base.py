"""The weight-sync contract: how the engines behind the router get each new policy version.

One `WeightSync` subclass per `trainer.weight_sync.mode` (disk.py, distributed.py, tensor.py),
chosen in one place (`trainer.weight_sync.MODES`). The loop (trainer/loop.py) calls it at two
moments of a step, on rank 0 only:

- `push(weights, version)` after every step, for the modes that send the trainer's weights
  from memory (`in_memory`; every rank gathers the weights first, a collective);
- `exported(export, version)` after every `export_every` steps' HF export: the disk mode's
  engines load it; an in-memory mode names it to the router as the weights a returning engine
  loads before it serves.

While it waits for data, the loop brings engines that serve an older version back with `push`
(in memory, one rank) or `load` (the newest export, any mode). Failures are `EngineError`s and
`PushReport`s: the loop logs them, counts failed pushes, and trains on.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from agent_rl.config.trainer import WeightSyncConfig
from agent_rl.kernel.encoding import version_label
from agent_rl.sglang.client import EngineClient


@dataclass
class Receiver:
    """One engine of the fleet as a push addresses it: its URL, the ranks it receives on (its
    TP size) and the client that calls it."""

    url: str
    tp_size: int = 1
    client: EngineClient | None = field(default=None, repr=False)


@dataclass
class PushReport:
    """What one push did: the engines that took the version, the ones dropped (url: why)."""

    version: int
    seconds: float = 0.0
    paused_s: float = 0.0
    """From pausing the engines (`/begin_weight_update`) until they serve again."""
    updated: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    buckets: int = 0

    @property
    def ok(self) -> bool:
        return bool(self.updated) and not self.dropped


class WeightSync(abc.ABC):
    """One way new weights reach the engines behind `router` (see the module docstring)."""

    in_memory: ClassVar[bool] = False
    """True: `push` sends the trainer's weights after every step; False: the engines load the
    exports (`exported`) and nothing is pushed."""

    def __init__(self, router: EngineClient, cfg: WeightSyncConfig) -> None:
        self.router = router
        self.cfg = cfg

    async def push(self, weights: dict[str, torch.Tensor], version: int) -> PushReport:
        """Every engine in rotation serves `weights` (HF names) as `version`, or is reported
        dropped; EngineError when none could be reached. Only where `in_memory`."""
        raise NotImplementedError(f"{type(self).__name__} syncs through exports: it pushes nothing")

    @abc.abstractmethod
    async def exported(self, export: Path, version: int) -> bool:
        """The HF export of `version` is written at `export`: what the engines do with it.
        True when they loaded it (the step's sync, timed as one); EngineError if they failed."""

    async def load(self, export: Path, version: int) -> None:
        """Every engine behind the router loads `export` from disk as `version`: the disk mode's
        sync, and any mode's way back to the newest export for engines that lag."""
        await self.router.update_weights_from_disk(export, weight_version=version_label(version))

    async def close(self) -> None:
        """Free what the sync holds (clients, process groups, buffers); not the router client."""
