"""Health checks with quarantine and recovery, and the per-worker circuit breaker.

Quarantine: a background task sends `GET /health_generate` (a one-token generation, so a worker
whose scheduler is wedged fails it even while its HTTP server answers) to every worker each
`health_interval_s`. After `quarantine_after` consecutive failures the worker is quarantined
(no new requests); after `recover_after` consecutive successes it is restored.

Circuit breaker: live requests that fail on the worker's side (connection refused or reset,
timeout, a 5xx answer) count against the worker; after `breaker_failures` in a row the breaker
opens and the worker gets no traffic for `breaker_cooldown_s`; then one trial request is let
through (half-open) and its outcome closes or re-opens the breaker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

from agent_rl.config import RouterConfig
from router.metrics import RouterMetrics
from router.workers import Breaker, Worker, WorkerPool

log = logging.getLogger("agent_rl.router")


class Health:
    """Applies the quarantine and circuit-breaker rules; owns the probing task."""

    def __init__(self, config: RouterConfig, pool: WorkerPool, metrics: RouterMetrics) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self._task: asyncio.Task[None] | None = None
        self.before_restore: Callable[[Worker], Awaitable[None]] | None = None
        """Awaited before a quarantined worker is restored; raising keeps it quarantined."""

    # -- circuit breaker, fed by the proxy -------------------------------------------------

    def request_started(self, worker: Worker) -> None:
        if worker.breaker is Breaker.HALF_OPEN:
            worker.half_open_trial = True

    def request_succeeded(self, worker: Worker) -> None:
        worker.breaker_failures = 0
        worker.half_open_trial = False
        if worker.breaker is not Breaker.CLOSED:
            log.info("worker %s: circuit breaker closed", worker.url)
            worker.breaker = Breaker.CLOSED

    def request_failed(self, worker: Worker, kind: str, detail: str) -> None:
        self.metrics.upstream_errors.labels(worker.url, kind).inc()
        worker.last_error = f"{kind}: {detail}"
        worker.breaker_failures += 1
        worker.half_open_trial = False
        trips = worker.breaker is Breaker.HALF_OPEN or (
            worker.breaker is Breaker.CLOSED
            and worker.breaker_failures >= self.config.breaker_failures
        )
        if trips:
            worker.breaker = Breaker.OPEN
            worker.breaker_opened_at = time.monotonic()
            self.metrics.breaker_opens.labels(worker.url).inc()
            log.warning("worker %s: circuit breaker open after %s", worker.url, worker.last_error)

    # -- quarantine, fed by probes ---------------------------------------------------------

    def probe_result(self, worker: Worker, ok: bool, detail: str = "") -> None:
        if ok:
            worker.health_failures = 0
            worker.health_successes += 1
            if worker.quarantined and worker.health_successes >= self.config.recover_after:
                worker.quarantined = False
                # A worker that proved healthy again starts with a clean breaker.
                worker.breaker = Breaker.CLOSED
                worker.breaker_failures = 0
                log.info("worker %s: restored after %d good health checks", worker.url,
                         worker.health_successes)
        else:
            worker.health_successes = 0
            worker.health_failures += 1
            worker.last_error = f"health check: {detail}"
            if not worker.quarantined and worker.health_failures >= self.config.quarantine_after:
                worker.quarantined = True
                self.metrics.quarantines.labels(worker.url).inc()
                log.warning("worker %s: quarantined after %d failed health checks (%s)",
                            worker.url, worker.health_failures, detail)
        self.metrics.healthy.labels(worker.url).set(0 if worker.quarantined else 1)

    async def probe(self, session: aiohttp.ClientSession, worker: Worker) -> None:
        """One health check of one worker."""
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        try:
            async with session.get(worker.url + self.config.health_path, timeout=timeout) as r:
                await r.read()
                ok, detail = r.status == 200, f"status {r.status}"
        except asyncio.TimeoutError:
            ok, detail = False, f"no answer within {self.config.health_timeout_s}s"
        except aiohttp.ClientError as e:
            ok, detail = False, f"{type(e).__name__}: {e}"
        if self.pool.get(worker.url) is not worker:  # removed while probing: forget it
            return
        restoring = ok and worker.quarantined and worker.health_successes + 1 >= self.config.recover_after
        if restoring and self.before_restore is not None:
            try:
                await self.before_restore(worker)
            except Exception as e:  # noqa: BLE001 - any failure keeps it out of rotation
                ok, detail = False, f"not restored: {e}"
        self.probe_result(worker, ok, detail)

    async def admit(self, session: aiohttp.ClientSession, worker: Worker, *, behind: bool) -> None:
        """A worker just added to the pool: probed once. `behind` (the fleet has taken weight
        updates, so a worker that joins now, such as an engine re-placed by `agent-rl launch`,
        runs older weights) keeps it out of rotation until `before_restore` gave it the newest
        ones: now if it answers, else when its health checks restore it."""
        worker.quarantined = behind
        await self.probe(session, worker)
        if not worker.quarantined or worker.health_failures or self.before_restore is None:
            return  # restored by the probe itself (recover_after=1), or not answering yet
        try:
            await self.before_restore(worker)
        except Exception as e:  # noqa: BLE001 - any failure keeps it out of rotation
            worker.last_error = f"not restored: {e}"
            return
        worker.quarantined = False
        self.metrics.healthy.labels(worker.url).set(1)
        log.info("worker %s: joined at the fleet's newest weights", worker.url)

    async def probe_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.probe(session, w) for w in self.pool))

    def start(self, session: aiohttp.ClientSession) -> None:
        if self.config.health_interval_s > 0:
            self._task = asyncio.create_task(self._loop(session), name="router-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.probe_all(session)
            except Exception:  # a bug in one round must not end health checking for good
                log.exception("health check round failed")
            await asyncio.sleep(max(0.0, self.config.health_interval_s - (time.monotonic() - started)))
