"""Who may call a server of ours: bearer tokens, loopback binds and the Host allow-list, one
rule for the web API and viewer, the agent gateway and the router.

A token from the config is `BearerToken`: unset, empty or only whitespace is no token at all
(an empty token would be no check), and surrounding whitespace is dropped (a header cannot
carry it). `bearer_matches` takes the credential after `Bearer` and compares it with the token
by `hmac.compare_digest`, never accepting an empty credential, so `Authorization: Bearer` with
nothing after it never passes. A server that binds beyond loopback without a token refuses to
start (`is_loopback` says which binds stay on this machine). A request with more than one
`Authorization` header carries no credential (`one_header`): every server reads the same one.

A loopback bind is reachable from this machine's browser too: a web page whose hostname its
attacker points at 127.0.0.1 (DNS rebinding) is same-origin with the server, so it could read
every answer. `HostRule` answers only requests whose `Host` names the server (its bind address,
`localhost`, `127.0.0.1`, `[::1]`, on its port; on a wildcard bind also this machine's host
names and any IP literal, which no rebinding can produce; plus the configured `allowed_hosts`), and a state-changing request only
from no `Origin` (not a browser) or an allowed one. `HostGuard` is that rule as ASGI middleware
(the API, the viewer, the gateway); the router applies it to every route as aiohttp middleware.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import AfterValidator, SecretStr


def _blank_is_none(token: SecretStr | None) -> SecretStr | None:
    if token is None or not token.get_secret_value().strip():
        return None
    return SecretStr(token.get_secret_value().strip())


BearerToken = Annotated[SecretStr | None, AfterValidator(_blank_is_none)]
"""A configured bearer token; unset, empty and blank are all None."""


def token_value(token: SecretStr | None) -> str | None:
    """The token's text, or None when it is unset or blank (also on a config whose validation
    was skipped, e.g. one made by `model_copy`)."""
    checked = _blank_is_none(token)
    return checked.get_secret_value() if checked is not None else None


def bearer_matches(authorization: str, token: str | None) -> bool:
    """Whether an `Authorization` header carries `token` (never when either is empty)."""
    scheme, _, credential = authorization.strip().partition(" ")
    credential = credential.strip()
    if not token or scheme.lower() != "bearer" or not credential:
        return False
    # Servers decode header bytes with surrogateescape; encode them back the same way.
    return hmac.compare_digest(credential.encode("utf-8", "surrogateescape"), token.encode())


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname (or "" for every interface) may resolve anywhere


def one_header(values: Iterable[str]) -> str:
    """The value of a header that must appear once (`Authorization`): "" when it is absent or
    repeated, so that no server picks a different one of two credentials than another."""
    found = list(values)
    return found[0] if len(found) == 1 else ""


def _normalized_hosts(hosts: list[str]) -> list[str]:
    out = []
    for raw in hosts:
        host = raw.strip().lower()
        if host != "*" and _split_host(host) is None:
            raise ValueError(f"{raw!r} is not a host name or address, host:port, or *")
        out.append(host)
    return out


HostList = Annotated[list[str], AfterValidator(_normalized_hosts)]
"""Extra Host header values a server answers: `name` (any port), `name:port`, `[v6]:port`, `*`."""

_WILDCARD_BINDS = {"", "0.0.0.0", "::", "[::]"}
_KEPT_VERDICTS = 1024
_SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def _split_host(value: str) -> tuple[str, int | None] | None:
    """(host, port) of a Host header value, lowercased, IPv6 in brackets; None if malformed."""
    value = value.strip().lower()
    if not value or any(c in value for c in "/@?#\\ \t"):
        return None
    try:
        parts = urlsplit(f"//{value}")
        port = parts.port
    except ValueError:
        return None
    host = parts.hostname or ""
    if not host:
        return None
    return (f"[{host}]" if ":" in host else host), port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


class HostRule:
    """Which `Host` (and, on state-changing requests, `Origin`) a server answers."""

    def __init__(self, bind_host: str, allowed: Sequence[str] = ()) -> None:
        bind = bind_host.strip().lower()
        self.wildcard = bind in _WILDCARD_BINDS
        self.names = {"localhost", "127.0.0.1", "[::1]"}
        if self.wildcard:  # reachable by this machine's own names too
            self.names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        else:
            self.names.add(f"[{bind.strip('[]')}]" if ":" in bind else bind)
        self.any = "*" in allowed
        self._verdicts: dict[tuple[str, int | None], bool] = {}
        self.any_port: set[str] = set()
        self.exact: set[tuple[str, int | None]] = set()
        for entry in allowed:
            split = None if entry == "*" else _split_host(entry)
            if split is not None:
                if split[1] is None:
                    self.any_port.add(split[0])
                else:
                    self.exact.add(split)

    def allows(self, host: str, port: int | None) -> bool:
        """Whether a request for `host` (a Host header value) to a server on `port` (None:
        unknown) is for this server. Verdicts are kept (a server is called by a few Host
        values; the router checks every proxied request), up to `_KEPT_VERDICTS` of them."""
        key = (host, port)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = self._allows(host, port)
            if len(self._verdicts) >= _KEPT_VERDICTS:  # many Hosts: a caller trying names
                self._verdicts.clear()
            self._verdicts[key] = verdict
        return verdict

    def _allows(self, host: str, port: int | None) -> bool:
        if self.any:
            return True
        split = _split_host(host)
        if split is None:
            return False
        name, asked = split
        if name in self.any_port or (name, asked) in self.exact:
            return True
        on_port = port is None or asked == port or (asked is None and port == 80)
        return on_port and (name in self.names or (self.wildcard and _is_ip(name)))

    def refusal(self, method: str, hosts: Sequence[str], origins: Sequence[str],
                port: int | None) -> tuple[int, str] | None:
        """(status, message) for a request this server must not answer, else None: 421 for a
        Host that is not this server's, 403 for a state-changing request from a foreign
        `Origin`. No Host at all (HTTP/1.0) passes; two Host headers do not."""
        if len(hosts) > 1 or (hosts and not self.allows(hosts[0], port)):
            shown = hosts[0][:100] if hosts else ""
            return 421, (f"this server does not answer for Host {shown!r}: add it to the "
                         "server's allowed_hosts if it is how clients reach it")
        if method.upper() in _SAFE_METHODS or not origins:
            return None
        origin = origins[0].strip().lower()
        try:
            parts = urlsplit(origin)
            netloc = parts.netloc
            if parts.port is None and parts.scheme in _DEFAULT_PORTS and netloc:
                netloc += f":{_DEFAULT_PORTS[parts.scheme]}"
        except ValueError:
            netloc = ""
        if len(origins) > 1 or not netloc or not self.allows(netloc, port):
            return 403, (f"cross-origin request from {origin[:100]!r} refused: a state-changing "
                         "request must come from this server's own pages or a non-browser client")
        return None


class HostGuard:
    """`HostRule` as ASGI middleware, in front of everything an app serves; a refusal is JSON,
    `{"detail": message}` or what `body` makes of the message."""

    def __init__(self, app: Any, rule: HostRule,
                 body: Callable[[str], dict[str, Any]] | None = None) -> None:
        self.app, self.rule = app, rule
        self.body = body or (lambda message: {"detail": message})

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            hosts, origins = [], []
            for name, value in scope["headers"]:
                if name == b"host":
                    hosts.append(value.decode("latin-1"))
                elif name == b"origin":
                    origins.append(value.decode("latin-1"))
            server = scope.get("server")
            port = server[1] if server and len(server) > 1 else None
            refused = self.rule.refusal(scope.get("method", "GET"), hosts, origins, port)
            if refused is not None:
                await _refuse(send, refused[0], self.body(refused[1]), scope["type"])
                return
        await self.app(scope, receive, send)


async def _refuse(send: Any, status: int, body: dict[str, Any], kind: str) -> None:
    if kind == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
