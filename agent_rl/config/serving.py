"""Config of the rollout side of `serve` (scheduler, runners) and the web API."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_serializer

from agent_rl.config.access import BearerToken, HostList
from agent_rl.config.base import Section
from agent_rl.config.secrets import MASK


class RolloutConfig(Section):
    env: str = "calculator"
    """Registry id of the environment `serve` runs (`agent-rl envs list`)."""

    env_kwargs: dict[str, Any] = {}
    """Keyword arguments for `make(env, **env_kwargs)` (e.g. `tasks = "my_tasks.jsonl"`). Those
    named like secrets (`api_key`, `*_token`, `password`, ...) and those in `secret_env_kwargs`
    are masked wherever the config is stored or shown."""

    secret_env_kwargs: list[str] = []
    """Names of `env_kwargs` whose values are secrets, beyond those named like one: masked in
    the run's stored config, the API, the viewer and `config show` (a replay or fork takes
    them from the config of the process that serves it)."""

    split: str = "train"
    """Task split to draw from."""

    seed: int = 0
    """Seed of the task order and of per-episode seeds; a restart continues the same order."""

    group_size: int = Field(default=8, ge=1)
    """Episodes per task; GRPO computes one advantage baseline over them."""

    max_concurrent_episodes: int = Field(default=32, ge=1)
    """Episodes running at once in one serve process."""

    max_queued_groups: int | None = Field(default=None, ge=0)
    """Admission bounds staleness at consumption: a group is admitted only while fewer of the
    run's groups are queued for the trainer than this (admitted and not yet taken by it:
    running or ready), across every serve, so that when the trainer is the slower side data
    waits at most about this many groups' worth of steps instead of aging past the bound (the
    groups a trainer holds do not count: they are being trained). None:
    max(trainer.max_staleness, 1) x trainer.groups_per_step; 0: no bound (admission then checks
    only the served version)."""

    max_ready_groups: int | None = Field(default=None, ge=0)
    """Admission also waits while this many of the run's groups have finished and wait for the
    trainer (ready): with a queue wider than the default, groups that finish while the trainer
    is the slower side would otherwise line up behind each other and age past the staleness
    bound, whole groups filtered as stale. None: max(trainer.max_staleness, 1) x
    trainer.groups_per_step (the next steps' worth; implied by the default queue), or no bound
    where `max_queued_groups` is 0 (collecting without a trainer); 0: no bound."""

    protect_oldest_group: bool = False
    """Admission also waits while one more group could let the trainer step past the oldest
    group this serve runs before training it: groups that finish beside a long-running one
    step the trainer, and each step moves the staleness floor past more of its early tokens
    (masked: generated, never trained). Costs throughput, not tokens: the slots its finished
    siblings freed wait for it (agent_rl/rollout/oldest_group.py, docs/serve.md)."""

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

    task_selection: Literal["all", "skip_all_equal"] = "all"
    """Which drawn tasks serve admits: every one, or ("skip_all_equal") not a task whose last
    group's rewards were all equal, for its next `task_pause` draws (doubled for each further
    all-equal group in a row, up to 8x, and scaled by the share of the task's groups that were
    all equal), so the long tail of groups with no signal is not generated again and again
    (agent_rl/rollout/task_selection.py)."""

    task_pause: int = Field(default=8, ge=1)
    """With `task_selection = "skip_all_equal"`: draws of a task skipped after one all-equal
    group, when all of its groups so far were all equal (a task with a record of signal is
    paused for its share of all-equal groups of this, at least 1)."""

    router_url: str | None = None
    """An external router (or SGLang server) to generate with; unset: `serve` starts the
    embedded router and one engine."""

    heartbeat_s: float = Field(default=10.0, gt=0)
    """How often a serve process marks its running episodes alive."""

    stale_after_s: float = Field(default=60.0, gt=0)
    """A running episode whose process has not beaten for this long belongs to a process that
    died: it is resumed by a live serve, or failed as interrupted if it cannot be."""

    max_resumes: int = Field(default=2, ge=0)
    """Times one episode may be resumed after its serve died; past that it fails as
    interrupted (0: never resume)."""

    seeded_sampling: bool = False
    """Sample every request with a seed derived from its episode's seed and turn (SGLang's
    `sampling_seed`), so a rerun of the same tasks gives the same tokens; `agent-rl eval` sets it.
    The CPU engine honours it as is; a GPU engine needs `--enable-deterministic-inference`
    (engine.extra_args)."""

    engine_sample_s: float = Field(default=2.0, ge=0)
    """How often serve records each engine's load (SGLang's `/v1/loads`: running and queued
    requests, KV-cache use, generation throughput) for `agent-rl audit`; 0: never."""

    gateway_host: str = "127.0.0.1"
    """Address of the OpenAI-compatible gateway that agent environments' programs call
    (`/agents/{episode_key}/v1`); loopback by default, since the agents run beside serve. Any
    other address needs `api.token` set (serve refuses to start without it); requests are
    still authenticated by their episode's key alone (docs/agents.md)."""

    gateway_port: int = Field(default=0, ge=0, le=65535)
    """Port of the gateway (0 picks a free one; serve logs where it listens)."""

    gateway_allowed_hosts: HostList = []
    """Host header values the gateway answers besides its bind address and localhost,
    127.0.0.1 and [::1] (`name` on any port, `name:port` on that one, `*` any): what agents
    call it by behind a proxy or by a DNS name. Other Hosts get 421 (DNS rebinding)."""

    gateway_write_s: float = Field(default=5.0, ge=0)
    """How long an agent episode's kept calls may wait in serve's memory before their turns are
    written: together, during a call once the oldest has waited this long, and the rest with
    the episode's end, in its transaction. An agent episode cannot be resumed, so a crash loses
    nothing a write would have saved; what waits is the store's view of a running episode
    (docs/agents.md). 0: each call's turn is written during the next call."""

    decode_table: Path | None = None
    """bench/decode.py's `--out` file: `agent-rl audit` compares the run's decode throughput
    with its cell for the run's completion length and concurrency."""

    @field_serializer("env_kwargs", when_used="json")
    def _mask_named(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        named = set(self.secret_env_kwargs)
        return {k: MASK if k in named and v not in (None, "") else v for k, v in kwargs.items()}


class ApiConfig(Section):
    host: str = "127.0.0.1"
    """Address the web API and viewer bind; loopback by default. On any other address every
    endpoint, reads included, needs the bearer token."""

    port: int = Field(default=30200, ge=0, le=65535)
    """Port of the web API and viewer (0 picks a free one)."""

    allowed_hosts: HostList = []
    """Host header values the API and viewer answer besides the bind address and localhost,
    127.0.0.1 and [::1] on its port (`name` on any port, `name:port` on that one, `*` any):
    the names a proxy or a DNS name forwards. Other Hosts get 421, and a state-changing request
    whose Origin is not one of them 403 (a web page reaching a loopback API: DNS rebinding)."""

    token: BearerToken = None
    """Bearer token for the mutating endpoints (replay, fork); unset, empty or blank: they
    answer 403, and the API refuses to start on a non-loopback host."""

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
