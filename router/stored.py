"""Requests about state one worker holds: SGLang's stored responses, by id.

SGLang (with `--enable-response-store`) keeps a `/v1/responses` result on the server that made
it, and the router does not learn its id (it is in the answer, which the router relays without
parsing). `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel` are therefore sent to
every eligible worker at once; a worker that does not hold the id answers 404. The caller gets,
unchanged, the first success (the holder's answer), else the first other answer (a worker with
the store off says so), else the first 404. Cancelling on a worker that does not hold the id
does nothing there.

A request continuing a stored response (`previous_response_id`) is balanced like any other; with
several workers, keep a chain on one worker with a session key (docs/router.md).
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from multidict import CIMultiDict

from agent_rl.config import RouterConfig
from router.errors import error_response
from router.metrics import RouterMetrics
from router.proxy import HOP_BY_HOP
from agent_rl.kernel.http1 import NotSent, Upstream, UpstreamFailed
from router.workers import Worker, WorkerPool

Answer = tuple[int, str, list[tuple[str, str]], bytes]


class Stored:
    """Finds the worker that holds a stored response and relays its answer."""

    def __init__(
        self, config: RouterConfig, pool: WorkerPool, metrics: RouterMetrics, upstream: Upstream
    ) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.upstream = upstream

    async def handle(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        response = await self._lookup(request)
        route = request.match_info.route.resource.canonical  # type: ignore[union-attr]
        self.metrics.observe(route, response.status, time.perf_counter() - started)
        return response

    async def _lookup(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        workers = self.pool.eligible(self.config.breaker_cooldown_s)
        if not workers:
            return error_response(503, "no healthy worker to look the response up on; see "
                                  "GET /workers")
        answers = await asyncio.gather(
            *(self._ask(w, request, headers, body) for w in workers))
        reached = [a for a in answers if not isinstance(a, str)]
        if reached:
            # The holder's success, else a worker's answer about the id (a 400 for a malformed
            # one, or from a worker with the store off), else a 404: nobody holds it.
            best = min(reached, key=lambda a: 0 if a[0] < 300 else 2 if a[0] == 404 else 1)
            return _relay(*best)
        failures = [a for a in answers if isinstance(a, str)]
        return error_response(502, f"no worker answered: {'; '.join(failures)}")

    async def _ask(
        self, worker: Worker, request: web.Request, headers: list[tuple[str, str]], body: bytes
    ) -> Answer | str:
        """One worker's answer, or what went wrong reaching it."""
        try:
            async with asyncio.timeout(self.config.control_timeout_s):
                reply = await self.upstream.request(
                    worker.address, request.method, request.raw_path, headers, body)
                try:
                    payload = await reply.read()
                finally:
                    reply.close()
        except (NotSent, UpstreamFailed, TimeoutError) as e:
            return f"{worker.url}: {e or type(e).__name__}"
        return reply.status, reply.reason, reply.headers, payload


def _relay(status: int, reason: str, headers: list[tuple[str, str]], payload: bytes) -> web.Response:
    out = CIMultiDict((k, v) for k, v in headers if k.lower() not in HOP_BY_HOP)
    return web.Response(status=status, reason=reason, body=payload, headers=out)
