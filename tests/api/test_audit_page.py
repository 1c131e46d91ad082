"""The audit page in headless Chromium, on a store filled with known timings (the schedule of
tests/store/test_compute_audit.py): the verdict, the shares table that adds up to 100%, the
stacked bars and the plots are drawn by the server; a screenshot is saved for review
(tests/api/screenshots/11-audit.png). Also `/api/v1/audit`, which the page mirrors, and the
run pages of a training run with two evaluations (the curve with standard errors) and of an
evaluation run, which says so instead of "awaiting training" and "policy version 0"."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent_rl.app.api import create_app
from agent_rl.app.api.app import EmbeddedServer
from agent_rl.store.migrate import upgrade
from tests._databases import fresh_database
from tests.api.conftest import api_config, in_thread
from tests.api.test_browser import browser, screenshots  # noqa: F401  (fixtures)
from tests.store.test_compute_audit import _fill


async def _evaluation(store: Any, of: int, version: int, rewards: list[float]) -> None:
    """An evaluation run of `of` at `version`: two tasks x two samples with these rewards."""
    from agent_rl.store import EpisodeEnd
    from tests.store.helpers import make_turn

    run = await store.ensure_run(f"timed-eval-v{version}", kind="eval", evaluates_run_id=of,
                                 evaluates_version=version)
    for t in range(2):
        task = await store.add_task(run, "calculator", str(t), {})
        _, episodes = await store.admit_group(run, task, "calculator", 2)
        for i, e in enumerate(episodes):
            await store.start_episode(e, "eval")
            await store.end_episode(e, EpisodeEnd("completed", reward=rewards[2 * t + i],
                                                  turn=make_turn(e, version=version)))


@pytest.fixture(scope="module")
def timed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from agent_rl.store import Store

    with fresh_database("sqlite", tmp_path_factory.mktemp("audit")) as url:
        async def go() -> None:
            cfg = api_config(url)
            await upgrade(cfg.store)
            async with await Store.open(cfg.store) as store:
                run = await _fill(store)
                for version, rewards in ((1, [0.0, 1.0, 0.0, 0.0]), (2, [1.0, 1.0, 0.0, 1.0])):
                    await _evaluation(store, run, version, rewards)

        in_thread(go)
        app = create_app(api_config(url, port=0).model_copy(
            update={"run": api_config(url).run.model_copy(update={"name": "timed"})}))
        with EmbeddedServer.in_thread(app) as server:
            yield f"http://127.0.0.1:{server.port}"


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


def test_run_pages_of_a_run_and_its_evaluations(browser: Any, timed_server: str,  # noqa: F811
                                                screenshots: Path) -> None:
    runs = {r["name"]: r for r in httpx.get(timed_server + "/api/v1/runs").json()}
    timed, v1 = runs["timed"], runs["timed-eval-v1"]
    assert (v1["kind"], v1["evaluates_run_id"], v1["evaluates_version"]) == ("eval", timed["id"], 1)
    assert v1["latest_version"] is None and timed["kind"] == "train"
    detail = httpx.get(f"{timed_server}/api/v1/runs/{timed['id']}").json()
    assert [(e["version"], e["mean"]) for e in detail["evaluations"]] == [(1, 0.25), (2, 0.75)]
    assert detail["evaluations"][0]["stderr"] == pytest.approx(0.25)  # tasks 0.5 and 0.0

    page = browser.new_page(viewport={"width": 1360, "height": 900})
    page.goto(f"{timed_server}/runs")
    assert "evaluates v1" in page.locator("table.list").inner_text()
    page.goto(f"{timed_server}/runs/{timed['id']}")
    curve = page.locator("#eval-curve svg")
    assert curve.locator("circle.point").count() == 2 and curve.locator("line.errbar").count() == 2
    lengths = curve.locator("line.errbar").evaluate_all(
        "ls => ls.map(l => l.getAttribute('y1') - l.getAttribute('y2'))")
    assert all(d > 0 for d in lengths)  # bars of +-1 standard error
    assert page.locator("#evaluations tbody tr").count() == 2
    page.screenshot(path=str(screenshots / "12-run-evaluations.png"), full_page=True)

    page.click("#evaluations a:text('timed-eval-v1')")
    page.wait_for_url(f"**/runs/{v1['id']}")
    text = page.locator("main").inner_text()
    assert "Evaluation of run timed at policy version v1" in page.locator("#eval-of").inner_text()
    assert "no trainer consumes this run" in text and "Mean reward 0.250 ± 0.250" in text
    assert "awaiting training" not in text and "in flight" not in text
    assert "Policy versions" not in text and "policy version 0" not in text
    assert page.locator("table.ledger").inner_text().split() == [
        "admitted", "scored", "failed", "running", "waiting", "4", "4", "0", "0", "0"]
    page.screenshot(path=str(screenshots / "13-eval-run.png"), full_page=True)
