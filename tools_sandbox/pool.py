"""Sandboxes for episodes: a warm pool per spec, a cap on live sandboxes, a live-count metric.

The episode runner asks the pool for a sandbox per episode (`async with pool.sandbox(spec)`) and
it is closed when the episode ends; a used sandbox is never handed to another episode (its files
and processes are that episode's). The pool keeps up to `warm_pool` started, unused sandboxes
per spec that was asked for, refilled in the background, so an episode's first tool call does
not pay start-up. At most `max_sandboxes` exist at once (warm ones included): beyond that,
`acquire` waits. Creations run `create_concurrency` at a time, each after a random delay of up
to `create_jitter_s`, so a burst of episodes does not start in lockstep on a few cores.

`SandboxPool.open(config)` also runs the backend's reaper once, so what a crashed server left is
gone before the first sandbox starts.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from anyio.abc import TaskGroup
from prometheus_client import Counter, Gauge

from agent_rl.config import SandboxConfig
from agent_rl.kernel.errors import SandboxError
from tools_sandbox.base import Sandbox, SandboxBackend, SandboxSpec
from tools_sandbox.factory import open_backend

log = logging.getLogger(__name__)

LIVE = Gauge("agent_rl_sandboxes_live", "Sandboxes alive in this process, warm ones included.",
             ["backend"])
WARM = Gauge("agent_rl_sandboxes_warm", "Started sandboxes waiting for an episode.", ["backend"])
CREATE_FAILURES = Counter("agent_rl_sandbox_create_failures_total",
                          "Sandboxes that failed to start.", ["backend"])


class SandboxPool:
    """Hands out one sandbox per episode; see the module docstring."""

    def __init__(self, backend: SandboxBackend, config: SandboxConfig, tg: TaskGroup) -> None:
        self.backend = backend
        self.config = config
        self._tg = tg
        self._slots = anyio.Semaphore(config.max_sandboxes)
        self._creating = anyio.CapacityLimiter(config.create_concurrency)
        self._warm: dict[SandboxSpec, list[Sandbox]] = {}
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
        LIVE.labels(self.backend.name).set(self.backend.live())
        WARM.labels(self.backend.name).set(self.warm())

    async def _create(self, spec: SandboxSpec) -> Sandbox:
        """Create while holding a slot (the caller acquired it); jittered, concurrency-capped."""
        async with self._creating:
            if self.config.create_jitter_s:
                await anyio.sleep(random.uniform(0, self.config.create_jitter_s))
            try:
                sandbox = await self.backend.create(spec)
            except SandboxError:
                CREATE_FAILURES.labels(self.backend.name).inc()
                raise
            finally:
                self._update_metrics()
        return sandbox

    async def acquire(self, spec: SandboxSpec) -> Sandbox:
        """A started sandbox for one episode: a warm one if there is, else a new one."""
        if self._closed:
            raise SandboxError("the sandbox pool is closed")
        warm = self._warm.get(spec)
        if warm:
            sandbox = warm.pop()
            self._schedule_refill(spec)
            self._update_metrics()
            return sandbox
        await self._slots.acquire()
        try:
            sandbox = await self._create(spec)
        except BaseException:
            self._slots.release()
            raise
        self._schedule_refill(spec)
        return sandbox

    async def release(self, sandbox: Sandbox) -> None:
        """Close an episode's sandbox and free its slot."""
        try:
            await sandbox.close()
        finally:
            self._slots.release()
            self._update_metrics()

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
        """Fill the warm pool for `spec` now (start of a run) instead of on first use."""
        await self._refill(spec)

    def _schedule_refill(self, spec: SandboxSpec) -> None:
        if self.config.warm_pool and spec not in self._refilling and not self._closed:
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
                except SandboxError as e:
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
