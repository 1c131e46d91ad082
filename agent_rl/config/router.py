"""Config of the metadata-preserving router (`agent-rl router`, or embedded in `serve`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from agent_rl.config.access import BearerToken, HostList
from agent_rl.config.base import Section


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

    update_pause_mode: Literal["in_place", "retract", "abort", "none"] = "retract"
    """How workers pause around /update_weights_from_disk: retract recomputes in-flight requests
    on the new weights and the prefix cache is flushed; in_place keeps them where they are (they
    finish on the new weights) but the cache then keeps KV of the old weights for later requests
    (measured: 2 nats/token off after a large update); abort ends them; none skips the pause."""

    max_body_mb: int = Field(default=256, ge=1)
    """Largest request body accepted, in MiB (long multi-turn prompts as token ids)."""

    admin_token: BearerToken = None
    """Bearer token for /workers and the control endpoints. Unset, empty or blank means none: on
    a loopback host a random token is then generated at start and printed once; on any other
    host the router refuses to start."""

    allowed_hosts: HostList = []
    """Host header values the router answers (every route: proxied, control, /workers,
    /health, /metrics) besides the bind address and localhost, 127.0.0.1 and [::1] on its port
    (on a wildcard bind also this machine's names and any IP address; `name` on any port,
    `name:port` on that one, `*` any); other Hosts get 421, a foreign Origin on a POST 403 (a
    web page reaching a loopback router: DNS rebinding). Add the names callers use."""

    tokenless_control: bool = False
    """Let /workers and the control endpoints answer without the admin token, for tools that send
    none (slime's rollout); refused unless host is a loopback address."""
