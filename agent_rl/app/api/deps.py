"""Dependencies of the API's routes: the store, the config, and the bearer-token checks.

`StoreDep` is the one Store the app's lifespan opened (or the one `serve` lent it); routes
never open their own. Reads are open while the API binds loopback; on any other address they
need the token too (`TokenGate`, in front of everything the app serves). `replay` and `fork`
always need `Authorization: Bearer <api.token>`, and
answer 403 with how to enable them when no token is configured. Two `Authorization` headers
are no credential, for the gate and the routes alike (`one_header`).
"""

from __future__ import annotations

from typing import Annotated, Any

import anyio
from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import SecretStr
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from agent_rl.config import Config
from agent_rl.config.access import bearer_matches, one_header, token_value
from agent_rl.store import Store


def get_store(request: Request) -> Store:
    return request.app.state.store


def get_config(request: Request) -> Config:
    return request.app.state.config


StoreDep = Annotated[Store, Depends(get_store)]
ConfigDep = Annotated[Config, Depends(get_config)]


def bearer_refusal(authorization: str, configured: SecretStr | None) -> tuple[int, str] | None:
    """(status, message) when `authorization` does not carry the configured token, else None."""
    token = token_value(configured)
    if token is None:
        return 403, ("this endpoint is disabled: set api.token (AGENT_RL_API__TOKEN) to enable "
                     "it, then send Authorization: Bearer <token>")
    if not bearer_matches(authorization, token):
        return 401, "missing or wrong bearer token: send Authorization: Bearer <api.token>"
    return None


def _check_bearer(request: Request, cfg: Config) -> None:
    refused = bearer_refusal(one_header(request.headers.getlist("authorization")), cfg.api.token)
    if refused is not None:
        raise HTTPException(refused[0], refused[1], headers={"WWW-Authenticate": "Bearer"})


class TokenGate:
    """On a bind beyond loopback, every request needs the token before anything answers: the
    API, the viewer, `/openapi.json` and `/static` alike (ASGI middleware)."""

    def __init__(self, app: ASGIApp, token: SecretStr | None) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = one_header(v.decode("latin-1") for k, v in scope["headers"]
                                if k == b"authorization")
            refused = bearer_refusal(header, self.token)
            if refused is not None:
                response = JSONResponse({"detail": refused[1]}, status_code=refused[0],
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def require_token(request: Request, cfg: ConfigDep) -> None:
    """Mutating endpoints: the configured bearer token, always."""
    _check_bearer(request, cfg)


TokenDep = Annotated[None, Depends(require_token)]


async def sandbox_pool(app: FastAPI) -> Any:
    """The app's sandbox pool (for replay and fork of sandbox environments): the one `serve`
    lent it, else one over a backend made from `config.sandbox` on first use and closed with
    the app (capped and paced by the same keys; it keeps no warm sandboxes). It does not reap:
    a serve process may own live sandboxes in the same state directory."""
    if app.state.sandboxes is None:
        from tools_sandbox.factory import make_backend
        from tools_sandbox.pool import SandboxPool

        config = app.state.config.sandbox
        backend = await anyio.to_thread.run_sync(make_backend, config)
        app.state.sandboxes = SandboxPool(backend, config)
        app.state.own_sandboxes = True
    return app.state.sandboxes
