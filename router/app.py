"""The router process: an aiohttp server in front of SGLang workers.

`Router` owns everything with a lifetime: the proxy's keep-alive connection pool to the workers,
the aiohttp session for health checks and control calls (both created at start), the
health-check task, the listening socket. Use it as an async context manager, in
its own process (`agent-rl router`) or embedded in another (`agent-rl serve`):

    async with Router(config.router, workers=["http://127.0.0.1:30000"]) as router:
        ...  # router.url, router.admin_token

Endpoints (details in docs/router.md): proxied `/generate` and the OpenAI-compatible `/v1` routes
SGLang serves (`PROXIED`; stored responses by id are looked up on every worker); `/health`,
`/metrics`; and, behind the bearer token (router/auth.py), `/workers` (GET/POST/DELETE) and the
control fan-out (`/abort_request`, `/pause_generation`, `/continue_generation`, `/flush_cache`,
`/update_weights_from_disk`, `/begin_weight_update`, `/end_weight_update`, ...). `/v1/loads`
and `/model_info` are read-only and open. Every route answers only the router's own Host
(router/auth.py: DNS rebinding). Every error the router makes itself, unknown routes and wrong
methods included, has one JSON shape (router/errors.py).

Why this stack: measured with a 50 ms stub engine at 256 concurrent requests, aiohttp's server
beat Starlette/uvicorn, an httpx client collapsed under pool contention, and aiohttp's own
client was over half the CPU of a proxied request, hence `agent_rl/kernel/http1.py` (docs/router.md).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry.trace import TracerProvider

from agent_rl.config import RouterConfig
from agent_rl.kernel.errors import ConfigError
from router.auth import AdminGuard, check_exposure, own_hosts_only
from router.balance import Balancer
from router.control import Control
from router.errors import error_response, json_errors
from router.health import Health
from router.metrics import RouterMetrics, RouterTracer
from router.proxy import Proxy
from router.stored import Stored
from agent_rl.kernel.http1 import Upstream
from router.workers import WorkerPool

log = logging.getLogger("agent_rl.router")

# SGLang serves HTTP with uvicorn, which closes idle keep-alive connections after 5 s. Dropping
# ours first means a pooled connection is never reused just as the worker closes it (which would
# surface as a reset after the request was sent, an error that must not be retried).
_UPSTREAM_KEEPALIVE_S = 4.0

# Forwarded to one worker: SGLang's native generation and the OpenAI-compatible routes it serves
# (with its /v1 extensions and the Anthropic-compatible /v1/messages), with the methods it takes.
PROXIED = {
    "/generate": ("POST", "PUT"),
    "/v1/chat/completions": ("POST",),
    "/v1/completions": ("POST",),
    "/v1/responses": ("POST",),
    "/v1/embeddings": ("POST",),
    "/v1/audio/transcriptions": ("POST",),
    "/v1/models": ("GET",),
    "/v1/models/{model:.+}": ("GET",),
    "/v1/tokenize": ("POST",),
    "/v1/detokenize": ("POST",),
    "/v1/classify": ("POST",),
    "/v1/score": ("POST",),
    "/v1/rerank": ("POST", "PUT"),
    "/v1/messages": ("POST",),
    "/v1/messages/count_tokens": ("POST",),
}
# SGLang keeps a stored response on the worker that made it: these ask every worker.
STORED = {
    "/v1/responses/{response_id}": ("GET",),
    "/v1/responses/{response_id}/cancel": ("POST",),
}
BROADCAST = (
    "/pause_generation", "/continue_generation", "/update_weight_version",
    "/update_weights_from_distributed", "/destroy_weights_update_group",
)
PER_WORKER = ("/init_weights_update_group", "/update_weights_from_tensor")


class Router:
    """The metadata-preserving router; start it with `async with` or `start()`/`stop()`."""

    def __init__(
        self,
        config: RouterConfig,
        workers: list[str] | None = None,
        *,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        self.config = config
        self.guard = AdminGuard(config)
        self.admin_token = self.guard.token
        """Bearer token for admin endpoints: from config, or generated for this process."""
        self.token_generated = self.guard.generated
        self.pool = WorkerPool(list(config.workers) + list(workers or []))
        self.metrics = RouterMetrics()
        self.balancer = Balancer(config)
        self.health = Health(config, self.pool, self.metrics)
        self._client: aiohttp.ClientSession | None = None
        self.upstream = Upstream(config.connect_timeout_s, _UPSTREAM_KEEPALIVE_S)
        self.proxy = Proxy(config, self.pool, self.balancer, self.health, self.metrics,
                           RouterTracer(tracer_provider), self.upstream)
        self.stored = Stored(config, self.pool, self.metrics, self.upstream)
        self.control = Control(config, self.pool, self.proxy, self.client)
        self.health.before_restore = self.control.bring_up_to_date
        self._runner: web.AppRunner | None = None
        self._background: list[asyncio.Task[None]] = []
        self.port: int = config.port

    # -- lifetime ----------------------------------------------------------------------------

    def client(self) -> aiohttp.ClientSession:
        if self._client is None:
            raise RuntimeError("router not started: use `async with Router(...)`")
        return self._client

    @property
    def url(self) -> str:
        host = self.config.host if self.config.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        check_exposure(self.config)
        # For health checks and control calls; proxied requests use self.upstream.
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=_UPSTREAM_KEEPALIVE_S),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        for worker in self.pool:
            self.metrics.healthy.labels(worker.url).set(1)
        # Versions are read in the background: a worker that is down or wedged at start must not
        # keep the router from serving the others (its health checks will quarantine it).
        self._background.append(asyncio.create_task(self._refresh_versions()))
        self.health.start(self._client)
        self._runner = web.AppRunner(
            self.build_app(), handle_signals=False, access_log=None,
            # A caller that disconnects cancels its upstream request, so SGLang aborts the
            # generation instead of finishing it for nobody.
            handler_cancellation=True,
        )
        await self._runner.setup()
        # A deep backlog: at hundreds of concurrent callers the default (128) drops SYNs, and a
        # dropped SYN costs the caller a one-second retransmit.
        site = web.TCPSite(self._runner, self.config.host, self.config.port, backlog=2048)
        try:
            await site.start()
        except OSError as e:
            await self.stop()
            raise ConfigError(f"router cannot listen on {self.config.host}:{self.config.port}: "
                              f"{e.strerror}; pick another [router] port") from e
        sockets = site._server.sockets if site._server is not None else []  # type: ignore[union-attr]
        if sockets:
            self.port = sockets[0].getsockname()[1]
        log.info("router listening on %s with %d workers", self.url, len(self.pool))

    async def _refresh_versions(self) -> None:
        await asyncio.gather(*(self.control.refresh_version(w) for w in self.pool))

    async def stop(self) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self._background.clear()
        await self.health.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.upstream.close()
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def __aenter__(self) -> Router:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- routes ------------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_mb * 1024 * 1024,
                              middlewares=[own_hosts_only(self.config), json_errors])
        r = app.router
        for path, methods in PROXIED.items():
            for method in methods:
                r.add_route(method, path, self.proxy.handle)
        for path, methods in STORED.items():
            for method in methods:
                r.add_route(method, path, self.stored.handle)
        r.add_get("/health", self.health_endpoint)
        r.add_get("/metrics", self.metrics_endpoint)
        r.add_get("/v1/loads", self.control.loads)
        r.add_get("/model_info", self.control.model_info)
        r.add_get("/get_model_info", self.control.model_info)
        admin = self.guard.wrap
        r.add_get("/workers", admin(self.list_workers))
        r.add_post("/workers", admin(self.add_worker))
        r.add_delete("/workers", admin(self.remove_worker))
        r.add_post("/abort_request", admin(self.control.abort))
        r.add_post("/update_weights_from_disk", admin(self.control.update_from_disk))
        r.add_post("/begin_weight_update", admin(self.control.begin_update))
        r.add_post("/end_weight_update", admin(self.control.end_update))
        r.add_post("/restore_point", admin(self.control.restore_point))
        for path in BROADCAST:
            r.add_post(path, admin(self.control.broadcast))
        r.add_route("*", "/flush_cache", admin(self.control.broadcast))
        for path in PER_WORKER:
            r.add_post(path, admin(self.per_worker_only))
        return app

    async def health_endpoint(self, request: web.Request) -> web.Response:
        healthy = sum(1 for w in self.pool if not w.quarantined)
        body = {"healthy_workers": healthy, "workers": len(self.pool)}
        return web.json_response(body, status=200 if healthy else 503)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def list_workers(self, request: web.Request) -> web.Response:
        return web.json_response({"workers": [w.describe() for w in self.pool]})

    async def add_worker(self, request: web.Request) -> web.Response:
        url = await _worker_url(request)
        if url is None:
            return error_response(400, 'give the worker as JSON {"url": "http://host:port"} '
                                  "or ?url=http://host:port")
        try:
            worker, created = self.pool.add(url)
        except ConfigError as e:
            return error_response(400, str(e))
        if created:
            # Probe before the caller learns it was added, so a dead URL shows as unhealthy; a
            # worker joining a fleet that took weight updates serves only once it has the newest.
            behind = self.control.last_update is not None
            await self.health.admit(self.client(), worker, behind=behind)
            if not behind:
                await self.control.refresh_version(worker)
        return web.json_response({"added": created, "worker": worker.describe()},
                                 status=201 if created else 200)

    async def remove_worker(self, request: web.Request) -> web.Response:
        url = await _worker_url(request)
        worker = self.pool.remove(url) if url else None
        if worker is None:
            return error_response(404, f"no worker {url!r}; GET /workers lists them")
        self.balancer.forget_worker(worker.url)
        self.metrics.forget(worker.url)
        return web.json_response({"removed": worker.describe()})

    async def per_worker_only(self, request: web.Request) -> web.Response:
        return error_response(
            400, f"{request.path} carries a per-worker payload (tensors or a rank offset): send "
            "it to each worker directly (GET /workers lists them), between POST "
            "/begin_weight_update and /end_weight_update on the router")


async def _worker_url(request: web.Request) -> str | None:
    if "url" in request.query:
        return request.query["url"]
    if request.can_read_body:
        try:
            payload: Any = await request.json()
        except ValueError:
            return None
        if isinstance(payload, dict) and isinstance(payload.get("url"), str):
            return payload["url"]
    return None
