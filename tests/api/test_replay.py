"""Replay re-executes stored episodes in fresh environments: calculator and python-math (in a
real bubblewrap sandbox) reproduce exactly; tampered episodes show where they differ. Replay
and fork need the bearer token."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, update

from agent_rl.app.api import create_app
from agent_rl.app.api.tokens import load_tokenizer
from agent_rl.config import SandboxConfig
from agent_rl.store import Store
from agent_rl.store.db import database_url
from agent_rl.store.models import MessageRow
from tests.api.conftest import LOOPBACK, TOKEN, api_config
from tests.api.fill import Filled, add_episode, play

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def replay(client: TestClient, episode_id: int) -> dict:
    r = client.post(f"/api/v1/episodes/{episode_id}/replay", headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def tamper(url: str, episode_id: int, position: int, content: str) -> None:
    """Edit one stored message behind the store's back."""
    db = create_engine(database_url(url))
    with db.begin() as conn:
        conn.execute(
            update(MessageRow)
            .where(MessageRow.episode_id == episode_id, MessageRow.position == position)
            .values(content=content)
        )
    db.dispose()


def test_calculator_episodes_replay_exactly_and_tampering_shows(
    client: TestClient, filled: Filled
) -> None:
    for episode in [*filled.calculator, filled.bad]:
        out = replay(client, episode)
        assert out["reproduced"], out
        assert out["reward_equal"] and out["replayed_reward"] == out["recorded_reward"]
        assert all(t["equal"] and t["diff"] == "" for t in out["turns"])
    assert replay(client, filled.bad)["recorded_reward"] == 0.0

    # A tool observation edited in the store: that turn differs, the reward still matches.
    e = filled.calculator[2]
    messages = client.get(f"/api/v1/episodes/{e}", params={"tokens": False}).json()["messages"]
    tool = next(m for m in messages if m["role"] == "tool")
    tamper(filled.url, e, tool["position"], "999")
    out = replay(client, e)
    assert not out["reproduced"] and out["reward_equal"]
    (changed,) = [t for t in out["turns"] if not t["equal"]]
    assert (
        changed["turn"] == 0
        and "-999" in changed["diff"]
        and f"+{tool['content']}" in changed["diff"]
    )

    # The final answer edited: observations match, the replayed reward does not.
    e = filled.calculator[3]
    messages = client.get(f"/api/v1/episodes/{e}", params={"tokens": False}).json()["messages"]
    tamper(filled.url, e, messages[-1]["position"], "12345678")
    out = replay(client, e)
    assert not out["reproduced"] and all(t["equal"] for t in out["turns"])
    assert out["recorded_reward"] == 1.0 and out["replayed_reward"] == 0.0

    # The first message (the task prompt) edited: the reset differs.
    tamper(filled.url, filled.calculator[0], 0, "What is 1+1?")
    out = replay(client, filled.calculator[0])
    assert out["turns"][0]["turn"] == -1 and not out["turns"][0]["equal"]


def test_running_episode_cannot_be_replayed(client: TestClient, filled: Filled) -> None:
    r = client.post(f"/api/v1/episodes/{filled.running}/replay", headers=AUTH)
    assert r.status_code == 409 and "is running" in r.json()["detail"]
    assert client.post("/api/v1/episodes/999999/replay", headers=AUTH).status_code == 404


def test_mutating_endpoints_need_the_token(filled: Filled) -> None:
    with TestClient(create_app(api_config(filled.url)), base_url=LOOPBACK) as c:
        path = f"/api/v1/episodes/{filled.calculator[0]}/replay"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            r = c.post(path, headers=headers)
            assert r.status_code == 401 and "bearer token" in r.json()["detail"], headers
            assert r.headers["www-authenticate"] == "Bearer"
        assert c.get(f"/api/v1/episodes/{filled.calculator[0]}").status_code == 200
    with TestClient(create_app(api_config(filled.url, token=None)), base_url=LOOPBACK) as c:
        r = c.post(path, headers=AUTH)
        assert r.status_code == 403 and "set api.token" in r.json()["detail"]
    # Off loopback, everything needs the token: reads, the viewer, the spec, static files.
    with TestClient(create_app(api_config(filled.url, host="0.0.0.0")), base_url=LOOPBACK) as c:
        for page in ("/api/v1/runs", "/", "/openapi.json", "/static/viewer.css"):
            r = c.get(page)
            assert r.status_code == 401 and "bearer token" in r.json()["detail"], page
            assert c.get(page, headers=AUTH).status_code == 200, page
        for header in ("Bearer", "Bearer ", "Bearer  \t", "bearer", TOKEN, f"Basic {TOKEN}"):
            assert c.get("/api/v1/runs", headers={"Authorization": header}).status_code == 401
    # An empty or blank configured token is no token: nothing matches it, not even an empty
    # bearer (the comparison of "" with "" once let `Authorization: Bearer` through).
    for blank in ("", "   "):
        with TestClient(create_app(api_config(filled.url, token=blank)), base_url=LOOPBACK) as c:
            for header in ("Bearer", "Bearer ", f"Bearer {blank}"):
                r = c.post(path, headers={"Authorization": header})
                assert r.status_code == 403 and "set api.token" in r.json()["detail"]


def test_request_bodies_are_bounded(client: TestClient, filled: Filled) -> None:
    r = client.post(
        f"/api/v1/episodes/{filled.calculator[0]}/replay", headers=AUTH, content=b"x" * 70_000
    )
    assert r.status_code == 413 and "api.max_request_bytes" in r.json()["detail"]

    def chunks() -> Iterator[bytes]:
        for _ in range(40):
            yield b"y" * 4096

    r = client.post(
        f"/api/v1/episodes/{filled.calculator[0]}/replay", headers=AUTH, content=chunks()
    )
    assert r.status_code == 413


@pytest.fixture
def sandbox_state() -> Iterator[Path]:
    state = Path(tempfile.mkdtemp(prefix="agent-rl-api-"))
    state.chmod(0o711)  # sandbox uids must traverse it to reach their work dirs
    yield state
    shutil.rmtree(state, ignore_errors=True)


def test_python_math_replays_in_a_fresh_sandbox(
    filled: Filled, tokenizer_dir: Path, sandbox_state: Path
) -> None:
    from tools_sandbox.factory import open_backend

    sandbox_cfg = SandboxConfig(state_dir=sandbox_state)

    async def record() -> list[int]:
        backend = await open_backend(sandbox_cfg)
        ids = []
        try:
            async with await Store.open(api_config(filled.url).store) as store:
                for i in range(2):
                    env_spec = await _spec()
                    sandbox = await backend.create(env_spec)
                    try:
                        task, transcript = await play("python-math", i, sandbox=sandbox)
                    finally:
                        await sandbox.close()
                    assert transcript.reward == 1.0
                    _, e = await add_episode(
                        store,
                        filled.run_id,
                        "python-math",
                        task,
                        transcript,
                        load_tokenizer(str(tokenizer_dir)),
                    )
                    ids.append(e)
        finally:
            await backend.aclose()
        return ids

    episodes = anyio.run(record)
    cfg = api_config(filled.url)
    cfg.sandbox = sandbox_cfg
    with TestClient(create_app(cfg), base_url=LOOPBACK) as c:
        for e in episodes:
            out = replay(c, e)
            assert out["reproduced"] and out["replayed_reward"] == 1.0, out
            python_turn = out["turns"][1]
            assert python_turn["replayed"][0]["name"] == "python"
        messages = c.get(f"/api/v1/episodes/{episodes[0]}", params={"tokens": False}).json()[
            "messages"
        ]
        code = next(m for m in messages if m["role"] == "assistant")
        tamper(
            filled.url,
            episodes[0],
            code["position"],
            code["content"].replace("print(", "print(1 + "),
        )  # the program now prints another number
        out = replay(c, episodes[0])
        assert not out["reproduced"] and not out["turns"][1]["equal"] and out["reward_equal"]


async def _spec():  # type: ignore[no-untyped-def]
    from agent_rl.sdk.registry import make

    return make("python-math").sandbox_spec
