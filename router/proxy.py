"""Forwarding one request to one worker, bytes unchanged both ways.

The request body is read once and sent as received: the router parses it only to find a
`session_id` or `rid` (and only when those keys appear in the bytes), never to rebuild it, so a
field it has never heard of reaches the worker exactly as the caller wrote it. The worker's
status, headers (hop-by-hop ones aside) and body come back unchanged: a body of known length in
one piece, anything else (SSE streams, chunked replies) chunk by chunk as it arrives.

Retries: a request is re-sent to another worker only when the connection to the first one could
not be opened, so the worker cannot have seen a byte of it. A reset, a timeout or a 5xx after the
request was sent is returned to the caller as an error, never repeated, because the generation
may have run. Every failure the router produces is a JSON body of the OpenAI error shape
(router/errors.py), and its status says whether a worker may have the request: 503 when none
does (no worker registered, none in rotation, or none could be connected to), so the caller may
send it again; 502 (a worker failed after the request was sent) and 504 (a worker did not answer
in time) when one may have generated, so the caller must not send it again blindly.

Request ids: SGLang refuses a duplicate `rid` on one server, but through the router two live
requests may share one on different workers. The router keeps every holder of each live rid, so
`/abort_request {"rid"}` reaches all of them; the rid itself travels unchanged both ways.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import Any

from aiohttp import web
from multidict import CIMultiDict
from opentelemetry.trace import Span

from agent_rl.config import RouterConfig
from agent_rl.config.secrets import redact_url
from router.balance import Balancer
from router.errors import error_response
from router.health import Health
from router.metrics import RouterMetrics, RouterTracer
from agent_rl.kernel.http1 import NotSent, Upstream, UpstreamFailed, UpstreamResponse
from router.workers import Worker, WorkerPool

log = logging.getLogger("agent_rl.router")

# Headers that describe one connection, not the message (RFC 9110 section 7.6.1), plus the ones
# recomputed for the new message. `Expect: 100-continue` was already answered to the caller (the
# router reads the whole body first); forwarded, it would make the worker send an interim 100.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length", "expect",
})


class Proxy:
    """Forwards proxied routes (`/generate`, `/v1/...`) to a chosen worker."""

    def __init__(
        self,
        config: RouterConfig,
        pool: WorkerPool,
        balancer: Balancer,
        health: Health,
        metrics: RouterMetrics,
        tracer: RouterTracer,
        upstream: Upstream,
    ) -> None:
        self.config = config
        self.pool = pool
        self.balancer = balancer
        self.health = health
        self.metrics = metrics
        self.tracer = tracer
        self.upstream = upstream
        self._routing_header = config.routing_key_header
        self.rids: dict[str, list[Worker]] = {}
        """The workers holding each live request id (one per request), for `/abort_request`."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        # The route's pattern, not the path: `/v1/models/{model}` is one label, not one per model.
        route = request.match_info.route.resource.canonical  # type: ignore[union-attr]
        status = 500
        span = self.tracer.start(route, request.headers)
        try:
            response = await self._forward(request, span)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status  # a body over max_body_mb; answered by router.errors.json_errors
            raise
        except asyncio.CancelledError:
            status = 499  # the caller went away; its upstream request was closed with it
            raise
        finally:
            if span is not None:
                span.set_attribute("http.response.status_code", status)
                span.end()
            self.metrics.observe(route, status, time.perf_counter() - started)

    async def _forward(self, request: web.Request, span: Span | None) -> web.StreamResponse:
        body = await request.read()
        session_key, rids = self._routing_facts(request, body)
        headers = _end_to_end(request.headers)
        if span is not None:
            self.tracer.inject(span, headers)
        tried: list[Worker] = []
        last_error = ""
        for attempt in range(self.config.retries + 1):
            candidates = [w for w in self.pool.eligible(self.config.breaker_cooldown_s)
                          if w not in tried]
            if not candidates:
                break
            worker = self.balancer.choose(candidates, session_key)
            if attempt:
                self.metrics.retries.labels(worker.url).inc()
            if span is not None:
                span.set_attribute("server.address", redact_url(worker.url))
            try:
                return await self._send(request, worker, body, headers, rids)
            except _NotSent as e:
                tried.append(worker)
                last_error = str(e)
        if not len(self.pool):
            return error_response(503, "the router has no workers: add one with POST /workers "
                                  "or list them under [router] workers in the config")
        if tried:
            # Not 502: no worker received a byte of it, so sending it again is safe.
            return error_response(503, f"could not connect to any worker, the request was sent "
                                  f"to none ({last_error})", tried[-1].url)
        return error_response(503, f"no healthy worker: all {len(self.pool)} are quarantined or "
                              "have an open circuit breaker; see GET /workers")

    def _routing_facts(self, request: web.Request, body: bytes) -> tuple[str | None, list[str]]:
        """The session key and request ids, parsing JSON only when the body mentions them."""
        session = request.headers.get(self._routing_header)
        want_session = session is None and self.config.policy == "session-affinity"
        if not ((want_session and b'"session_id"' in body) or b'"rid"' in body):
            return session, []
        try:
            payload = _facts_json(body)
        except ValueError:
            return session, []  # the worker answers malformed JSON itself, in its own words
        if not isinstance(payload, dict):
            return session, []
        if want_session and isinstance(payload.get("session_id"), str):
            session = payload["session_id"]
        rid = payload.get("rid")
        rids = [rid] if isinstance(rid, str) else [r for r in rid or [] if isinstance(r, str)] \
            if isinstance(rid, list) else []
        return session, rids

    async def _send(
        self, request: web.Request, worker: Worker, body: bytes, headers: CIMultiDict[str],
        rids: list[str],
    ) -> web.StreamResponse:
        worker.outstanding += 1
        gauge = worker.in_flight_gauge
        if gauge is None:
            gauge = worker.in_flight_gauge = self.metrics.in_flight.labels(worker.url)
        gauge.inc()
        self.health.request_started(worker)
        for rid in rids:
            self.rids.setdefault(rid, []).append(worker)
        try:
            return await self._exchange(request, worker, body, list(headers.items()))
        finally:
            worker.outstanding -= 1
            gauge.dec()
            for rid in rids:
                holders = self.rids[rid]
                holders.remove(worker)
                if not holders:
                    del self.rids[rid]

    def holders(self, rid: str) -> list[Worker]:
        """The workers holding live requests with this id (each once), in the order sent."""
        return list(dict.fromkeys(self.rids.get(rid, ())))

    async def _exchange(
        self, request: web.Request, worker: Worker, body: bytes, headers: list[tuple[str, str]]
    ) -> web.StreamResponse:
        """Send the request and relay the answer, within the request timeout."""
        upstream: UpstreamResponse | None = None
        response: web.StreamResponse | None = None
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                upstream = await self.upstream.request(
                    worker.address, request.method, request.raw_path, headers, body)
                out_headers = CIMultiDict(
                    (k, v) for k, v in upstream.headers if k.lower() not in HOP_BY_HOP)
                if _whole(upstream):
                    payload = await upstream.read()
                    self._record_status(worker, upstream.status)
                    return web.Response(status=upstream.status, reason=upstream.reason,
                                        body=payload, headers=out_headers)
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                              headers=out_headers)
                await response.prepare(request)
                async for chunk in upstream.chunks():
                    await response.write(chunk)
                await response.write_eof()
                self._record_status(worker, upstream.status)
                return response
        except NotSent as e:
            self.health.request_failed(worker, "connect", str(e))
            raise _NotSent(f"{worker.url}: {e}") from e
        except (TimeoutError, UpstreamFailed) as e:
            timed_out = isinstance(e, TimeoutError)
            kind = "timeout" if timed_out else "reset"
            phase = "for the answer" if upstream is None else "during the answer"
            self.health.request_failed(worker, kind, f"{phase}: {e}")
            if response is not None and response.prepared:
                # Status and part of the body are out: the only honest signal left is to cut
                # the connection, so the caller sees a broken stream rather than a short one.
                if request.transport is not None:
                    request.transport.close()
                return response
            if timed_out:
                return error_response(504, f"worker gave no complete answer within "
                                      f"{self.config.request_timeout_s}s", worker.url)
            return error_response(502, f"worker failed after the request was sent (not "
                                  f"retried, the generation may have run): {e}", worker.url)
        finally:
            if upstream is not None:
                upstream.close()  # no-op when the body was read and the connection pooled

    def _record_status(self, worker: Worker, status: int) -> None:
        if status >= 500:
            self.health.request_failed(worker, "5xx", f"status {status}")
        else:
            self.health.request_succeeded(worker)


def _whole(upstream: UpstreamResponse) -> bool:
    """Whether to relay the answer in one piece: it has a length and is not an event stream."""
    length = ctype = None
    for k, v in upstream.headers:
        lk = k.lower()
        if lk == "content-length":
            length = v
        elif lk == "content-type":
            ctype = v
    return length is not None and not (ctype or "").startswith("text/event-stream")


def _end_to_end(headers: Any) -> CIMultiDict[str]:
    """The headers of a message minus the hop-by-hop ones, repeated headers kept."""
    # Copy-then-delete runs in multidict's C code; filtering item by item in Python cost more.
    copy: CIMultiDict[str] = CIMultiDict(headers)
    for name in HOP_BY_HOP:
        copy.popall(name, None)
    return copy


class _NotSent(Exception):
    """This worker could not be reached; the request may go to another one."""


_LEADING_IDS = re.compile(rb'\{\s*"input_ids"\s*:\s*\[[0-9,\s]*\]\s*,')


def _facts_json(body: bytes) -> Any:
    """The body parsed, less a leading `input_ids` array of plain integers (agent-rl's client
    sends the context first): the router needs none of it, and parsing thousands of ids per
    turn was most of its CPU on a long conversation. Anything else is parsed whole."""
    m = _LEADING_IDS.match(body)
    if m is None:
        return json.loads(body)
    return json.loads(b"{" + body[m.end():])
