"""Secrets in the configuration never leave the process: one redaction for everything the
config turns into text (runs stored with their config, the API and viewer, `config show`, CLI
output, log lines and error messages).

What counts as a secret:
- a `SecretStr` field (`api.token`, `router.admin_token`): pydantic already dumps it masked;
- the password of any URL (`store.url`'s `postgresql://user:PASSWORD@host/db`, a router URL
  with credentials), and URL query parameters named like a password;
- the value of any key whose name says it is a secret (`password`, `token`, `secret`,
  `api_key`, ... see `is_secret_key`), e.g. in `rollout.env_kwargs`;
- the `rollout.env_kwargs` a user names in `rollout.secret_env_kwargs`;
- free-form command lines: the value after an option named like a secret (`--api-key X`,
  `--hf-token=X`), in an argument list (`engine.extra_args`, an agent's command) or in one
  string, and `NAME=value` where NAME is named like one (`OPENAI_API_KEY=sk-...`).

Every config section dumps itself redacted in JSON mode (`Section`'s serializer calls
`redact`), so `cfg.model_dump(mode="json")` is safe to store or print; Python mode keeps the
values, for the process's own use. `redact` also cleans what was stored before this rule
existed, at display time.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "**********"
"""What a secret is replaced with (pydantic's own mask for a `SecretStr`)."""

_SECRET_WORDS = {"password", "passwd", "pwd", "secret", "token", "apikey", "credential",
                 "credentials", "passphrase"}  # fmt: skip
_SECRET_PAIRS = {("api", "key"), ("access", "key"), ("secret", "key"), ("private", "key"),
                 ("auth", "key"), ("client", "secret")}  # fmt: skip
# scheme://user:password@host: the password is everything between the first ':' of the userinfo
# and the last '@' before the host.
_URL_USERINFO = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^\s]*)@"
)
# In a command line: `--name value`, `--name=value` (a value that is not the next option), or
# `NAME=value`; the value a word, or a quoted string.
_OPTION = re.compile(
    r"(?<![\w-])(?P<name>--?[A-Za-z][\w.-]*|[A-Za-z_][\w.-]*(?==))"
    r"(?P<sep>=|\s+)(?P<value>\"[^\"]*\"|'[^']*'|(?!-)[^\s\"']+)"
)


def is_secret_key(key: str) -> bool:
    """Whether a key's name says its value is a secret: its last word is one of `password`,
    `token`, `secret`, ... (`admin_token`, `db_password`), or it ends in `api_key`,
    `access_key`, `secret_key`, `private_key`, `auth_key`, `client_secret`. `max_tokens` and
    `tokenizer` are not secrets."""
    words = [w for w in re.split(r"[_\-.\s]+|(?<=[a-z])(?=[A-Z])", key.lower()) if w]
    if not words:
        return False
    return words[-1] in _SECRET_WORDS or tuple(words[-2:]) in _SECRET_PAIRS


def redact_url(url: str) -> str:
    """`url` with its password and password-like query parameters masked; any other text as
    it is. `postgresql://me:pw@db/x` -> `postgresql://me:**********@db/x`."""
    if "://" not in url:
        return url
    out = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", url)
    try:
        parts = urlsplit(out)
    except ValueError:
        return out
    if parts.query:
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        if any(is_secret_key(k) for k, _ in pairs):
            query = urlencode([(k, MASK if is_secret_key(k) else v) for k, v in pairs], safe="*")
            out = urlunsplit(parts._replace(query=query))
    return out


def redact(value: Any, secret_keys: Iterable[str] = ()) -> Any:
    """A JSON-like value (dicts, lists, strings, numbers) with every secret masked: URL
    passwords in strings, the values of secret-named keys and of `secret_keys`, at any depth."""
    named = set(secret_keys)
    if isinstance(value, str):
        return redact_options(redact_url(value))
    if isinstance(value, dict):
        return {k: (MASK if _masked(k, v, named) else redact(v, named)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = redact_args(value) if all(isinstance(v, str) for v in value) else value
        return [redact(v, named) for v in items]
    return value


def redact_args(args: Iterable[str]) -> list[str]:
    """An argument list with the value of every option named like a secret masked:
    `["--api-key", "X"]` and `["--api-key=X"]` -> `**********` in place of X (a following
    option is not a value: `["--api-key", "--port", "1"]` is kept)."""
    out = list(args)
    for i, arg in enumerate(out):
        name, eq, value = arg.partition("=")
        if not name.startswith("-") or not is_secret_key(name.lstrip("-")):
            continue
        if eq:
            out[i] = f"{name}={MASK}" if value else arg
        elif i + 1 < len(out) and out[i + 1] and not out[i + 1].startswith("-"):
            out[i + 1] = MASK
    return out


def redact_options(text: str) -> str:
    """`text` (a command line, a log line) with the value of every `--option value`,
    `--option=value` and `NAME=value` named like a secret masked."""
    if "=" not in text and "-" not in text:
        return text

    def mask(m: re.Match[str]) -> str:
        if not is_secret_key(m["name"].lstrip("-")) or m["value"] == MASK:
            return m[0]
        return f"{m['name']}{m['sep']}{MASK}"

    return _OPTION.sub(mask, text)


def redact_text(text: str, secrets: Iterable[str | None]) -> str:
    """`text` (an error message, a log line) with URL passwords, secret options' values
    (`redact_options`) and each of `secrets` masked."""
    out = redact_options(redact_url(text) if "://" in text else text)
    for s in secrets:
        if s:
            out = out.replace(s, MASK)
    return out


def holds_mask(value: Any) -> bool:
    """Whether a JSON-like value (a stored config's) had a secret masked anywhere in it: what
    was recorded is not what was used."""
    if isinstance(value, str):
        return MASK in value
    if isinstance(value, dict):
        return any(holds_mask(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_mask(v) for v in value)
    return False


def _masked(key: Any, value: Any, named: set[str]) -> bool:
    if value is None or value == "" or value == MASK:
        return False
    return isinstance(key, str) and (key in named or is_secret_key(key))
