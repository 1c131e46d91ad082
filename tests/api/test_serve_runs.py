"""The API over stores filled by real `serve` runs (real SGLang on CPU, tiny-moe with routing
replay) on SQLite and PostgreSQL: the token view with routed experts decoded by the run's own
tokenizer, replay of the served episodes, and fork, whose copied turns keep the parent's
tokens exactly while later turns come from the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from agent_rl.app.api import create_app
from agent_rl.config import Config
from agent_rl.app.serve import serve
from agent_rl.store.migrate import upgrade
from tests.api.conftest import LOOPBACK, TOKEN, fill_database, in_thread

AUTH = {"Authorization": f"Bearer {TOKEN}"}
# The session's SGLang server takes 20-35 s to start on an idle machine (minutes on a busy one);
# the rollout tests share it.
pytestmark = pytest.mark.slow


def served_config(url: str, server_url: str, model: Path) -> Config:
    return Config(
        store={"url": url},
        engine={"model": model, "moe_routing_replay": True},
        rollout={
            "router_url": server_url,
            "env": "calculator",
            "group_size": 2,
            "max_new_tokens": 32,
            "max_tokens": 1024,
            "max_turns": 3,
            "heartbeat_s": 1.0,
        },
        api={"token": TOKEN},
    )


def test_api_over_a_served_run(db_url: str, sglang_moe_server: Any, tiny_moe_model: Path) -> None:
    cfg = served_config(db_url, sglang_moe_server.url, tiny_moe_model)

    async def run() -> None:
        await upgrade(cfg.store)
        stats = await serve(cfg, max_episodes=4)
        assert stats.admitted == 4

    in_thread(run)
    with TestClient(create_app(cfg), base_url=LOOPBACK) as c:
        page = c.get("/api/v1/episodes", params={"run": "default", "sort": "id"}).json()
        assert len(page["items"]) == 4
        # On PostgreSQL an episode can fail when the random model's text holds a NUL byte,
        # which PostgreSQL text refuses (the runner records it as failed, with the cause).
        episodes = [e for e in page["items"] if e["status"] != "failed"]
        assert episodes and {e["status"] for e in episodes} <= {"completed", "filtered"}
        first = episodes[0]
        body = c.get(f"/api/v1/episodes/{first['id']}", params={"experts": True}).json()
        tokens = body["tokens"]
        assert tokens["tokenizer"] == str(tiny_moe_model)
        assert body["messages"][0]["content"] in "".join(tokens["pieces"])
        n = first["num_tokens"]
        experts = tokens["routed_experts"]
        assert len(experts) == n and {len(row) for row in experts} == {2}  # 2 layers
        assert all(len(layer) == 2 for row in experts for layer in row)  # top-2
        assert c.get(f"/api/v1/episodes/{first['id']}").json()["tokens"]["routed_experts"] is None
        model_tokens = [i for i, m in enumerate(tokens["loss_mask"]) if m]
        assert model_tokens and all(tokens["versions"][i] == 0 for i in model_tokens)
        for e in episodes:
            out = c.post(f"/api/v1/episodes/{e['id']}/replay", headers=AUTH).json()
            assert out["reproduced"], out

        forked = c.post(f"/api/v1/episodes/{first['id']}/fork", params={"turn": 0}, headers=AUTH)
        assert forked.status_code == 200, forked.text
        fork = forked.json()
        assert fork["parent_episode_id"] == first["id"] and fork["status"] == "filtered"
        child = c.get(f"/api/v1/episodes/{fork['episode_id']}", params={"experts": True}).json()
        assert child["episode"]["parent_episode_id"] == first["id"]
        assert child["episode"]["filter_reason"].startswith(
            f"fork of episode {first['id']} from turn 0"
        )
        assert (
            child["episode"]["task_id"] == first["task_id"]
            and child["episode"]["seed"] == first["seed"]
        )
        assert child["tokens"]["routed_experts"] is not None
        assert c.get("/api/v1/stats", params={"run": "default"}).json()["ledger"]["admitted"] == 5
        past = c.post(f"/api/v1/episodes/{first['id']}/fork", params={"turn": 99}, headers=AUTH)
        assert past.status_code == 400 and "fork from a turn in 0.." in past.json()["detail"]


def test_fork_copies_the_turns_before_k_and_generates_the_rest(
    tmp_path: Path, tokenizer_dir: Path, sglang_moe_server: Any
) -> None:
    from tests._databases import fresh_database

    with fresh_database("sqlite", tmp_path) as url:
        filled = fill_database(url, tokenizer_dir)
        cfg = Config(
            store={"url": url},
            rollout={"router_url": sglang_moe_server.url, "max_new_tokens": 16},
            api={"token": TOKEN},
        )
        parent_id = filled.calculator[2]
        with TestClient(create_app(cfg), base_url=LOOPBACK) as c:
            r = c.post(f"/api/v1/episodes/{parent_id}/fork", params={"turn": 1}, headers=AUTH)
            assert r.status_code == 200, r.text
            fork_id = r.json()["episode_id"]
            parent = c.get(f"/api/v1/episodes/{parent_id}").json()
            child = c.get(f"/api/v1/episodes/{fork_id}").json()

        def completion(body: dict, turn: int) -> dict[str, list]:
            t = body["turns"][turn]
            lo, hi = t["span_start"] + t["num_prompt_tokens"], t["span_start"] + t["num_tokens"]
            return {k: body["tokens"][k][lo:hi] for k in ("token_ids", "logprobs", "versions")}

        assert completion(child, 0) == completion(parent, 0)  # the parent's exact tokens
        assert child["tool_calls"][0]["output"] == parent["tool_calls"][0]["output"]
        roles = [m["role"] for m in child["messages"]]
        assert roles[:3] == ["user", "assistant", "tool"] and len(child["turns"]) >= 2
        assert set(completion(child, 1)["versions"]) == {0}  # generated by the served policy
