"""The viewer in headless Chromium (Debian's `chromium`, driven by Playwright): open the list,
filter it, open an episode, expand a tool call, see the token strip. A screenshot of each page
is saved under $AGENT_RL_SCREENSHOTS (default tests/api/screenshots/) for review. In CI
(CI=true) a missing browser is a failure, not a skip."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api.conftest import LiveServer

CHROMIUM = os.environ.get("AGENT_RL_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _missing(what: str) -> None:
    message = f"{what}: install Debian's chromium (apt-get install -y chromium) and the test extra"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def screenshots() -> Path:
    out = Path(os.environ.get("AGENT_RL_SCREENSHOTS") or Path(__file__).parent / "screenshots")
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed")
    if not (Path(CHROMIUM).is_file() or shutil.which(CHROMIUM)):
        _missing(f"no Chromium at {CHROMIUM}")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def test_list_filter_episode_tool_call_and_token_strip(
    browser: Any, live_server: LiveServer, screenshots: Path
) -> None:
    filled = live_server.filled
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(live_server.url + "/")
    rows = page.locator("#episodes tbody tr")
    assert rows.count() == 7
    page.screenshot(path=str(screenshots / "01-episodes.png"), full_page=True)

    page.select_option("select[name=has_tool_error]", "true")
    page.fill("input[name=env]", "calculator")
    page.click("form.filters button[type=submit]")
    page.wait_for_url("**has_tool_error=true**")
    assert rows.count() == 1 and rows.first.locator("td").first.inner_text().strip() == str(
        filled.bad
    )
    page.screenshot(path=str(screenshots / "02-filtered.png"), full_page=True)

    page.select_option("select[name=has_tool_error]", "")
    page.fill("input[name=env]", "")
    page.select_option("select[name=status]", "trained")
    page.click("form.filters button[type=submit]")
    page.wait_for_url("**status=trained**")
    assert rows.count() == 2
    page.click(f"#episodes a[href$='/episodes/{filled.calculator[0]}']")
    page.wait_for_url(f"**/episodes/{filled.calculator[0]}")
    call = page.locator("details.toolcall").first
    assert not call.evaluate("d => d.open") and not call.locator("pre").first.is_visible()
    page.screenshot(path=str(screenshots / "03-episode.png"), full_page=True)

    call.locator("summary").click()
    assert call.evaluate("d => d.open") and call.locator("pre").first.is_visible()
    assert "expression" in call.locator("pre").first.inner_text()
    call.scroll_into_view_if_needed()
    page.screenshot(path=str(screenshots / "04-tool-call.png"))

    strip = page.locator("#token-strip")
    strip.scroll_into_view_if_needed()
    assert strip.locator(".tok").count() > 20 and strip.locator(".tok.m").count() > 0
    assert strip.locator(".mark.version").count() == 2  # v0 then v1
    first_model = strip.locator(".tok:not(.m)").first
    assert "logprob=" in first_model.get_attribute("title")
    first_model.click()
    assert "logprob=" in page.locator("#token-detail").inner_text()
    strip.screenshot(path=str(screenshots / "05-token-strip.png"))

    page.click(f"a[href$='/groups/{filled.groups[0]}']")
    page.wait_for_url("**/groups/*")
    assert page.locator(".card").count() == 2
    page.screenshot(path=str(screenshots / "06-group.png"), full_page=True)
    page.goto(f"{live_server.url}/runs/{filled.run_id}")
    assert page.locator("figure.plot svg polyline").count() == 2
    page.screenshot(path=str(screenshots / "07-run.png"), full_page=True)
    page.goto(f"{live_server.url}/stats")
    assert page.locator("#ledger").is_visible()
    page.screenshot(path=str(screenshots / "08-stats.png"), full_page=True)
    assert errors == []


def test_replay_button_uses_the_token(
    browser: Any, live_server: LiveServer, screenshots: Path
) -> None:
    from tests.api.conftest import TOKEN

    page = browser.new_page(viewport={"width": 1360, "height": 900})
    page.goto(f"{live_server.url}/episodes/{live_server.filled.calculator[1]}")
    page.fill("#api-token", "wrong")
    page.click("#replay-form button")
    page.wait_for_function("document.getElementById('replay-status').textContent.includes('401')")
    page.fill("#api-token", TOKEN)
    page.click("#replay-form button")
    page.wait_for_selector("#replay-status .diff-ok", timeout=30_000)
    assert "replayed 1" in page.locator("#replay-result").inner_text()
    page.locator("#actions").screenshot(path=str(screenshots / "09-replay.png"))
    # This server has no engine (rollout.router_url unset): the fork button says so.
    page.click("#fork-button")
    page.wait_for_function("document.getElementById('replay-status').textContent.includes('503')")
    assert "rollout.router_url" in page.locator("#replay-status").inner_text()


def test_a_running_episode_page_follows_its_events(
    browser: Any, live_server: LiveServer, screenshots: Path
) -> None:
    """Last in this module: it finishes the store's running episode."""
    from agent_rl.store import Store
    from tests.api.conftest import api_config, in_thread
    from tests.store.helpers import make_turn

    episode = live_server.filled.running
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    page.goto(f"{live_server.url}/episodes/{episode}")
    assert page.locator("#live").is_visible()
    page.wait_for_timeout(1500)  # the stream's replay of turns 0 and 1 must not reload the page
    assert (
        page.locator("#live").is_visible() and page.locator("h1 .status").inner_text() == "running"
    )

    async def finish() -> None:
        async with await Store.open(api_config(live_server.filled.url).store) as store:
            await store.append_turn(episode, make_turn(7), final_reward=1.0)

    in_thread(finish)
    page.wait_for_function(
        "document.querySelector('h1 .status').textContent === 'completed'", timeout=30_000
    )
    assert page.locator("#token-strip .mark.turn").count() == 3
    page.screenshot(path=str(screenshots / "10-live-episode.png"))
