"""The web API and episode viewer as one FastAPI app.

`create_app(config)` opens the Store once in the app's lifespan and closes it at shutdown;
`create_app(config, store=store)` uses a store the caller already holds (what `agent-rl serve`
does to mount the API in-process) and leaves closing it to the caller. JSON lives under
`/api/v1` (OpenAPI at `/openapi.json`), the server-rendered viewer at `/`.

`serve_api(app, config.api)` runs it with uvicorn inside the caller's event loop: start it in
a task group and cancel the group to stop it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from importlib.resources import files
from typing import TYPE_CHECKING, Any

import anyio
import uvicorn
from anyio.abc import TaskStatus
from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.applications import Starlette

from agent_rl.app.api.deps import TokenGate
from agent_rl.app.api.errors import install_error_handlers
from agent_rl.app.api.limits import BodySizeLimit
from agent_rl.app.api.routes import api_router, viewer
from agent_rl.config import ApiConfig, Config
from agent_rl.config.access import HostGuard, HostRule, is_loopback, token_value
from agent_rl.kernel.errors import ConfigError
from agent_rl.store import Store

if TYPE_CHECKING:
    from agent_rl.rollout.runner import RunnerContext

log = logging.getLogger("agent_rl.app.api")
API_PREFIX = "/api/v1"


def create_app(
    config: Config,
    *,
    store: Store | None = None,
    sandboxes: Any = None,
    runner: RunnerContext | None = None,
) -> FastAPI:
    """The API app. Borrowed when given, else the app makes its own: `store`; `sandboxes`, a
    `tools_sandbox.pool.SandboxPool` for replay and fork of sandbox environments; `runner`, the
    `RunnerContext` forks run with (serve's; else one per run on `rollout.router_url`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            if store is None:
                app.state.store = await stack.enter_async_context(await Store.open(config.store))
            else:
                app.state.store = store
            app.state.sandboxes = sandboxes
            if sandboxes is None:
                # Made on first use (most API processes never replay a sandbox episode).
                stack.push_async_callback(_close_sandboxes, app)
            app.state.fork_contexts = {}
            stack.push_async_callback(_close_fork_contexts, app)
            yield

    app = FastAPI(
        title="agent-rl",
        summary="Inspect, replay and fork the episodes of agent-rl runs.",
        version="1",
        lifespan=lifespan,
        # FastAPI's docs pages load their JavaScript from a CDN; the viewer links the spec instead.
        docs_url=None,
        redoc_url=None,
    )
    app.state.config = config
    app.state.store = store
    app.state.sandboxes = sandboxes
    app.state.runner = runner
    app.state.fork_contexts = {}
    install_error_handlers(app)  # first: its catch-all must sit inside the other middleware
    app.add_middleware(BodySizeLimit, max_bytes=config.api.max_request_bytes)
    app.add_middleware(viewer.DropEmptyQueryParams)
    if not is_loopback(config.api.host):
        # Added last, so outermost: no route, spec or static file answers without the token.
        app.add_middleware(TokenGate, token=config.api.token)
    # Outermost: a request for another Host (DNS rebinding) gets nothing, not even a 401.
    app.add_middleware(HostGuard, rule=HostRule(config.api.host, config.api.allowed_hosts))
    app.include_router(api_router, prefix=API_PREFIX)
    app.include_router(viewer.router, include_in_schema=False)
    app.mount(
        "/static", StaticFiles(directory=str(files("agent_rl.app.api") / "static")), name="static"
    )
    return app


async def _close_sandboxes(app: FastAPI) -> None:
    if getattr(app.state, "own_sandboxes", False) and app.state.sandboxes is not None:
        await app.state.sandboxes.aclose()
        app.state.sandboxes = None


async def _close_fork_contexts(app: FastAPI) -> None:
    for ctx in app.state.fork_contexts.values():
        await ctx.client.aclose()
    app.state.fork_contexts = {}


def check_exposure(api: ApiConfig) -> None:
    """Refuse to listen beyond loopback without a token: reads would be open to the network."""
    if not is_loopback(api.host) and token_value(api.token) is None:
        raise ConfigError(
            f"api.host is {api.host}, not loopback, and api.token is unset or blank: set a token "
            "(AGENT_RL_API__TOKEN), which every endpoint then requires, or bind 127.0.0.1"
        )


SHUTDOWN_GRACE_S = 5.0
"""How long a stopping API waits for open requests (an event stream never ends by itself)."""

KEEP_ALIVE_S = 75
"""How long an idle client connection is kept open (uvicorn's default is 5 s). A client that
keeps its pooled connections longer than the server does sometimes sends a request down one the
server is closing, and gets "Server disconnected": httpx (the OpenAI client) keeps them 5 s,
aiohttp 15 s, requests for ever. An agent program idle between two calls to the gateway (a slow
tool) must not meet that, so the server outlasts the usual clients, as nginx's 75 s does."""


async def serve_api(
    app: Starlette, api: ApiConfig, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED
) -> None:
    """Run `app` with uvicorn until cancelled; `task_status.started(port)` once it listens.

    Cancellation is turned into uvicorn's own graceful shutdown (the server task is shielded
    and told to exit), so the socket is closed and the app's lifespan ends before this returns.
    """
    check_exposure(api)
    server = EmbeddedServer(
        uvicorn.Config(
            app,
            host=api.host,
            port=api.port,
            log_level="warning",
            lifespan="on",
            access_log=False,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
    )
    failed: list[str] = []

    async def run() -> None:
        with anyio.CancelScope(shield=True):
            try:
                await server.serve()
            except SystemExit:  # uvicorn exits when it cannot bind or its lifespan failed
                failed.append("exit")

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        try:
            while not server.started:
                if failed:
                    raise ConfigError(
                        f"the API could not start on {api.host}:{api.port} (port in use, or "
                        "the store could not be opened: see the log above)"
                    )
                await anyio.sleep(0.05)
            task_status.started(server.port)
            await anyio.sleep_forever()
        finally:
            server.should_exit = True


class EmbeddedServer(uvicorn.Server):
    """uvicorn's Server without its signal handlers: the host process owns the signals."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    @property
    def port(self) -> int:
        """The port it listens on (the real one when configured as 0)."""
        for s in self.servers:
            for sock in s.sockets:
                return int(sock.getsockname()[1])
        return int(self.config.port)

    @classmethod
    @contextmanager
    def in_thread(cls, app: FastAPI, *, log_level: str = "warning",
                  start_timeout_s: float = 60.0) -> Iterator[EmbeddedServer]:
        """Serve `app` on a free loopback port from a daemon thread until the block ends (what
        tests and benchmarks need: a real HTTP server beside synchronous code)."""
        server = cls(uvicorn.Config(app, host="127.0.0.1", port=0, log_level=log_level))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the API server did not start")
            time.sleep(0.05)
        try:
            yield server
        finally:
            server.should_exit = True
            thread.join(timeout=30)
