"""The read endpoints over a filled store, on SQLite and PostgreSQL."""

from __future__ import annotations

import math

from fastapi.testclient import TestClient

from tests.api.conftest import LOOPBACK
from tests.api.fill import Filled

V1 = "/api/v1"


def ids(page: dict) -> list[int]:
    return [e["id"] for e in page["items"]]


def test_list_filters_sort_and_cursor_pages(client: TestClient, filled: Filled) -> None:
    all_ids = ids(client.get(f"{V1}/episodes", params={"sort": "id"}).json())
    assert all_ids == sorted(all_ids) and len(all_ids) == 7
    assert ids(client.get(f"{V1}/episodes").json()) == all_ids[::-1]  # newest first by default
    seen, cursor = [], None
    while True:
        params = {"sort": "-reward", "limit": 2} | ({"cursor": cursor} if cursor else {})
        page = client.get(f"{V1}/episodes", params=params).json()
        seen += ids(page)
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert sorted(seen) == sorted(all_ids) and len(seen) == len(set(seen))
    rewards = [
        client.get(f"{V1}/episodes/{i}", params={"tokens": False}).json()["episode"]["reward"]
        for i in seen
    ]
    known = [r for r in rewards if r is not None]
    assert known == sorted(known, reverse=True) and rewards[-1] is None

    q = lambda **p: ids(client.get(f"{V1}/episodes", params=p).json())
    assert q(has_tool_error=True) == [filled.bad]
    assert q(status="running") == [filled.running]
    assert q(status="failed") == [filled.failed]
    assert sorted(q(status="trained")) == filled.calculator[:2]
    assert q(min_reward=0.5, sort="id") == filled.calculator
    assert q(max_reward=0.5) == [filled.bad]
    assert q(q="never closed") == [filled.bad]  # the malformed call's observation
    assert q(min_version=0, max_version=1, sort="id") == [
        *filled.calculator,
        filled.bad,
        filled.running,
    ]
    assert q(run="demo", env="calculator", drift=False, limit=1) == [filled.failed]
    assert q(group=filled.groups[1], sort="id") == filled.calculator[2:]
    assert client.get(f"{V1}/episodes", params={"run": "nope"}).json() == {
        "detail": "no run named 'nope' in the store"
    }


def test_page_size_is_clamped_to_the_config(filled: Filled) -> None:
    from agent_rl.app.api import create_app
    from tests.api.conftest import api_config

    with TestClient(create_app(api_config(filled.url, max_page_size=3)), base_url=LOOPBACK) as c:
        page = c.get(f"{V1}/episodes", params={"limit": 1000}).json()
        assert len(page["items"]) == 3 and page["next_cursor"]


def test_episode_transcript_tool_calls_and_token_view(client: TestClient, filled: Filled) -> None:
    body = client.get(f"{V1}/episodes/{filled.calculator[0]}").json()
    e = body["episode"]
    assert e["status"] == "trained" and e["reward"] == 1.0 and e["advantage"] == 0.0
    assert e["reward_details"]["reward"]["components"] == {"correct": 1.0}
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    (call,) = body["tool_calls"]
    assert call["name"] == "calc" and call["status"] == "ok"
    assert call["output"] == body["task"]["payload"]["answer"]
    tokens = body["tokens"]
    n = e["num_tokens"]
    assert len(tokens["token_ids"]) == len(tokens["pieces"]) == len(tokens["loss_mask"]) == n
    text = "".join(tokens["pieces"])
    assert body["messages"][0]["content"] in text and "<tool_call>" in text
    model = [i for i in range(n) if tokens["loss_mask"][i] == 1]
    assert sum(tokens["loss_mask"]) == e["num_model_tokens"]
    assert all(tokens["logprobs"][i] <= 0 for i in model)
    assert {tokens["versions"][i] for i in model} == {0, 1}  # the second turn sampled by v1
    assert all(tokens["versions"][i] == -1 for i in range(n) if i not in model)
    trainer = tokens["trainer_logprobs"]
    assert math.isclose(trainer[model[0]], tokens["logprobs"][model[0]] - 0.01, abs_tol=1e-6)
    assert tokens["routed_experts"] is None
    untrained = client.get(f"{V1}/episodes/{filled.calculator[2]}").json()["tokens"]
    assert untrained["trainer_logprobs"] is None
    assert (
        client.get(f"{V1}/episodes/{filled.bad}", params={"tokens": False}).json()["tokens"] is None
    )
    bad = client.get(f"{V1}/episodes/{filled.bad}").json()
    assert [c["status"] for c in bad["tool_calls"]] == ["malformed", "error"]


def test_group_runs_and_stats(client: TestClient, filled: Filled) -> None:
    group = client.get(f"{V1}/groups/{filled.groups[0]}").json()
    assert group["status"] == "trained" and group["size"] == 2
    assert [e["id"] for e in group["episodes"]] == filled.calculator[:2]
    assert [e["advantage"] for e in group["episodes"]] == [0.0, 0.0]
    (run,) = client.get(f"{V1}/runs").json()
    assert run["name"] == "demo" and run["latest_version"] == 2 and run["num_episodes"] == 7
    detail = client.get(f"{V1}/runs/{filled.run_id}").json()
    assert [v["version"] for v in detail["policy_versions"]] == [0, 1, 2]
    assert detail["metrics"] == {"loss": [[1, 0.5], [2, 0.25]], "reward.mean": [[1, 1.0], [2, 0.5]]}
    assert detail["config"]["rollout"]["env"] == "calculator"
    stats = client.get(f"{V1}/stats", params={"run": "demo"}).json()
    ledger = stats["ledger"]
    assert ledger == {
        "admitted": 7,
        "trained": 2,
        "filtered": 0,
        "failed": 1,
        "scored": 0,
        "in_flight": 4,
        "waiting": 0,
        "running": 1,
        "awaiting_training": 3,
    }
    # Trained by the step from version 0 (it published 1) on tokens of versions 0 and 1: as the
    # trainer counts it against its bound, staleness 0 (the old count said 1, the published
    # version minus the oldest token, which disagreed with the bound by one).
    assert stats["staleness"] == {"0": 2}
    assert stats["endings"] == {"truncated": {}, "filtered": {}, "failed": {"EngineError": 1}}
    assert stats["episode_latency_s"]["calculator"]["count"] == 6
    assert (
        stats["tool_latency_s"]["calc"]["count"] == 6
        and stats["tool_latency_s"]["calc"]["errors"] == 1
    )
    assert stats["tool_latency_s"]["(malformed)"]["errors"] == 1
    assert stats["throughput"]["window_episodes"] == 6
    assert client.get(f"{V1}/stats").json()["ledger"] == ledger


def test_errors_are_json_messages(client: TestClient, filled: Filled) -> None:
    missing = client.get(f"{V1}/episodes/999999")
    assert (
        missing.status_code == 404 and "episode 999999 does not exist" in missing.json()["detail"]
    )
    assert client.get(f"{V1}/groups/999999").status_code == 404
    assert client.get(f"{V1}/runs/999999").json() == {"detail": "run 999999 does not exist"}
    bad = client.get(f"{V1}/episodes", params={"limit": 0, "status": "odd"})
    assert bad.status_code == 422
    assert "limit" in bad.json()["detail"] and "status" in bad.json()["detail"]
    cursor = client.get(f"{V1}/episodes", params={"cursor": "garbage!"})
    assert cursor.status_code == 400 and "invalid cursor" in cursor.json()["detail"]
    assert client.get("/api/v1/nothing").json() == {"detail": "Not Found"}
