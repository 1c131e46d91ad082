"""Who may call the router's control endpoints, and where the router may listen.

Worker management and the control fan-out need `Authorization: Bearer <admin token>`. The token
is `[router] admin_token`; unset, empty or blank counts as no token, and then a random one is
generated for the process, which is only allowed on a loopback bind: anywhere else the router
refuses to start, since a token nobody configured is a token no remote caller can know, and an
empty one would be no check at all. The token rules are the API's too
(`agent_rl.config.access`): `Authorization: Bearer` with nothing after it never passes.

`[router] tokenless_control` opens those endpoints without a token, for tools that send none
(slime's rollout lists `GET /workers` and aborts through them). It is refused unless the router
binds a loopback address, where only processes of this machine can reach it.

Every route answers only requests for the router's own Host (and a POST only from no Origin
or an allowed one: `agent_rl.config.access.HostRule`, the web API's rule), so a web page in a
browser on this machine cannot reach the router by DNS rebinding: not the control endpoints,
even in tokenless control mode, and not the proxied routes, which would let it generate with
the engines and read the answers. `own_hosts_only` is that check, as the app's outermost
middleware; a verdict is kept per Host value, so a proxied request pays a dict lookup. A
request with two `Authorization` headers carries no token.
"""

from __future__ import annotations

import secrets

from aiohttp import web

from agent_rl.config import RouterConfig
from agent_rl.config.access import HostRule, bearer_matches, is_loopback, one_header, token_value
from agent_rl.kernel.errors import ConfigError
from router.errors import Handler, Middleware, error_response


def configured_token(config: RouterConfig) -> str | None:
    """`[router] admin_token`, or None when it is unset, empty or only whitespace."""
    return token_value(config.admin_token)


def check_exposure(config: RouterConfig) -> None:
    """Refuse a bind beyond loopback without a configured token, or with tokenless control."""
    if is_loopback(config.host):
        return
    if config.tokenless_control:
        raise ConfigError(
            f"[router] tokenless_control opens /workers and the control endpoints to anyone who "
            f"reaches the router, so it needs a loopback host, and host is {config.host!r}: "
            "bind 127.0.0.1, or turn it off and send the admin token")
    if configured_token(config) is None:
        raise ConfigError(
            f"[router] host is {config.host!r}, not loopback, and admin_token is unset or blank: "
            "set a token (AGENT_RL_ROUTER__ADMIN_TOKEN), which /workers and the control "
            "endpoints then require, or bind 127.0.0.1")


class AdminGuard:
    """The admin token of one router and the wrapper that enforces it."""

    def __init__(self, config: RouterConfig) -> None:
        configured = configured_token(config)
        self.generated = configured is None
        """True when no token was configured and this one was made for the process."""
        self.token = configured or secrets.token_urlsafe(24)
        self.open = config.tokenless_control
        """Tokenless control mode: the wrapper lets every call through (`own_hosts_only` still
        checks its Host)."""

    def allows(self, authorization: str) -> bool:
        return bearer_matches(authorization, self.token)

    def wrap(self, handler: Handler) -> Handler:
        """`handler` behind the token (nothing in tokenless mode); the Host is checked before,
        for every route (`own_hosts_only`)."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            if self.open:
                return await handler(request)
            if not self.allows(one_header(request.headers.getall("Authorization", []))):
                response = error_response(401, "this endpoint needs the router's admin token: "
                                          "send Authorization: Bearer <[router] admin_token>")
                response.headers["WWW-Authenticate"] = 'Bearer realm="agent-rl router"'
                return response
            return await handler(request)

        return guarded


def own_hosts_only(config: RouterConfig) -> Middleware:
    """Middleware answering 421 to a request for another Host than the router's, and 403 to a
    state-changing one from a foreign Origin (`HostRule` on `[router] host` and
    `allowed_hosts`)."""
    rule = HostRule(config.host, config.allowed_hosts)

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        port = sockname[1] if isinstance(sockname, tuple) and len(sockname) > 1 else None
        refused = rule.refusal(request.method, request.headers.getall("Host", []),
                               request.headers.getall("Origin", []), port)
        if refused is not None:
            return error_response(*refused)
        return await handler(request)

    return check
