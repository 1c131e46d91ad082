"""One configuration tree for every agent-rl process.

`serve`, `train`, `router` and the CLI all read the same nested pydantic model. Values come,
highest priority first, from: explicit overrides (CLI flags), `AGENT_RL_*` environment variables
(nested with `__`, e.g. `AGENT_RL_STORE__URL`), the TOML file given with `--config` (or
`AGENT_RL_CONFIG`, or `./agent-rl.toml` when present), then the defaults written here. Every
model forbids unknown keys, so a typo fails loudly with the key and the file named.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from agent_rl.errors import ConfigError

DEFAULT_CONFIG_FILE = Path("agent-rl.toml")


class Section(BaseModel):
    """Base for config sections: unknown keys are errors, docstrings document fields."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class StoreConfig(Section):
    url: str = "sqlite:///agent_rl.db"
    """Database URL. `sqlite:///PATH` (relative to the working directory) or
    `postgresql://user@host/db` (driven by psycopg 3)."""

    compress_tokens: bool = False
    """zlib-compress token arrays (smaller rows, more CPU per write)."""

    busy_timeout_s: float = 30.0
    """How long SQLite waits for a lock held by another process before failing."""

    pool_size: int = Field(default=5, ge=1)
    """Connections kept per process (PostgreSQL)."""

    @field_validator("url")
    @classmethod
    def _known_backend(cls, url: str) -> str:
        if not url.startswith(("sqlite", "postgresql", "postgres://")):
            raise ValueError(
                f"unsupported database URL {url!r}: use sqlite:///PATH or postgresql://USER@HOST/DB"
            )
        return url


class RouterConfig(Section):
    host: str = "127.0.0.1"
    """Address the router binds; loopback by default, so only this machine reaches it."""

    port: int = Field(default=30100, ge=0, le=65535)
    """Port the router listens on (0 picks a free one)."""

    workers: list[str] = []
    """SGLang server base URLs (http://host:port) routed to from the start; more can be added
    at run time with POST /workers."""

    policy: Literal["session-affinity", "least-outstanding", "round-robin"] = "session-affinity"
    """session-affinity: a request with a session key (routing-key header or body session_id)
    goes to its session's worker within the load bound, any other request to the worker with the
    fewest outstanding requests; least-outstanding: ignore session keys; round-robin: rotate."""

    routing_key_header: str = "X-SMG-Routing-Key"
    """Request header carrying the session key (slime's name for it)."""

    affinity_load_factor: float = Field(default=1.25, ge=1.0)
    """A session stays on its worker while that worker holds fewer than factor x the mean
    outstanding requests; beyond that its requests spill over, so one hot session cannot pin a
    worker."""

    affinity_max_sessions: int = Field(default=100_000, ge=1)
    """Sessions remembered (least recently used forgotten first)."""

    health_interval_s: float = Field(default=5.0, ge=0)
    """Seconds between health checks of every worker (0 turns them off)."""

    health_timeout_s: float = Field(default=10.0, gt=0)
    """A health check with no answer within this many seconds failed."""

    health_path: str = "/health_generate"
    """Worker endpoint probed; SGLang's /health_generate runs a one-token generation."""

    quarantine_after: int = Field(default=3, ge=1)
    """Consecutive failed health checks that quarantine a worker (no new requests)."""

    recover_after: int = Field(default=2, ge=1)
    """Consecutive good health checks that bring a quarantined worker back."""

    breaker_failures: int = Field(default=5, ge=1)
    """Consecutive failed requests (connect error, reset, timeout, 5xx) that open a worker's
    circuit breaker."""

    breaker_cooldown_s: float = Field(default=10.0, ge=0)
    """Seconds an open circuit breaker keeps a worker out before one trial request."""

    retries: int = Field(default=2, ge=0)
    """Other workers tried when a connection cannot be opened (only then: a request that
    reached a worker is never sent again)."""

    connect_timeout_s: float = Field(default=5.0, gt=0)
    """Seconds to open a connection to a worker."""

    request_timeout_s: float = Field(default=1800.0, gt=0)
    """Seconds a proxied request may take end to end (streams included) before the caller gets 504."""

    control_timeout_s: float = Field(default=600.0, gt=0)
    """Seconds a control call (pause, weight update, abort) may take on one worker."""

    update_pause_mode: Literal["in_place", "retract", "abort", "none"] = "in_place"
    """How workers pause around /update_weights_from_disk: in_place keeps in-flight requests
    (they finish on the new weights), retract recomputes them, abort ends them, none skips the
    pause."""

    max_body_mb: int = Field(default=256, ge=1)
    """Largest request body accepted, in MiB (long multi-turn prompts as token ids)."""

    admin_token: SecretStr | None = None
    """Bearer token for /workers and the control endpoints; unset: a random token is generated
    at start and printed once."""


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

    extra_args: list[str] = []
    """More `sglang.launch_server` arguments, passed through verbatim."""


class TrainerConfig(Section):
    model: Path | None = None
    """HF model directory training starts from (exports keep its config and tokenizer)."""

    lr: float = Field(default=3e-5, gt=0)
    """Adam learning rate for RL (3e-5 suits the tiny models; 1e-3 or 3e-4 collapsed them)."""

    lr_warmup_steps: int = Field(default=0, ge=0)
    """Optimizer steps over which the learning rate ramps linearly up to `lr`."""

    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    """Adam beta1."""

    adam_beta2: float = Field(default=0.99, ge=0, lt=1)
    """Adam beta2."""

    adam_eps: float = Field(default=1e-8, gt=0)
    """Adam epsilon."""

    weight_decay: float = Field(default=0.0, ge=0)
    """Decoupled weight decay (AdamW style)."""

    grad_clip: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping."""

    loss_type: Literal["grpo", "gspo", "ppo"] = "grpo"
    """grpo: token-level PPO-clip on group-normalised advantages; gspo: sequence-level ratios
    (GSPO); ppo: token-level PPO-clip on the advantages as given."""

    clip_eps_low: float = Field(default=0.2, ge=0)
    """Lower clip range: ratios below 1 - clip_eps_low stop pushing (GSPO: ~3e-4)."""

    clip_eps_high: float = Field(default=0.28, ge=0)
    """Upper clip range: ratios above 1 + clip_eps_high stop pushing (GSPO: ~4e-4)."""

    advantage_std_normalize: bool = True
    """Divide group-centred rewards by the group's std (off: Dr. GRPO style, centring only)."""

    tis_cap: float | None = Field(default=2.0, gt=0)
    """Truncated importance sampling: weight tokens by min(pi_train / pi_rollout, cap) to
    correct train/inference mismatch and staleness; unset disables it."""

    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the k3 KL penalty to the reference (starting) policy; 0 skips the reference."""

    aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How per-token losses become the step's loss."""

    micro_batch_size: int = Field(default=4, ge=1)
    """Sequences per forward/backward pass; gradients accumulate over a step's micro-batches."""

    groups_per_step: int = Field(default=8, ge=1)
    """Global batch: groups (prompts x samples) consumed by one optimizer step."""

    tp: int = Field(default=1, ge=1)
    """Tensor-parallel size."""

    pp: int = Field(default=1, ge=1)
    """Pipeline-parallel size (only 1 is supported so far)."""

    ep: int = Field(default=1, ge=1)
    """Expert-parallel size (MoE models)."""

    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (Megatron's DistributedOptimizer)."""

    routing_replay: bool = True
    """MoE: train with the experts the rollout engine chose (R3) when episodes carry them."""

    checkpoint_dir: Path = Path("runs/checkpoints")
    """Where dist_checkpointing checkpoints go (one folder per step); resume reads the latest."""

    checkpoint_every: int = Field(default=10, ge=1)
    """Checkpoint every k optimizer steps (and at shutdown)."""

    export_dir: Path = Path("runs/exports")
    """Where HF safetensors exports for the engines go (one folder per policy version)."""

    export_every: int = Field(default=1, ge=1)
    """Export weights and ask the router to reload them every k optimizer steps."""

    max_staleness: int = Field(default=4, ge=0)
    """eta: train only on episodes sampled by a policy at most this many versions old."""

    router_url: str | None = None
    """Router (or single SGLang server) that loads each export via /update_weights_from_disk;
    unset: `rollout.router_url`; neither: weights are exported but not synced."""

    claim_lease_s: float = Field(default=300.0, gt=0)
    """Lease of a claim on ready groups; a trainer that dies holding one gives them back after it."""

    data_poll_s: float = Field(default=1.0, gt=0)
    """How often a trainer waiting for ready groups asks the store again."""

    tensorboard_dir: Path | None = Path("runs/tensorboard")
    """Where per-step TensorBoard scalars go (offline event files); unset: none."""

    sft_lr: float = Field(default=1e-3, gt=0)
    """Learning rate of `agent-rl train --sft` (cross-entropy on demonstration tokens)."""

    sft_steps: int = Field(default=1000, ge=1)
    """Optimizer steps of an SFT run."""

    sft_batch_size: int = Field(default=16, ge=1)
    """Demonstration transcripts per SFT optimizer step."""

    seed: int = 0
    """Seed for initialisation-time randomness and data order."""

    threads: int = Field(default=1, ge=1)
    """torch CPU threads per rank (1 is fastest on a small shared machine)."""


class SandboxLimits(Section):
    """Resource limits of one sandbox (`tools_sandbox.base.Limits` is this class)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

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


class SandboxConfig(Section):
    backend: Literal["bwrap", "docker", "rlimit"] = "bwrap"
    """Isolation for tool calls: bubblewrap namespaces (default), a Docker container per
    episode, or `rlimit` (rlimits and a uid only, NOT isolation; for machines with neither)."""

    limits: SandboxLimits = SandboxLimits()
    """Default limits of every sandbox (an environment may ask for tighter ones)."""

    max_sandboxes: int = Field(default=64, ge=1)
    """Sandboxes alive at once in this process (warm ones included); creation waits beyond it."""

    warm_pool: int = Field(default=0, ge=0)
    """Sandboxes kept started and idle per spec, so an episode's first call pays no start-up."""

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


class RolloutConfig(Section):
    env: str = "calculator"
    """Registry id of the environment `serve` runs (`agent-rl envs list`)."""

    env_kwargs: dict[str, Any] = {}
    """Keyword arguments for `make(env, **env_kwargs)` (e.g. `tasks = "my_tasks.jsonl"`)."""

    split: str = "train"
    """Task split to draw from."""

    seed: int = 0
    """Seed of the task order and of per-episode seeds; a restart continues the same order."""

    group_size: int = Field(default=8, ge=1)
    """Episodes per task; GRPO computes one advantage baseline over them."""

    max_concurrent_episodes: int = Field(default=32, ge=1)
    """Episodes running at once in one serve process."""

    max_turns: int = Field(default=8, ge=1)
    """Assistant turns before the runner truncates an episode (reward 0, recorded why)."""

    max_tokens: int = Field(default=2048, ge=16)
    """Token budget of a whole episode (prompt, completions, observations)."""

    max_new_tokens: int = Field(default=128, ge=1)
    """Most tokens one generation may produce."""

    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature (1.0 keeps the behaviour logprobs on-policy)."""

    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling threshold."""

    stop: list[str] = []
    """Extra stop strings ending a turn (the chat template's end-of-turn token always does)."""

    episode_timeout_s: float = Field(default=600.0, gt=0)
    """Wall-clock deadline of one episode; past it the episode is truncated."""

    filter_zero_variance: bool = True
    """Filter groups whose rewards are all equal (they carry no GRPO signal), with the reason."""

    router_url: str | None = None
    """An external router (or SGLang server) to generate with; unset: `serve` starts the
    embedded router and one engine."""

    heartbeat_s: float = Field(default=10.0, gt=0)
    """How often a serve process marks its running episodes alive."""

    stale_after_s: float = Field(default=60.0, gt=0)
    """A running episode whose process has not beaten for this long is resolved as interrupted."""


class ApiConfig(Section):
    host: str = "127.0.0.1"
    """Address the web API and viewer bind; loopback by default. On any other address every
    endpoint, reads included, needs the bearer token."""

    port: int = Field(default=30200, ge=0, le=65535)
    """Port of the web API and viewer (0 picks a free one)."""

    token: SecretStr | None = None
    """Bearer token for the mutating endpoints (replay, fork); unset: they answer 403."""

    max_page_size: int = Field(default=500, ge=1, le=10_000)
    """Most episodes one list request returns; larger `limit`s are clamped to it."""

    max_request_bytes: int = Field(default=65_536, ge=1024)
    """Largest request body accepted; beyond it the answer is 413."""

    tokenizer: Path | None = None
    """HF tokenizer (or model) directory for the token view's text pieces; unset: the run's
    `engine.model`, then this config's `engine.model`."""

    events_poll_s: float = Field(default=0.5, gt=0)
    """How often the live event stream of a running episode polls the store for new turns."""

    replay_timeout_s: float = Field(default=300.0, gt=0)
    """Wall-clock limit of one replay or fork."""


class TelemetryConfig(Section):
    exporter: Literal["none", "console"] = "none"
    """Where OpenTelemetry spans go: nowhere (the API is a no-op), or the console."""


class RunConfig(Section):
    name: str = "default"
    """Name of the run; serve and train with the same name share one run in the store."""


class Config(BaseSettings):
    """The whole agent-rl configuration."""

    model_config = SettingsConfigDict(
        env_prefix="AGENT_RL_",
        env_nested_delimiter="__",
        extra="forbid",
        use_attribute_docstrings=True,
    )

    run: RunConfig = RunConfig()
    """The run that episodes and policy versions belong to."""

    store: StoreConfig = StoreConfig()
    """The trajectory store."""

    router: RouterConfig = RouterConfig()
    """The metadata-preserving router in front of the SGLang workers."""

    engine: EngineConfig = EngineConfig()
    """The SGLang engine launched by `serve` (embedded) or `agent-rl engine start`."""

    trainer: TrainerConfig = TrainerConfig()
    """The Megatron-core trainer (`agent-rl train`)."""

    sandbox: SandboxConfig = SandboxConfig()
    """Sandboxes that run the agents' tool calls."""

    telemetry: TelemetryConfig = TelemetryConfig()
    """OpenTelemetry tracing of episodes, generations and tool calls (off by default)."""

    rollout: RolloutConfig = RolloutConfig()
    """The scheduler and episode runners of `agent-rl serve` (admission uses
    `trainer.max_staleness` as the staleness bound)."""

    api: ApiConfig = ApiConfig()
    """The web API and episode viewer (`agent-rl api`, or mounted by `serve`)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_file = _ACTIVE_FILE.get("path")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)


# The TOML path for the Config being built; pydantic-settings builds sources from a classmethod,
# so the path travels here for the duration of one `load_config` call.
_ACTIVE_FILE: dict[str, Path | None] = {"path": None}


def resolve_config_path(path: Path | None) -> Path | None:
    """The config file to read: the given one, `AGENT_RL_CONFIG`, or `./agent-rl.toml` if present."""
    if path is not None:
        return path
    env = os.environ.get("AGENT_RL_CONFIG")
    if env:
        return Path(env)
    return DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.is_file() else None


def load_config(path: Path | None = None, **overrides: Any) -> Config:
    """Build the effective config; raise ConfigError with a one-line, actionable message."""
    path = resolve_config_path(path)
    if path is not None and not path.is_file():
        raise ConfigError(f"config file {path} does not exist: pass an existing file to --config")
    _ACTIVE_FILE["path"] = path
    try:
        return Config(**overrides)
    except ValidationError as e:
        raise ConfigError(_describe(e, path)) from e
    except Exception as e:  # a TOML syntax error surfaces as tomllib.TOMLDecodeError
        if type(e).__name__ == "TOMLDecodeError":
            raise ConfigError(f"{path}: invalid TOML: {e}") from e
        raise
    finally:
        _ACTIVE_FILE["path"] = None


def _describe(e: ValidationError, path: Path | None) -> str:
    where = f"in {path}" if path is not None else "in the environment (AGENT_RL_*)"
    problems = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            problems.append(f"unknown key '{key}' {where}")
        else:
            problems.append(f"invalid value for '{key}' {where}: {err['msg']}")
    return "; ".join(problems)
