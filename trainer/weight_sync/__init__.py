"""How the trainer's new weights reach the engines: one mode per file, chosen here.

`trainer.weight_sync.mode` names the mode; `make_sync` builds it over a client of the router (rank 0
only). Every mode is a `WeightSync` (base.py: `push` after a step, `exported` after an export,
`load` to bring lagging engines back, `close`):

| mode | file | how |
|---|---|---|
| `disk` | disk.py | every engine loads each HF export through the router |
| `distributed` | distributed.py | a broadcast over one process group of trainer and engines |
| `tensor` | tensor.py | buckets in this host's shared memory |

The two in-memory modes share their sequence (pause, buckets, resume, drop a failed engine) in
memory.py. A new mode is a `WeightSync` subclass in a file of its own, a `Literal` value of
`trainer.weight_sync.mode` (agent_rl/config/trainer.py) and one entry in `MODES`.
"""

from __future__ import annotations

from agent_rl.config import Config
from agent_rl.config.trainer import WeightSyncConfig
from agent_rl.sglang.client import EngineClient
from trainer.weight_sync.base import PushReport, WeightSync
from trainer.weight_sync.disk import DiskSync
from trainer.weight_sync.distributed import Broadcast
from trainer.weight_sync.tensor import SharedMemory

__all__ = ["MODES", "PushReport", "WeightSync", "make_sync", "router_url"]

MODES: dict[str, type[WeightSync]] = {
    "disk": DiskSync,
    "distributed": Broadcast,
    "tensor": SharedMemory,
}
"""`trainer.weight_sync.mode` -> the class that syncs that way."""


def make_sync(router: EngineClient, cfg: WeightSyncConfig) -> WeightSync:
    """The sync `cfg.mode` names, through `router` (which the caller keeps and closes)."""
    return MODES[cfg.mode](router, cfg)


def router_url(cfg: Config, override: str | None = None) -> str | None:
    """The router (or SGLang server) the trainer syncs weights through: `override` (the
    `--router-url` option), else `trainer.weight_sync.router_url`, else `rollout.router_url`;
    None: the weights are exported but reach no engine."""
    return override or cfg.trainer.weight_sync.router_url or cfg.rollout.router_url
