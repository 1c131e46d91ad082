"""Who may call a server of ours: bearer tokens and loopback binds, one rule for the web API
and the router.

A token from the config is `BearerToken`: unset, empty or only whitespace is no token at all
(an empty token would be no check), and surrounding whitespace is dropped (a header cannot
carry it). `bearer_matches` takes the credential after `Bearer` and compares it with the token
by `hmac.compare_digest`, never accepting an empty credential, so `Authorization: Bearer` with
nothing after it never passes. A server that binds beyond loopback without a token refuses to
start (`is_loopback` says which binds stay on this machine).
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Annotated

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
