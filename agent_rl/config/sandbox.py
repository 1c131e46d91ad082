"""Config of the sandboxes that run tool calls."""

from __future__ import annotations

from pathlib import Path

from pydantic import ConfigDict, Field, model_validator

from agent_rl.config.base import Section

HEADROOM_MB = 32
"""Memory a sandbox's processes keep however full its tmpfs mounts are (`SandboxLimits`)."""


class SandboxLimits(Section):
    """Resource limits of one sandbox (`agent_rl.sdk.sandbox.Limits` is this class)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    wall_s: float = Field(default=30.0, gt=0)
    """Default wall-clock timeout of one call, seconds; a call may ask for less, never more."""

    cpu_s: int = Field(default=30, ge=1)
    """CPU seconds each process of a call may use (RLIMIT_CPU)."""

    memory_mb: int = Field(default=512, ge=32)
    """Memory of the whole sandbox, swap included, MiB; exceeding it kills the hungriest process."""

    pids: int = Field(default=64, ge=8)
    """Processes and threads alive at once in the sandbox, its persistent worker included."""

    disk_mb: int = Field(default=256, ge=1)
    """Size of the work dir (a tmpfs: it also counts as host memory) and the largest file."""

    tmp_mb: int = Field(default=64, ge=1)
    """Size of the sandbox's private /tmp."""

    output_bytes: int = Field(default=1 << 20, ge=1024)
    """Bytes of stdout and of stderr kept per call; a call that writes more is killed."""

    nofile: int = Field(default=256, ge=16)
    """Open file descriptors per process."""

    cpus: float = Field(default=1.0, gt=0)
    """CPU cores the whole sandbox may use at once (a cgroup CPU quota; not enforced by rlimit)."""

    @model_validator(mode="after")
    def _tmpfs_fits_in_memory(self) -> SandboxLimits:
        """The work dir, /tmp and /dev/shm are tmpfs charged to the sandbox's memory: full, they
        must leave its processes (the worker, a verifier) room to run, or tool code that fills
        them makes every later call, a verifier's included, fail for want of memory."""
        tmpfs = self.disk_mb + 2 * self.tmp_mb
        if tmpfs > self.memory_mb - HEADROOM_MB:
            raise ValueError(
                f"disk_mb ({self.disk_mb}) + 2 x tmp_mb ({self.tmp_mb}, for /tmp and /dev/shm) = "
                f"{tmpfs} MiB of tmpfs, which tool code can fill, leaves less than {HEADROOM_MB} "
                f"MiB of memory_mb ({self.memory_mb}) to the sandbox's processes: lower disk_mb "
                f"or tmp_mb, or raise memory_mb to at least {tmpfs + HEADROOM_MB}")
        return self


class SandboxConfig(Section):
    backend: str = "bwrap"
    """Isolation for tool calls, a name in `tools_sandbox.backends.BACKENDS`: bubblewrap namespaces
    (`bwrap`, default), a Docker container per episode (`docker`), or `rlimit` (rlimits and a uid
    only, NOT isolation; for machines with neither)."""

    limits: SandboxLimits = SandboxLimits()
    """Default limits of every sandbox (an environment may ask for tighter ones)."""

    max_sandboxes: int = Field(default=64, ge=1)
    """Sandboxes alive at once in this process (warm ones included); creation waits beyond it."""

    warm_pool: int = Field(default=0, ge=0)
    """Sandboxes of the env's spec kept started and idle (before the first episode, and replaced
    as episodes take them), so an episode waits for no start-up; never the last free slot."""

    create_concurrency: int = Field(default=4, ge=1)
    """Sandboxes being started at once; more would only queue on the CPU."""

    create_jitter_s: float = Field(default=0.05, ge=0)
    """Random delay up to this before each creation, so a burst of episodes does not start in lockstep."""

    state_dir: Path = Path("/tmp/agent-rl-sandboxes")
    """Host directory for work-dir mounts and worker sockets; the reaper cleans it at start-up."""

    reap_on_start: bool = True
    """Remove sandboxes (processes, cgroups, containers, dirs) left by a crashed server at start-up."""

    python: str = "python3"
    """Python interpreter inside the sandbox (looked up on its PATH) that runs the worker."""

    cgroup_parent: str = "agent-rl"
    """Name of the parent cgroup of all bwrap sandboxes (under each hierarchy's root)."""

    uid_base: int = Field(default=200_000, ge=1000)
    """First host uid given to sandboxes (bwrap, rlimit); each live sandbox gets its own."""

    docker_host: str | None = None
    """Docker engine URL; None uses DOCKER_HOST (or the default socket). Must be on this host."""

    docker_image: str | None = None
    """Image for sandboxes; None builds `agent-rl-sandbox:py` locally from this host's /usr (no pulls)."""
