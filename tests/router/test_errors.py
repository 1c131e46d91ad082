"""Every error the router makes itself has one JSON shape, OpenAI's; stored responses are found.

Faults come from `FaultWorker`s (a fault injector: a hung worker, a refused connection) and from
the router's own checks. That real SGLang's answers on every OpenAI route, errors included, come
through unchanged is shown in test_real_sglang.py.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import aiohttp
import pytest

from tests.router.conftest import RouterFactory, WorkerFactory

pytestmark = pytest.mark.anyio

ADMIN = {"Authorization": "Bearer secret"}


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def _assert_router_error(response: aiohttp.ClientResponse, status: int) -> dict[str, Any]:
    assert response.status == status
    assert response.headers["Content-Type"].startswith("application/json")
    body = await response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) - {"worker"} == {"message", "type", "param", "code"}
    assert error["type"] == "router_error" and error["code"] == status and error["param"] is None
    assert isinstance(error["message"], str) and error["message"]
    return error


async def test_every_router_made_error_is_openai_shaped_json(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker()
    router = await make_router([worker.url], max_body_mb=1)
    url = router.url
    cases: list[tuple[str, str, dict[str, Any], int]] = [
        ("GET", "/no/such/route", {}, 404),
        ("POST", "/v1/no-such-endpoint", {"data": b"{}"}, 404),
        ("GET", "/generate", {}, 405),
        ("DELETE", "/v1/chat/completions", {}, 405),
        ("GET", "/abort_request", {}, 405),
        ("GET", "/workers", {}, 401),
        ("POST", "/pause_generation", {"headers": {"Authorization": "Bearer"}}, 401),
        ("POST", "/abort_request", {"data": b"not json", "headers": ADMIN}, 400),
        ("POST", "/workers", {"json": {"nope": 1}, "headers": ADMIN}, 400),
        ("POST", "/update_weights_from_disk", {"json": {}, "headers": ADMIN}, 400),
        ("POST", "/update_weights_from_tensor", {"json": {}, "headers": ADMIN}, 400),
        ("DELETE", "/workers", {"params": {"url": "http://10.9.9.9:1"}, "headers": ADMIN}, 404),
        ("POST", "/generate", {"data": b"x" * (2 * 1024 * 1024)}, 413),
    ]
    for method, path, kw, status in cases:
        async with http.request(method, url + path, **kw) as r:
            error = await _assert_router_error(r, status)
            if status == 405:
                assert r.headers["Allow"] and method not in r.headers["Allow"]
                assert method in error["message"]
    assert {s.path for s in worker.seen} <= {"/model_info"}  # none of those reached the worker
    async with http.get(url + "/metrics") as r:
        assert 'agent_rl_router_requests_total{code="413",route="/generate"} 1.0' in await r.text()


async def test_worker_failures_are_router_errors_naming_the_worker(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    empty = await make_router([])
    async with http.post(empty.url + "/generate", data=b"{}") as r:
        await _assert_router_error(r, 503)
    async with http.post(empty.url + "/pause_generation", headers=ADMIN) as r:
        await _assert_router_error(r, 503)
    async with http.get(empty.url + "/v1/responses/resp_1") as r:
        await _assert_router_error(r, 503)
    dead = _dead_url()
    unreachable = await make_router([dead], retries=0)
    async with http.post(unreachable.url + "/v1/completions", data=b"{}") as r:
        # Not forwarded (no connection): a 503, which a caller may send again.
        assert (await _assert_router_error(r, 503))["worker"] == dead
    async with http.get(unreachable.url + "/v1/responses/resp_1") as r:
        await _assert_router_error(r, 502)
    hung = await make_worker(name="hung", mode="hang")
    slow = await make_router([hung.url], request_timeout_s=0.3)
    async with http.post(slow.url + "/generate", data=b"{}") as r:
        assert (await _assert_router_error(r, 504))["worker"] == hung.url


async def test_a_stored_response_is_found_on_the_worker_holding_it(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    # A stand-in for SGLang's response store (answers 404 for ids it does not hold): the engine
    # environment's SGLang 0.5.23 runs with its Responses API off (it needs `openai_harmony`,
    # not installed), so no real server here can hold a stored response.
    holder = await make_worker(name="holder", stored={"resp_abc": {"id": "resp_abc"}})
    others = [await make_worker(name=f"other{i}") for i in range(2)]
    router = await make_router([others[0].url, holder.url, others[1].url])
    async with http.get(router.url + "/v1/responses/resp_abc") as r:
        assert r.status == 200 and await r.json() == {"id": "resp_abc", "worker": "holder"}
    async with http.post(router.url + "/v1/responses/resp_abc/cancel") as r:
        assert r.status == 200 and (await r.json())["worker"] == "holder"
    async with http.get(router.url + "/v1/responses/resp_missing") as r:
        assert r.status == 404
        assert (await r.json())["message"] == "resp_missing not found"  # a worker's own 404
    assert len(holder.calls("/v1/responses/resp_abc")) == 1
    assert all(len(o.calls("/v1/responses/resp_abc")) == 1 for o in others)
    assert json.loads(holder.calls("/v1/responses/resp_abc/cancel")[0].body or b"{}") == {}
