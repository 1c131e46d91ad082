"""Config of `agent-rl launch`: which roles a run places on a Ray cluster, with what resources,
and how hard it tries to keep them alive (agent_rl/cluster, docs/cluster.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from agent_rl.config.base import Section


class RoleResources(Section):
    """What Ray reserves for each process of one role (the node it lands on must have it free)."""

    cpus: float = Field(default=1.0, ge=0)
    """Ray CPUs per process (scheduling only: Ray does not pin them)."""

    accelerators: float = Field(default=0.0, ge=0)
    """Accelerators per process, counted in `cluster.accelerator`; all of one process's are on
    one node (an engine's: its tensor-parallel size)."""

    resources: dict[str, float] = {}
    """More Ray custom resources per process, e.g. {"cpu_node" = 0.01} to keep serves on the
    nodes started with `ray start --resources '{"cpu_node": 100}'`."""


class ClusterConfig(Section):
    address: str = "auto"
    """Ray cluster to launch on: `auto` (the one `ray start` made on this machine) or its GCS
    address host:port."""

    namespace: str = "agent-rl"
    """Ray namespace of the launch's actors; `agent-rl launch status|logs|stop` find the run's
    launch there by `run.name`."""

    accelerator: str = "GPU"
    """The Ray resource that counts accelerators: GPU (Ray then sets CUDA_VISIBLE_DEVICES for
    each process), or a custom resource name given to `ray start --resources`."""

    engines: int = Field(default=1, ge=0)
    """SGLang engines (`agent-rl engine start`), each added to the router once it answers."""

    engine_resources: RoleResources = RoleResources(cpus=1.0, accelerators=1.0)
    """Per engine; set `accelerators` to the engine's tensor-parallel size (and `--tp N` in
    engine.extra_args)."""

    router_resources: RoleResources = RoleResources(cpus=0.0)
    """The router (`agent-rl router`). It runs on the Ray head node, so its address stays the
    same when it is restarted."""

    router_host: str | None = None
    """Address the router binds and serves and the trainer reach it at; unset: its node's
    address as Ray knows it."""

    serves: int = Field(default=1, ge=0)
    """`agent-rl serve` processes (they coordinate through the store only)."""

    serve_resources: RoleResources = RoleResources(cpus=1.0)
    """Per serve."""

    trainer_ranks: int = Field(default=1, ge=0)
    """Ranks of `agent-rl train`, started together as one gang (torch.distributed rendezvous at
    rank 0's node, as torchrun does); 0: no trainer."""

    trainer_resources: RoleResources = RoleResources(cpus=1.0, accelerators=1.0)
    """Per trainer rank."""

    trainer_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy of the trainer's ranks: PACK fills a node before the next."""

    max_restarts: int = Field(default=10, ge=0)
    """Restarts of one role (the trainer's gang counts as one) before it is left failed, with
    the last reason in `agent-rl launch status`."""

    restart_delay_s: float = Field(default=2.0, ge=0)
    """Pause before a role is started again."""

    log_dir: Path = Path("runs/logs")
    """One log per role process (`ROLE.log`), relative to the working directory, which every
    node must see at the same path (models, exports and checkpoints live there too)."""

    ready_timeout_s: float = Field(default=600.0, gt=0)
    """Seconds a started engine or router may take to answer before it counts as failed."""

    serve_drain_s: float = Field(default=60.0, ge=0)
    """`agent-rl launch stop`: seconds serves get to finish their running episodes."""

    trainer_stop_s: float = Field(default=180.0, ge=0)
    """`agent-rl launch stop`: seconds the trainer gets to finish its step and checkpoint."""
