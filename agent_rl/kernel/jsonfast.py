"""JSON on the hot paths (the agent gateway's requests and answers, the engine's `/generate`),
through orjson, with the standard library's behaviour kept at the edges.

orjson parses and writes these bodies in a third to a tenth of `json`'s time (an engine answer
with its logprobs ~17 -> ~7 us, a Responses answer ~13 -> ~1 us), and a gateway call makes four
of them. Where orjson refuses what `json` accepts (NaN and Infinity, integers past 64 bits,
lone surrogates), the standard library does it instead, so what parses and what is written is
what it was; orjson writes UTF-8 rather than `\\u` escapes, the same JSON.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def loads(data: bytes | str) -> Any:
    """`json.loads(data)`: a `ValueError` (`json.JSONDecodeError`) for what is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def dumps(value: Any) -> bytes:
    """Compact JSON of `value` (plain data: dicts with string keys, lists, str, numbers, bools,
    None)."""
    try:
        return orjson.dumps(value)
    except TypeError:  # an integer past 64 bits, a lone surrogate: json writes those
        return json.dumps(value, separators=(",", ":")).encode()
