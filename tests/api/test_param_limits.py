"""Every number and cursor the API accepts, fuzzed to its limits, on SQLite and PostgreSQL: the
answer is never a 5xx (each used to be a 500 that closed the connection: `?group=2147483648`
overflowed PostgreSQL's 32-bit ids; cursors with `"i": true`, an id of 2^31 or 2^63, or a key
of 1e400 reached the database).

The operations and their integer and number parameters are read from `/openapi.json`, so a new
parameter is fuzzed without touching this file; the viewer's pages (not in the spec) take the
same ids and the same episode query, and are fuzzed alongside. Values are drawn around each
declared bound, around every integer width a database or driver has (32, 53, 63, 64 bits), and
as free integers and odd strings. Cursors are well-formed base64 of JSON objects whose fields
take any JSON value, plus raw text."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_rl.app.api import create_app
from agent_rl.app.api.filters import Sort
from tests.api.conftest import LOOPBACK, TOKEN, api_config
from tests.api.fill import Filled

pytestmark = pytest.mark.slow  # a few hundred requests per database

WIDTHS = [2**31, 2**32, 2**53, 2**63, 2**64, 10**30]
EDGES = sorted({0, 1, -1, *(w + d for w in WIDTHS for d in (-1, 0, 1)), *(-w for w in WIDTHS),
                -(2**63) - 1, -(2**31) - 1})
ODD = ["", " ", "1.5", "1e3", "0x10", "1_000", "+1", "-0", "nan", "inf", "-inf", "1e309", "true",
       "9" * 400, "\u0661", "NaN"]
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def integer_params(spec: dict[str, Any]) -> list[tuple[str, str, str, dict[str, Any]]]:
    """(method, path, parameter, its schema) for every integer or number parameter."""
    out = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            for p in op.get("parameters", []):
                schema = next(
                    (s for s in p["schema"].get("anyOf", [p["schema"]])
                     if s.get("type") in ("integer", "number")), None,
                )
                if schema is not None:
                    out.append((method, path, f"{p['in']}:{p['name']}", schema))
    return out


def values_for(schema: dict[str, Any]) -> st.SearchStrategy[str]:
    bounds = [b + d for k in ("minimum", "maximum") if k in schema for b in [schema[k]]
              for d in (-1, 0, 1)]
    ints = st.sampled_from(EDGES + bounds) | st.integers()
    floats = st.floats(allow_nan=True, allow_infinity=True).map(repr)
    return ints.map(str) | floats | st.sampled_from(ODD)


@pytest.fixture
def app_client(filled: Filled) -> Any:
    with TestClient(create_app(api_config(filled.url)), base_url=LOOPBACK, raise_server_exceptions=False) as c:
        yield c


def call(client: TestClient, method: str, path: str, params: dict[str, str],
         headers: dict[str, str]) -> Any:
    r = client.request(method, path, params=params, headers={**AUTH, **headers})
    assert r.status_code < 500, (method, r.url, headers, r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert set(r.json()) == {"detail"}, r.text[:500]
    return r


def test_no_integer_parameter_is_a_5xx(app_client: TestClient, filled: Filled) -> None:
    spec = app_client.get("/openapi.json").json()
    targets = integer_params(spec)
    assert {t[2] for t in targets} >= {"path:episode_id", "path:group_id", "path:run_id",
                                        "query:group", "query:min_version", "query:limit",
                                        "query:turn", "header:last-event-id"}
    # The viewer's pages take the same ids and the same episode query as the JSON API.
    episodes_query = [t for t in targets if t[1] == "/api/v1/episodes"]
    targets += [("get", "/", name, schema) for _, _, name, schema in episodes_query]
    targets += [("get", path, "path:" + key, {"minimum": 0, "maximum": 2**31 - 1})
                for path, key in [("/episodes/{episode_id}", "episode_id"),
                                  ("/groups/{group_id}", "group_id"), ("/runs/{run_id}", "run_id")]]
    finished = filled.calculator[0]
    defaults = {"episode_id": finished, "group_id": filled.groups[0], "run_id": filled.run_id}
    # A fork of a real episode needs an engine (503 by design) and the event stream of a
    # running one never ends: both get only ids that validation or a 404 must answer.
    no_real_id = {"/api/v1/episodes/{episode_id}/fork", "/api/v1/episodes/{episode_id}/events"}

    @given(target=st.sampled_from(targets), data=st.data())
    @settings(max_examples=400, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(target: tuple[str, str, str, dict[str, Any]], data: st.DataObject) -> None:
        method, path, name, schema = target
        where, _, key = name.partition(":")
        value = data.draw(values_for(schema))
        params: dict[str, str] = {"turn": "0"} if path.endswith("/fork") else {}
        headers: dict[str, str] = {}
        ids = dict(defaults)
        if path in no_real_id:
            ids["episode_id"] = 2**31 - 1
            if where == "path" and _is_int(value) and 0 < int(value) < 2**31 - 1:
                value = str(2**31 - 1)
        if where == "path":
            ids[key] = value  # type: ignore[assignment]
        elif where == "query":
            params[key] = value
        else:
            headers[key] = value if value.isascii() else "x"  # HTTP headers are ASCII
        call(app_client, method.upper(), path.format(**ids), params, headers)

    check()


def _is_int(value: str) -> bool:
    try:
        int(value)
    except ValueError:
        return False
    return True


JSON = st.recursive(
    st.none() | st.booleans() | st.sampled_from(EDGES).map(int) | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


def b64(obj: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")


def test_no_cursor_is_a_5xx(app_client: TestClient) -> None:
    sorts = list(Sort.__args__)  # type: ignore[attr-defined]
    fields = st.fixed_dictionaries(
        {"s": st.sampled_from(sorts) | JSON, "k": JSON, "i": JSON},
        optional={"x": JSON},
    )
    cursors = fields.map(b64) | st.text(max_size=250) | st.binary(max_size=150).map(
        lambda b: base64.urlsafe_b64encode(b).decode())

    paths = st.sampled_from(["/api/v1/episodes", "/"])

    @given(cursor=cursors, sort=st.sampled_from(sorts), path=paths)
    @settings(max_examples=300, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(cursor: str, sort: str, path: str) -> None:
        try:
            s = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))["s"]
            sort = s if s in sorts else sort  # the same sort, so the fields are looked at
        except Exception:
            pass
        call(app_client, "GET", path, {"cursor": cursor, "sort": sort, "limit": "2"}, {})

    check()


@pytest.mark.parametrize("fields", [
    {"s": "-id", "k": None, "i": True},
    {"s": "-id", "k": None, "i": 2**31},
    {"s": "-id", "k": None, "i": 2**63},
    {"s": "-id", "k": None, "i": -1},
    {"s": "-id", "k": 1.0, "i": 3},
    {"s": "reward", "k": float("nan"), "i": 3},
    {"s": "reward", "k": 1.5e300, "i": 3},
    {"s": "reward", "k": False, "i": 3},
    {"s": "reward", "k": "1", "i": 3},
    {"s": ["-id"], "k": None, "i": 3},
    {"s": "-id", "k": None, "i": 3, "extra": 1},
])
def test_crafted_cursors_are_400(app_client: TestClient, fields: dict[str, Any]) -> None:
    sort = fields["s"] if isinstance(fields["s"], str) else "-id"
    r = call(app_client, "GET", "/api/v1/episodes", {"cursor": b64(fields), "sort": sort}, {})
    assert r.status_code == 400 and "invalid cursor" in r.json()["detail"]


def test_the_cursors_the_api_makes_still_walk_every_page(app_client: TestClient) -> None:
    for sort in ("-id", "reward", "-finished_at"):
        seen, cursor = [], None
        while True:
            params = {"sort": sort, "limit": "2", **({"cursor": cursor} if cursor else {})}
            page = call(app_client, "GET", "/api/v1/episodes", params, {}).json()
            seen += [e["id"] for e in page["items"]]
            if not (cursor := page["next_cursor"]):
                break
        everything = call(app_client, "GET", "/api/v1/episodes",
                          {"sort": sort, "limit": "1000"}, {}).json()["items"]
        assert seen == [e["id"] for e in everything]
