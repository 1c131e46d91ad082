"""Config of the SGLang engine (`agent-rl engine`, or embedded in `serve`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field

from agent_rl.config.base import Section


class EngineConfig(Section):
    model: Path | None = None
    """HF model directory the engine serves (`agent-rl model init DIR` makes a tiny one)."""

    host: str = "127.0.0.1"
    """Address the engine binds; loopback by default."""

    port: int = Field(default=30000, ge=0, le=65535)
    """Port of the engine's HTTP server (0 picks a free one)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """cpu: SGLang's CPU engine with agent-rl's compatibility layer; cuda: stock SGLang; auto:
    cuda when an NVIDIA GPU is visible, else cpu."""

    venv: Path = Field(
        default_factory=lambda: Path(
            os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        ) / "agent-rl" / "engine-venv"
    )
    """The dedicated engine environment made by `agent-rl engine install` (SGLang and its
    pinned torch live there, away from the trainer's environment)."""

    startup_timeout_s: float = Field(default=300.0, gt=0)
    """Seconds to wait for a new engine to answer /health_generate before giving up."""

    moe_routing_replay: bool = False
    """Return the experts each token was routed to (`--enable-return-routed-experts`), for
    routing replay (R3) in the trainer. MoE models only."""

    mem_fraction_static: float | None = Field(default=None, gt=0, le=1)
    """Fraction of device memory for weights and KV cache; unset: 0.05 on CPU, SGLang's
    default on GPU."""

    max_total_tokens: int | None = Field(default=None, ge=1)
    """KV-cache capacity in tokens across all running requests; unset: 16384 on CPU, SGLang's
    default on GPU."""

    max_running_requests: int | None = Field(default=None, ge=1)
    """Most requests decoded at once; unset: SGLang's default."""

    cpu_threads: int = Field(default=1, ge=1)
    """OMP_NUM_THREADS of a CPU engine; 1 decodes ~5x faster than 2 on a 2-core machine shared
    with a trainer (OpenMP threads spin against each other)."""

    log_dir: Path = Path("runs/logs")
    """Where each engine's output goes (`engine-PORT.log`), relative to the working directory."""

    speculative: bool = False
    """Serve the model's own MTP draft (the `mtp.*` weights of a `trainer.mtp.layers` export of
    a Qwen3-MoE model) with SGLang's speculative decoding (EAGLE, top-1 chain). GPU only: on
    CPU the engine refuses to start."""

    speculative_steps: int = Field(default=3, ge=1)
    """Draft tokens proposed per verification pass (SGLang verifies steps + 1 tokens)."""

    extra_args: list[str] = []
    """More `sglang.launch_server` arguments, passed through verbatim."""
