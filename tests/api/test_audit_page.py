"""The audit page in headless Chromium, on a store filled with known timings (the schedule of
tests/store/test_compute_audit.py): the verdict, the shares table that adds up to 100%, the
stacked bars and the plots are drawn by the server; a screenshot is saved for review
(tests/api/screenshots/11-audit.png). Also `/api/v1/audit`, which the page mirrors."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent_rl.api import create_app
from agent_rl.api.app import EmbeddedServer
from agent_rl.store.migrate import upgrade
from tests._databases import fresh_database
from tests.api.conftest import api_config, in_thread
from tests.api.test_browser import browser, screenshots  # noqa: F401  (fixtures)
from tests.store.test_compute_audit import _fill


@pytest.fixture(scope="module")
def timed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import uvicorn

    from agent_rl.store import Store

    with fresh_database("sqlite", tmp_path_factory.mktemp("audit")) as url:
        async def go() -> None:
            cfg = api_config(url)
            await upgrade(cfg.store)
            async with await Store.open(cfg.store) as store:
                await _fill(store)

        in_thread(go)
        app = create_app(api_config(url, port=0).model_copy(
            update={"run": api_config(url).run.model_copy(update={"name": "timed"})}))
        server = EmbeddedServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the API server did not start"
            time.sleep(0.05)
        try:
            yield f"http://127.0.0.1:{server.port}"
        finally:
            server.should_exit = True
            thread.join(timeout=30)


def test_audit_json(timed_server: str) -> None:
    r = httpx.get(timed_server + "/api/v1/audit", params={"run": "timed"})
    assert r.status_code == 200, r.text
    audit = r.json()
    assert sum(audit["shares"]["cells"].values()) == pytest.approx(1.0)
    assert audit["shares"]["trainer_waiting"] == pytest.approx(0.65)
    assert audit["waste"] == {"generated_tokens": 34, "trained_tokens": 27,
                              "filtered": {"zero_variance": 3}, "failed": {"EngineError": 4},
                              "never_trained": 0, "stale_masked": 2, "wasted": 7}
    assert httpx.get(timed_server + "/api/v1/audit").json()["run"]["name"] == "timed"  # run.name
    missing = httpx.get(timed_server + "/api/v1/audit", params={"run": "nope"})
    assert missing.status_code == 404 and "no run named 'nope'" in missing.json()["detail"]


def test_audit_page_renders(browser: Any, timed_server: str, screenshots: Path) -> None:  # noqa: F811
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(timed_server + "/")
    page.click("header a:text('Audit')")
    page.wait_for_url("**/audit")
    verdict = page.locator("#verdict").inner_text()
    assert verdict.startswith("rollout-bound: the trainer waited 65% of the run")
    rows = page.locator("#shares tbody tr")
    assert rows.count() == 5
    assert [c.strip() for c in rows.nth(2).locator("td").all_inner_texts()] == [
        "waiting", "50.0%", "15.0%", "65.0%"]
    assert rows.nth(4).locator("th").all_inner_texts()[1:] == ["70.0%", "30.0%", "100.0%"]
    segments = page.locator("#time-shares svg rect")
    widths = [float(w) for w in segments.evaluate_all("rs => rs.map(r => r.getAttribute('width'))")]
    assert segments.count() == 6 and sum(widths) == pytest.approx(720, abs=0.5)
    assert "generation 51.4%" in page.locator("#episode-time").inner_text()
    assert "filtered: zero_variance 8.8%" in page.locator("#waste").inner_text()
    assert page.locator("figure.plot svg polyline").count() >= 4  # tok/s x2, running, KV, prefill
    page.screenshot(path=str(screenshots / "11-audit.png"), full_page=True)
    assert errors == []
