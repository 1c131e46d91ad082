"""The router in front of real SGLang on CPU (tiny-moe, routing replay on).

Through the router a request gets the same answer as sent directly, routed experts, logprobs
and weight version included; a weight update fans out to two servers while requests are in
flight, and every request completes with its tokens labelled by the version that made them.

Decoding is greedy: SGLang 0.5.23's CPU sampling path does not honour `sampling_seed` (two
identical seeded requests sent straight to one server differ), so only greedy decoding gives an
answer that can be compared byte for byte. The seed is still sent, with an unknown field and
`custom_params`, to show SGLang accepts what the router passes on.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent_rl.config import RouterConfig
from agent_rl.engine.launcher import EngineServer
from router import Router

pytestmark = pytest.mark.anyio

ADMIN = {"Authorization": "Bearer secret"}
REQUEST = {
    "input_ids": [5, 6, 7, 8],
    "rid": "router-equality",
    "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "sampling_seed": 1234,
                        "custom_params": {"note": "passed through"}},
    "return_logprob": True,
    "top_logprobs_num": 2,
    "return_routed_experts": True,
    "x_unknown_field": {"kept": [1, 2]},
}
# Per-response timing that differs between any two requests.
VOLATILE = {"e2e_latency", "response_sent_to_client_ts"}


def _config(**overrides: Any) -> RouterConfig:
    return RouterConfig(port=0, health_interval_s=0, admin_token="secret", **overrides)


def _stable(answer: Any) -> Any:
    items = answer if isinstance(answer, list) else [answer]
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("meta_info"), dict):
            for key in VOLATILE:
                item["meta_info"].pop(key, None)
    return answer


async def _fresh_answer(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    """One answer from an empty prefix cache, so direct and routed runs compute the same way."""
    async with http.post(url + "/flush_cache", headers=ADMIN) as r:
        assert r.status == 200
    async with http.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return _stable(await r.json())


async def test_routed_answer_equals_direct(sglang_moe_server: EngineServer) -> None:
    async with Router(_config(), [sglang_moe_server.url]) as router, aiohttp.ClientSession() as http:
        direct = await _fresh_answer(http, sglang_moe_server.url, REQUEST)
        routed = await _fresh_answer(http, router.url, REQUEST)
        meta = routed["meta_info"]
        assert meta["routed_experts"] and len(meta["output_token_logprobs"]) == 8
        assert meta["weight_version"] == "default"
        assert routed == direct

        batch = dict(REQUEST, input_ids=[[5, 6, 7], [9, 10]], rid=["b-1", "b-2"])
        assert await _fresh_answer(http, router.url, batch) == \
            await _fresh_answer(http, sglang_moe_server.url, batch)


async def test_routed_stream_equals_direct(sglang_moe_server: EngineServer) -> None:
    body = dict(REQUEST, stream=True, rid="router-stream")

    async def events(http: aiohttp.ClientSession, url: str) -> list[Any]:
        async with http.post(url + "/flush_cache", headers=ADMIN) as r:
            assert r.status == 200
        async with http.post(url + "/generate", json=body) as r:
            raw = await r.read()
        out = []
        for event in raw.split(b"\n\n"):
            if event.startswith(b"data: {"):
                out.append(_stable(json.loads(event[len(b"data: "):])))
            elif event:
                out.append(event)
        return out

    async with Router(_config(), [sglang_moe_server.url]) as router, aiohttp.ClientSession() as http:
        direct = await events(http, sglang_moe_server.url)
        routed = await events(http, router.url)
    assert len(routed) > 2 and routed[-1] == direct[-1] == b"data: [DONE]"
    # SGLang cuts the stream by timing (several tokens may share a chunk on a busy machine), so
    # the events are compared as what they are: cumulative states ending in the same answer.
    assert routed[-2] == direct[-2]
    assert routed[-2]["meta_info"]["routed_experts"] and routed[-2]["meta_info"]["output_token_logprobs"]
    final_ids = routed[-2]["output_ids"]
    for event in routed[:-1]:
        assert final_ids[: len(event["output_ids"])] == event["output_ids"]


def _check_labels(answer: dict[str, Any], versions: set[str]) -> list[str]:
    """Assert the weight-version spans cover the completion exactly; return their versions."""
    meta = answer["meta_info"]
    spans = meta["weight_versions"]
    assert spans[0]["start"] == 0 and spans[-1]["end"] == meta["completion_tokens"]
    assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:]))
    assert spans[-1]["version"] == meta["weight_version"]
    assert {s["version"] for s in spans} <= versions
    return [s["version"] for s in spans]


async def test_weight_update_fans_out_while_requests_run(
    sglang_moe_server: EngineServer, second_sglang_moe_server: EngineServer, tiny_moe_model: Path
) -> None:
    servers = [sglang_moe_server.url, second_sglang_moe_server.url]
    long = {"input_ids": [5, 6, 7, 8], "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 96, "ignore_eos": True}}
    short = dict(long, sampling_params={"temperature": 0.0, "max_new_tokens": 4})

    async with Router(_config(), servers) as router, aiohttp.ClientSession() as http:
        async def generate(body: dict[str, Any], session: str) -> dict[str, Any]:
            async with http.post(router.url + "/generate", json=body,
                                 headers={"X-SMG-Routing-Key": session}) as r:
                assert r.status == 200, await r.text()
                return await r.json()

        async def update(version: str) -> dict[str, Any]:
            body = {"model_path": str(tiny_moe_model), "weight_version": version}
            async with http.post(router.url + "/update_weights_from_disk", json=body, headers=ADMIN) as r:
                reply = await r.json()
                assert r.status == 200, reply
                return reply

        async def generate_streaming(session: str, started: asyncio.Event) -> dict[str, Any]:
            """Stream a long generation; set `started` once tokens arrive; return the last event."""
            last: dict[str, Any] = {}
            async with http.post(router.url + "/generate", json=dict(long, stream=True),
                                 headers={"X-SMG-Routing-Key": session}) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        last = json.loads(line[len(b"data: "):])
                        if last.get("output_ids"):
                            started.set()
            return last

        try:
            started = [asyncio.Event() for _ in range(4)]
            before = [asyncio.create_task(generate_streaming(f"long-{i}", started[i]))
                      for i in range(4)]
            # Update only once every long request is producing tokens on the old weights.
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            updating = asyncio.create_task(update("v-router"))
            await asyncio.sleep(0.05)
            during = [asyncio.create_task(generate(short, f"during-{i}")) for i in range(4)]
            reply = await updating
            assert reply["weight_version"] == "v-router"
            assert [w["weight_version"] for w in reply["workers"]] == ["v-router", "v-router"]
            assert all(w["success"] for w in reply["workers"])

            finished = await asyncio.gather(*before, *during)
            spans = [_check_labels(answer, {"default", "v-router"}) for answer in finished]
            for answer in finished:
                assert len(answer["output_ids"]) == answer["meta_info"]["completion_tokens"]
            # Requests that were generating when the update began were paused in place and
            # finished on the new weights: their tokens carry both versions, in order.
            assert any(versions == ["default", "v-router"] for versions in spans[:4]), spans
            after = [await generate(short, f"after-{i}") for i in range(4)]
            assert all(_check_labels(a, {"v-router"}) == ["v-router"] for a in after)
            for url in servers:
                async with http.get(url + "/model_info") as r:
                    assert (await r.json())["weight_version"] == "v-router"
        finally:
            # The shared server's contract: weight_version is "default" between tests.
            assert (await update("default"))["weight_version"] == "default"


async def test_abort_by_rid_ends_every_live_request_holding_it(
    sglang_moe_server: EngineServer, second_sglang_moe_server: EngineServer
) -> None:
    servers = [sglang_moe_server.url, second_sglang_moe_server.url]
    # Each server takes the rid once; only a router can put it live on two servers at once.
    body = {"input_ids": [5, 6, 7, 8], "rid": "shared-rid", "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 1000, "ignore_eos": True}}

    async with Router(_config(policy="round-robin"), servers) as router, \
            aiohttp.ClientSession() as http:
        async def stream(started: asyncio.Event) -> dict[str, Any]:
            last: dict[str, Any] = {}
            async with http.post(router.url + "/generate", json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        last = json.loads(line[len(b"data: "):])
                        if last.get("output_ids"):
                            started.set()
            return last

        started = [asyncio.Event(), asyncio.Event()]
        streams = [asyncio.create_task(stream(e)) for e in started]
        # Both generate, so they are on different servers (one would refuse the second).
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        async with http.post(router.url + "/abort_request", json={"rid": "shared-rid"},
                             headers=ADMIN) as r:
            reply = await r.json()
        assert r.status == 200 and len(reply["workers"]) == 2, reply
        finished = await asyncio.wait_for(asyncio.gather(*streams), 60)
    for last in finished:
        meta = last["meta_info"]
        assert meta["finish_reason"]["type"] == "abort", meta["finish_reason"]
        assert meta["completion_tokens"] < 1000
        assert meta["id"] == "shared-rid"  # the caller's rid, unchanged


async def test_a_workers_400_to_a_control_call_is_a_400(
    sglang_moe_server: EngineServer, second_sglang_moe_server: EngineServer
) -> None:
    servers = [sglang_moe_server.url, second_sglang_moe_server.url]
    async with Router(_config(), servers) as router, aiohttp.ClientSession() as http:
        # A path that is neither a directory nor a hub repo id: SGLang refuses it, no download.
        async with http.post(router.url + "/update_weights_from_disk",
                             json={"model_path": "/no/such/weights", "weight_version": "x"},
                             headers=ADMIN) as r:
            reply = await r.json()
        assert r.status == 400 and reply["success"] is False, reply
        assert [w["status"] for w in reply["workers"]] == [400, 400]
        assert all("weights" in w["response"]["message"] for w in reply["workers"])
        # A broadcast call SGLang's validation refuses: its 400 again, not the router's 502.
        async with http.post(router.url + "/update_weight_version", json={}, headers=ADMIN) as r:
            assert r.status == 400
        for url in servers:
            async with http.get(url + "/model_info") as r:
                assert (await r.json())["weight_version"] == "default"


CREATED = re.compile(rb'"created":\d+')
"""The Unix second SGLang stamps on an OpenAI answer (`/v1/models/{id}` and others)."""


async def test_openai_routes_through_the_router_equal_direct(
    sglang_moe_server: EngineServer,
) -> None:
    """Every OpenAI-compatible route SGLang serves is forwarded: with a model's id, or with an
    empty body that SGLang refuses, the routed answer is the direct one, status and bytes (but
    the `created` time SGLang stamps on each answer: two answers may straddle a second)."""
    from router.app import PROXIED

    async with Router(_config(), [sglang_moe_server.url]) as router, \
            aiohttp.ClientSession() as http:
        async with http.get(sglang_moe_server.url + "/v1/models") as r:
            model_id = (await r.json())["data"][0]["id"]
        requests = [("GET", f"/v1/models/{model_id}"), ("GET", "/v1/models/no-such-model")]
        requests += [(method, path) for path, methods in PROXIED.items() for method in methods
                     if path.startswith("/v1/") and "{" not in path]
        for method, path in requests:
            data = b"{}" if method != "GET" else None
            answers = []
            for url in (sglang_moe_server.url, router.url):
                async with http.request(method, url + path, data=data,
                                        headers={"Content-Type": "application/json"}) as r:
                    body = CREATED.sub(b'"created":0', await r.read())
                    answers.append((r.status, r.headers.get("Content-Type"), body))
            assert answers[0] == answers[1], (method, path)
            assert answers[1][0] != 404 or path.endswith("no-such-model"), (method, path)
