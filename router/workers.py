"""The router's view of its SGLang workers: load, health, circuit breaker, weight version.

A `Worker` is eligible for new traffic when it is not quarantined (health checks failed) and its
circuit breaker lets a request through. The two signals are kept apart on purpose: quarantine is
driven by the periodic `/health_generate` probe and lifted only by probes, so a worker that
stopped generating is taken out even when no traffic reaches it; the circuit breaker is driven by
live traffic and reacts within a few requests, long before the next probe. Everything here is
plain state mutated from one event loop, so there are no locks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterator
from urllib.parse import urlsplit

from agent_rl.kernel.errors import ConfigError


class Breaker(str, Enum):
    """Circuit-breaker states of one worker."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(eq=False)
class Worker:
    """One SGLang server behind the router."""

    url: str
    address: tuple[str, int] = ("", 0)
    """(host, port) of `url`, parsed once for the proxy's connection pool."""
    outstanding: int = 0
    """Requests forwarded to this worker and not yet finished (the least-outstanding load)."""
    quarantined: bool = False
    health_failures: int = 0
    health_successes: int = 0
    breaker: Breaker = Breaker.CLOSED
    breaker_failures: int = 0
    breaker_opened_at: float = 0.0
    half_open_trial: bool = False
    """True while the single trial request of a half-open breaker is in flight."""
    weight_version: str | None = None
    updating: bool = False
    """True from the start of a weight update fanned out by the router until this worker's part
    of it finished; such a worker does not receive new sessions while others are up to date."""
    last_error: str | None = None
    in_flight_gauge: Any = None
    """This worker's Prometheus in-flight gauge, looked up once (see RouterMetrics.observe)."""
    added_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        self.address = (parts.hostname or "127.0.0.1", parts.port or 80)

    def admits(self, now: float, cooldown_s: float) -> bool:
        """Whether a new request may be sent here now (moves an expired open breaker to half-open)."""
        if self.quarantined:
            return False
        if self.breaker is Breaker.OPEN:
            if now - self.breaker_opened_at < cooldown_s:
                return False
            self.breaker = Breaker.HALF_OPEN
            self.half_open_trial = False
        if self.breaker is Breaker.HALF_OPEN:
            return not self.half_open_trial
        return True

    def describe(self) -> dict[str, Any]:
        """The JSON shape of this worker in `GET /workers`."""
        return {
            "url": self.url,
            "healthy": not self.quarantined,
            "quarantined": self.quarantined,
            "circuit_breaker": self.breaker.value,
            "outstanding": self.outstanding,
            "weight_version": self.weight_version,
            "updating": self.updating,
            "last_error": self.last_error,
        }


def normalize_url(url: str) -> str:
    """`host:port` or `http://host:port/` -> `http://host:port`; rejects what cannot be a worker."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith("http://") or url.count("/") > 2:
        raise ConfigError(
            f"invalid worker URL {url!r}: give the SGLang server's plain-http base URL, "
            "e.g. http://127.0.0.1:30000"
        )
    return url


class WorkerPool:
    """The ordered set of workers, with the bookkeeping the balancer and health checker share."""

    def __init__(self, urls: list[str] | None = None) -> None:
        self._workers: dict[str, Worker] = {}
        for url in urls or []:
            self.add(url)

    def add(self, url: str) -> tuple[Worker, bool]:
        """Add a worker (idempotent); returns it and whether it is new."""
        url = normalize_url(url)
        if url in self._workers:
            return self._workers[url], False
        worker = Worker(url)
        self._workers[url] = worker
        return worker, True

    def remove(self, url: str) -> Worker | None:
        """Remove a worker; requests already sent to it finish normally."""
        return self._workers.pop(normalize_url(url), None)

    def get(self, url: str) -> Worker | None:
        return self._workers.get(normalize_url(url))

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def eligible(self, cooldown_s: float) -> list[Worker]:
        """Workers that may take a new request now."""
        now = time.monotonic()
        return [w for w in self._workers.values() if w.admits(now, cooldown_s)]
