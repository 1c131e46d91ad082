"""Live events of a running episode (SSE) and the viewer's server-rendered pages."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import anyio
from fastapi.testclient import TestClient

from agent_rl.app.api import create_app
from agent_rl.app.api.tokens import load_tokenizer
from agent_rl.store import Store
from tests.api.conftest import LOOPBACK, api_config
from tests.api.fill import Filled, play, write_transcript


def read_events(lines: object) -> list[tuple[str, str | None, dict]]:
    events, name, event_id = [], None, None
    for line in lines:  # type: ignore[attr-defined]
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            events.append((name, event_id, json.loads(line[6:])))
            name = event_id = None
    return events


def test_events_stream_turns_of_a_running_episode_until_it_ends(
    filled: Filled, tokenizer_dir: Path
) -> None:
    cfg = api_config(filled.url, events_poll_s=0.05)

    async def admit() -> int:
        async with await Store.open(cfg.store) as store:
            task_id = await store.add_task(filled.run_id, "calculator", "live", {})
            _, (episode,) = await store.admit_group(filled.run_id, task_id, "calculator", 1)
            return episode

    episode = anyio.run(admit)
    connected = threading.Event()

    def runner() -> None:
        async def go() -> None:
            _, transcript = await play("calculator", 9)
            connected.wait(30)
            await anyio.sleep(0.3)
            async with await Store.open(cfg.store) as store:
                await write_transcript(
                    store, episode, transcript, load_tokenizer(str(tokenizer_dir))
                )

        anyio.run(go)

    thread = threading.Thread(target=runner)
    thread.start()
    with TestClient(create_app(cfg), base_url=LOOPBACK) as c:
        with c.stream("GET", f"/api/v1/episodes/{episode}/events") as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            connected.set()
            events = read_events(r.iter_lines())
        thread.join(30)
        names = [e[0] for e in events]
        assert names[0] == "episode" and events[0][2]["status"] == "waiting"
        assert names[-1] == "end" and events[-1][2]["status"] == "completed"
        turns = [e for e in events if e[0] == "turn"]
        assert [t[1] for t in turns] == ["0", "1"]
        assert [m["role"] for m in turns[0][2]["messages"]] == ["user", "assistant", "tool"]
        assert turns[0][2]["tool_calls"][0]["name"] == "calc"
        assert [m["role"] for m in turns[1][2]["messages"]] == ["assistant"]
        # A client reconnecting after turn 0 gets only what followed.
        with c.stream(
            "GET", f"/api/v1/episodes/{episode}/events", headers={"Last-Event-ID": "0"}
        ) as r:
            again = read_events(r.iter_lines())
        assert [e[0] for e in again] == ["episode", "turn", "end"] and again[1][1] == "1"
        assert c.get("/api/v1/episodes/999999/events").status_code == 404


def test_viewer_pages_render_without_javascript(client: TestClient, filled: Filled) -> None:
    home = client.get("/", params={"env": "calculator", "has_tool_error": "true"})
    assert home.status_code == 200 and home.headers["content-type"].startswith("text/html")
    assert f'href="{LOOPBACK}/episodes/{filled.bad}"' in home.text
    assert f'/episodes/{filled.calculator[0]}"' not in home.text
    page = client.get(f"/episodes/{filled.calculator[0]}").text
    assert '<details class="toolcall ok">' in page and 'class="strip"' in page
    assert 'class="mark version">v1<' in page and 'class="tok m"' in page
    assert "logprob=" in page and "trainer=" in page
    assert "Run demo" in client.get(f"/runs/{filled.run_id}").text
    assert "<polyline" in client.get(f"/runs/{filled.run_id}").text
    assert "reward.mean" in client.get(f"/runs/{filled.run_id}").text
    assert "episode " in client.get(f"/groups/{filled.groups[0]}").text
    stats = client.get("/stats", params={"run": "demo"}).text
    assert 'id="ledger"' in stats and "awaiting training" in stats
    assert "demo" in client.get("/runs").text
    assert client.get("/static/viewer.js").status_code == 200
    assert client.get("/episodes/999999").json() == {
        "detail": "episode 999999 does not exist: list ids with `agent-rl episodes list`"
    }
    # Two pages of the list link to each other through the cursor.
    first = client.get("/", params={"limit": 2})
    assert "Next page" in first.text and "cursor=" in first.text
