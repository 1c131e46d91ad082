"""Sandboxes for episodes: a warm pool per spec, a cap on live sandboxes, a live-count metric.

Every episode `serve` runs (and every replay or fork the API runs) gets its sandbox here
(`async with pool.sandbox(spec)`), and it is closed when the episode ends; a used sandbox is
never handed to another episode (its files and processes are that episode's). For each spec
named by `prewarm` (serve names its env's at start-up) the pool keeps up to `warm_pool` started,
unused sandboxes, refilled in the background as episodes take them, so an episode's first tool
call does not pay start-up; specs never prewarmed (e.g. an agent command's, which mounts its
episode's own relay) are made on demand, since a warm one could never be used. At most
`max_sandboxes` exist at once (warm ones included): beyond that, `acquire` waits. Creations run
`create_concurrency` at a time, each after a random delay of up to `create_jitter_s`, so a
burst of episodes does not start in lockstep on a few cores. A closed pool refuses `acquire`
with a SandboxError (the episode fails with it) and has closed every sandbox it made.

`SandboxPool.open(config)` also runs the backend's reaper once, so what a crashed server left is
gone before the first sandbox starts. `stats` counts what the pool did (serve reports it).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskGroup
from prometheus_client import Counter, Gauge

from agent_rl.config import SandboxConfig
from agent_rl.kernel.errors import SandboxError
from agent_rl.sdk.sandbox import Sandbox, SandboxBackend, SandboxSpec
from tools_sandbox.factory import open_backend

log = logging.getLogger(__name__)

LIVE = Gauge("agent_rl_sandboxes_live", "Sandboxes alive in this process, warm ones included.",
             ["backend"])
WARM = Gauge("agent_rl_sandboxes_warm", "Started sandboxes waiting for an episode.", ["backend"])
CREATE_FAILURES = Counter("agent_rl_sandbox_create_failures_total",
                          "Sandboxes that failed to start.", ["backend"])


@dataclass
class PoolStats:
    """What one pool did, counted as it happened."""

    created: int = 0
    """Sandboxes started (warm ones included)."""
    warm_hits: int = 0
    """Episodes handed a sandbox that was started before they asked."""
    create_failures: int = 0
    peak_live: int = 0
    """Most sandboxes alive at once."""
    peak_creating: int = 0
    """Most creations running at once (after their jitter)."""
    create_started: list[float] = field(default_factory=list)
    """`time.monotonic()` at which each creation began, after its jitter."""


class SandboxPool:
    """Hands out one sandbox per episode; see the module docstring. Without a task group
    (`tg=None`, e.g. the API's own pool) warm sandboxes are not refilled in the background."""

    def __init__(self, backend: SandboxBackend, config: SandboxConfig,
                 tg: TaskGroup | None = None) -> None:
        self.backend = backend
        self.config = config
        self.stats = PoolStats()
        self._tg = tg
        self._slots = anyio.Semaphore(config.max_sandboxes)
        self._creating = anyio.CapacityLimiter(config.create_concurrency)
        self._in_creation = 0
        self._warm: dict[SandboxSpec, list[Sandbox]] = {}
        self._prewarmed: set[SandboxSpec] = set()
        self._refilling: set[SandboxSpec] = set()
        self._closed = False

    @classmethod
    @asynccontextmanager
    async def open(cls, config: SandboxConfig) -> AsyncIterator[SandboxPool]:
        """The configured backend (reaped at start) behind a pool; everything closed on exit."""
        backend = await open_backend(config)
        async with anyio.create_task_group() as tg:
            pool = cls(backend, config, tg)
            try:
                yield pool
            finally:
                with anyio.CancelScope(shield=True):
                    await pool.aclose()
                tg.cancel_scope.cancel()

    def live(self) -> int:
        """Sandboxes alive, warm ones included (also the `agent_rl_sandboxes_live` gauge)."""
        return self.backend.live()

    def warm(self, spec: SandboxSpec | None = None) -> int:
        if spec is not None:
            return len(self._warm.get(spec, []))
        return sum(map(len, self._warm.values()))

    def _update_metrics(self) -> None:
        live = self.backend.live()
        self.stats.peak_live = max(self.stats.peak_live, live)
        LIVE.labels(self.backend.name).set(live)
        WARM.labels(self.backend.name).set(self.warm())

    async def _create(self, spec: SandboxSpec) -> Sandbox:
        """Create while holding a slot (the caller acquired it); jittered, concurrency-capped."""
        async with self._creating:
            if self.config.create_jitter_s:
                await anyio.sleep(random.uniform(0, self.config.create_jitter_s))
            stats = self.stats
            stats.create_started.append(time.monotonic())
            self._in_creation += 1
            stats.peak_creating = max(stats.peak_creating, self._in_creation)
            try:
                sandbox = await self.backend.create(spec)
            except Exception:  # not a cancellation: that is no failure of the backend
                stats.create_failures += 1
                CREATE_FAILURES.labels(self.backend.name).inc()
                raise
            finally:
                self._in_creation -= 1
                self._update_metrics()
        stats.created += 1
        return sandbox

    async def acquire(self, spec: SandboxSpec) -> Sandbox:
        """A started sandbox for one episode: a warm one if there is, else a new one."""
        if self._closed:
            raise SandboxError("the sandbox pool is closed")
        warm = self._warm.get(spec)
        if warm:
            sandbox = warm.pop()
            self.stats.warm_hits += 1
            self._schedule_refill(spec)
            self._update_metrics()
            return sandbox
        await self._slots.acquire()
        try:
            if self._closed:  # closed while this episode waited for a slot
                raise SandboxError("the sandbox pool is closed")
            sandbox = await self._create(spec)
        except BaseException:
            self._slots.release()
            raise
        if self._closed:  # closed while it started: the backend may not have closed it
            await self.release(sandbox)
            raise SandboxError("the sandbox pool is closed")
        self._schedule_refill(spec)  # a prewarmed spec ran dry: start refilling it
        return sandbox

    async def release(self, sandbox: Sandbox) -> None:
        """Close an episode's sandbox and free its slot."""
        try:
            await sandbox.close()
        finally:
            self._slots.release()
            self._update_metrics()
            for spec in self._prewarmed:  # a freed slot may let a warm pool refill
                self._schedule_refill(spec)

    @asynccontextmanager
    async def sandbox(self, spec: SandboxSpec) -> AsyncIterator[Sandbox]:
        """`async with pool.sandbox(spec) as sb:` for the length of one episode."""
        sb = await self.acquire(spec)
        try:
            yield sb
        finally:
            with anyio.CancelScope(shield=True):
                await self.release(sb)

    async def prewarm(self, spec: SandboxSpec) -> None:
        """Keep `warm_pool` started sandboxes of `spec` from now on: fill them now (returns
        once they have started) and refill as episodes take them."""
        if self.config.warm_pool and not self._closed:
            self._prewarmed.add(spec)
            self._refilling.add(spec)
            await self._refill(spec)

    def _schedule_refill(self, spec: SandboxSpec) -> None:
        if (spec in self._prewarmed and spec not in self._refilling and not self._closed
                and self._tg is not None and len(self._warm.get(spec, [])) < self.config.warm_pool):
            self._refilling.add(spec)
            self._tg.start_soon(self._refill, spec)

    async def _refill(self, spec: SandboxSpec) -> None:
        try:
            while not self._closed and len(self._warm.get(spec, [])) < self.config.warm_pool:
                # warm sandboxes never take the last slots an episode may be waiting for
                if self._slots.value <= 1:
                    return
                await self._slots.acquire()
                try:
                    sandbox = await self._create(spec)
                except Exception as e:  # in the pool's task group: never let it take serve down
                    self._slots.release()
                    log.warning("could not warm a sandbox (will create on demand): %s", e)
                    return
                if self._closed:
                    await self.release(sandbox)
                    return
                self._warm.setdefault(spec, []).append(sandbox)
                self._update_metrics()
        finally:
            self._refilling.discard(spec)

    async def aclose(self) -> None:
        """Close warm sandboxes and every sandbox the backend still has."""
        self._closed = True
        for sandboxes in self._warm.values():
            for sandbox in sandboxes:
                await self.release(sandbox)
        self._warm.clear()
        await self.backend.aclose()
        self._update_metrics()
