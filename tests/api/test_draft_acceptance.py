"""An MTP draft's acceptance per policy version (issue 21): `/api/v1/runs/{id}` gives it as
`draft_acceptance`, read from the metrics the learner records with each version, and the run
page shows it (headless Chromium): a curve of draft 1's acceptance by version and a table of
every depth and the expected accepted length. A run without MTP metrics has neither."""

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

# What two drafts' steps record (trainer/learner.py), and one version whose step had none.
STEPS: list[dict[str, Any]] = [
    {"loss": 0.5, "mtp_acceptance_1": 0.25, "mtp_acceptance_2": 0.125, "mtp_accept_length": 0.3},
    {"loss": 0.4, "mtp_acceptance_1": 0.5, "mtp_acceptance_2": 0.25, "mtp_accept_length": 0.6},
    {"loss": 0.3},
    {"loss": 0.2, "mtp_acceptance_1": 0.75, "mtp_acceptance_2": float("nan")},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, int]]]:
    from agent_rl.store import Store

    runs: dict[str, int] = {}
    with fresh_database("sqlite", tmp_path_factory.mktemp("drafts")) as url:
        async def go() -> None:
            cfg = api_config(url)
            await upgrade(cfg.store)
            async with await Store.open(cfg.store) as store:
                for name, steps in (("drafted", STEPS), ("plain", [{"loss": 1.0}])):
                    runs[name] = run = await store.ensure_run(name)
                    for step, metrics in enumerate(steps, start=1):
                        claim = await store.claim(run, "trainer", 0)
                        await store.commit(claim, run, step=step, version=step, metrics=metrics)

        in_thread(go)
        with EmbeddedServer.in_thread(create_app(api_config(url, port=0))) as srv:
            yield f"http://127.0.0.1:{srv.port}", runs


def test_the_run_api_gives_the_acceptance_per_version(server: tuple[str, dict[str, int]]) -> None:
    url, runs = server
    detail = httpx.get(f"{url}/api/v1/runs/{runs['drafted']}").json()
    assert detail["draft_acceptance"] == [
        {"version": 1, "acceptance": [0.25, 0.125], "accept_length": 0.3},
        {"version": 2, "acceptance": [0.5, 0.25], "accept_length": 0.6},
        # A non-finite depth ends the list; a missing length is null.
        {"version": 4, "acceptance": [0.75], "accept_length": None},
    ]
    assert httpx.get(f"{url}/api/v1/runs/{runs['plain']}").json()["draft_acceptance"] == []


def test_the_run_page_shows_the_acceptance(browser: Any, server: tuple[str, dict[str, int]],  # noqa: F811
                                           screenshots: Path) -> None:  # noqa: F811
    url, runs = server
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{url}/runs/{runs['drafted']}")
    table = page.locator("#draft-acceptance")
    assert table.locator("thead th").all_inner_texts() == [
        "policy version", "draft 1 acceptance", "draft 2 acceptance", "expected accepted drafts"]
    assert [r.split("\t") for r in table.locator("tbody tr").all_inner_texts()] == [
        ["v1", "0.250", "0.125", "0.300"], ["v2", "0.500", "0.250", "0.600"],
        ["v4", "0.750", "–", "–"]]
    curve = page.locator("#draft-curve")
    assert "last 0.750 · 3 versions" in curve.locator("figcaption").inner_text()
    points = curve.locator("polyline").get_attribute("points").split()
    ys = [float(p.split(",")[1]) for p in points]
    assert len(points) == 3 and ys[0] > ys[1] > ys[2]  # acceptance rising: SVG y points down
    page.locator("#draft-curve").scroll_into_view_if_needed()
    page.screenshot(path=str(screenshots / "14-draft-acceptance.png"), full_page=True)
    page.goto(f"{url}/runs/{runs['plain']}")
    assert page.locator("#draft-acceptance").count() == 0 and "Draft acceptance" not in page.content()
    assert errors == []
