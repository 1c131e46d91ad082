"""A 500 says what failed in one line and nothing of the internals, and keeps the connection.

The faults are real: the store's schema changed under a running API (a column renamed, as a
botched manual migration would), and a tokenizer directory whose tokenizer.json is corrupt.
Before, a database error's body was SQLAlchemy's whole text (the SQL, its parameters, a link to
its docs), and every 500 went through Starlette's outermost layer, which closed the client's
keep-alive connection."""

from __future__ import annotations

import http.client
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from agent_rl.app.api import create_app
from agent_rl.app.api.app import EmbeddedServer
from agent_rl.config import Config, StoreConfig
from agent_rl.store.db import create_database
from tests.api.conftest import LOOPBACK, TOKEN, api_config
from tests.api.fill import Filled

INTERNALS = re.compile(r"SELECT|FROM |WHERE |\[SQL|\[parameters|sqlalche\.me|Background on this|"
                       r"Traceback|File \"|LINE \d")


def break_schema(url: str) -> None:
    db = create_database(StoreConfig(url=url))
    try:
        with db.begin() as conn:
            conn.execute(text("ALTER TABLE episodes RENAME COLUMN reward TO reward_moved"))
            conn.execute(text("ALTER TABLE messages RENAME COLUMN content TO content_moved"))
    finally:
        db.dispose()


def paths(filled: Filled) -> list[tuple[str, str]]:
    e, g, r = filled.calculator[0], filled.groups[0], filled.run_id
    return [
        ("GET", "/api/v1/episodes"), ("GET", "/api/v1/episodes?q=answer"),
        ("GET", f"/api/v1/episodes/{e}"), ("GET", f"/api/v1/groups/{g}"),
        ("GET", "/api/v1/runs"), ("GET", f"/api/v1/runs/{r}"), ("GET", "/api/v1/stats"),
        ("POST", f"/api/v1/episodes/{e}/replay"), ("GET", "/"), ("GET", f"/episodes/{e}"),
        ("GET", f"/groups/{g}"), ("GET", f"/runs/{r}"), ("GET", "/stats"),
    ]


def test_no_sql_in_any_error_body(filled: Filled) -> None:
    break_schema(filled.url)
    with TestClient(create_app(api_config(filled.url)), base_url=LOOPBACK, raise_server_exceptions=False) as client:
        failed = 0
        for method, path in paths(filled):
            r = client.request(method, path, headers={"Authorization": f"Bearer {TOKEN}"})
            if r.status_code < 500:
                continue
            failed += 1
            body = r.json()
            assert set(body) == {"detail"}, (path, r.text)
            detail = body["detail"]
            assert "\n" not in detail and len(detail) <= 500, (path, detail)
            assert not INTERNALS.search(detail), (path, detail)
            assert "reward" in detail or "content" in detail, (path, detail)  # still says what
        assert failed >= 10


@contextmanager
def live(cfg: Config) -> Iterator[int]:
    with EmbeddedServer.in_thread(create_app(cfg), log_level="critical") as server:
        yield server.port


def test_a_500_keeps_the_connection_and_says_only_what_failed(
    filled: Filled, tmp_path: Path
) -> None:
    # A tokenizer that cannot load: an error from a library, not one of agent-rl's.
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "???"}}')
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    cfg = api_config(filled.url, tokenizer=str(tmp_path))
    with live(cfg) as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", f"/api/v1/episodes/{filled.calculator[0]}")
        first = conn.getresponse()
        body = first.read().decode()
        assert first.status == 500, body
        assert body.startswith('{"detail":"internal error: ') and not INTERNALS.search(body)
        sock = conn.sock
        assert sock is not None and first.getheader("connection") != "close"
        conn.request("GET", "/api/v1/runs")  # the same socket, still open
        second = conn.getresponse()
        assert second.status == 200 and conn.sock is sock
        second.read()
        conn.close()


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("CRITICAL", logger="agent_rl.app.api")
