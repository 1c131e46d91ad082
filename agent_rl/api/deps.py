"""Dependencies of the API's routes: the store, the config, and the bearer-token checks.

`StoreDep` is the one Store the app's lifespan opened (or the one `serve` lent it); routes
never open their own. Reads are open while the API binds loopback; on any other address they
need the token too. `replay` and `fork` always need `Authorization: Bearer <api.token>`, and
answer 403 with how to enable them when no token is configured.
"""

from __future__ import annotations

import ipaddress
import secrets
from typing import Annotated, Any

import anyio
from fastapi import Depends, FastAPI, HTTPException, Request, status

from agent_rl.config import Config
from agent_rl.store import Store


def get_store(request: Request) -> Store:
    return request.app.state.store


def get_config(request: Request) -> Config:
    return request.app.state.config


StoreDep = Annotated[Store, Depends(get_store)]
ConfigDep = Annotated[Config, Depends(get_config)]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_bearer(request: Request, cfg: Config) -> None:
    token = cfg.api.token
    if token is None:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            "this endpoint is disabled: set api.token (AGENT_RL_API__TOKEN) to enable it, "
            "then send Authorization: Bearer <token>",
        )
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(
        given.strip().encode(), token.get_secret_value().encode()
    ):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing or wrong bearer token: send Authorization: Bearer <api.token>",
            headers={"WWW-Authenticate": "Bearer"},
        )


def require_token(request: Request, cfg: ConfigDep) -> None:
    """Mutating endpoints: the configured bearer token, always."""
    _check_bearer(request, cfg)


def read_access(request: Request, cfg: ConfigDep) -> None:
    """Read endpoints: open on loopback, the bearer token elsewhere."""
    if not is_loopback(cfg.api.host):
        _check_bearer(request, cfg)


TokenDep = Annotated[None, Depends(require_token)]


async def sandbox_backend(app: FastAPI) -> Any:
    """The app's tools_sandbox backend (for replay and fork of sandbox environments): the one
    `serve` lent it, else one made from `config.sandbox` on first use and closed with the app.
    It does not reap: a serve process may own live sandboxes in the same state directory."""
    if app.state.sandboxes is None:
        from tools_sandbox.factory import make_backend

        app.state.sandboxes = await anyio.to_thread.run_sync(make_backend, app.state.config.sandbox)
        app.state.own_sandboxes = True
    return app.state.sandboxes
