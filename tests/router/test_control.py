"""Admin auth, worker management, control fan-out, loads, model info, metrics and the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys

import aiohttp
import pytest
from pydantic import SecretStr

from agent_rl.config import RouterConfig
from agent_rl.kernel.errors import ConfigError
from router import Router
from tests.router.conftest import RouterFactory, WorkerFactory

pytestmark = pytest.mark.anyio

ADMIN = {"Authorization": "Bearer secret"}
ADMIN_ROUTES = [
    ("GET", "/workers"), ("POST", "/workers"), ("DELETE", "/workers"),
    ("POST", "/abort_request"), ("POST", "/pause_generation"), ("POST", "/continue_generation"),
    ("POST", "/flush_cache"), ("GET", "/flush_cache"), ("POST", "/update_weights_from_disk"),
    ("POST", "/begin_weight_update"), ("POST", "/end_weight_update"),
    ("POST", "/update_weight_version"), ("POST", "/update_weights_from_distributed"),
    ("POST", "/init_weights_update_group"), ("POST", "/update_weights_from_tensor"),
]


@pytest.mark.parametrize("token", [None, "Bearer wrong", "secret"])
async def test_admin_endpoints_need_the_token(
    token: str | None, make_worker: WorkerFactory, make_router: RouterFactory,
    http: aiohttp.ClientSession,
) -> None:
    worker = await make_worker()
    router = await make_router([worker.url])
    headers = {"Authorization": token} if token else {}
    for method, path in ADMIN_ROUTES:
        async with http.request(method, router.url + path, json={}, headers=headers) as r:
            assert r.status == 401, (method, path)
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
            assert "admin token" in (await r.json())["error"]["message"]
    # Nothing reached the worker but the router's own version read at start.
    assert {seen.path for seen in worker.seen} <= {"/model_info"}


@pytest.mark.parametrize("authorization", ["Bearer", "Bearer ", "Bearer \t ", "bearer", "Basic secret", "secret"])
async def test_a_bearer_without_the_token_never_passes(
    authorization: str, make_worker: WorkerFactory, make_router: RouterFactory,
    http: aiohttp.ClientSession,
) -> None:
    worker = await make_worker()
    router = await make_router([worker.url])
    async with http.get(router.url + "/workers", headers={"Authorization": authorization}) as r:
        assert r.status == 401
    # The scheme is case-insensitive (RFC 9110); the token is not.
    async with http.get(router.url + "/workers", headers={"Authorization": "bearer secret"}) as r:
        assert r.status == 200


@pytest.mark.parametrize("token", [None, "", "   ", "\t\n"])
async def test_a_public_bind_without_a_real_token_refuses_to_start(token: str | None) -> None:
    config = RouterConfig(host="0.0.0.0", port=0, health_interval_s=0, admin_token=token)
    with pytest.raises(ConfigError, match="admin_token is unset or blank"):
        async with Router(config):
            pass
    # The same when the blank token got past validation (model_copy does not validate).
    bypassed = RouterConfig(host="0.0.0.0", port=0, health_interval_s=0).model_copy(
        update={"admin_token": SecretStr(token or " ")})
    with pytest.raises(ConfigError, match="admin_token is unset or blank"):
        async with Router(bypassed):
            pass


@pytest.mark.parametrize("token", ["", "  "])
async def test_a_blank_token_on_loopback_is_no_token(
    token: str, make_worker: WorkerFactory, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker()
    config = RouterConfig(port=0, health_interval_s=0, admin_token=token)
    assert config.admin_token is None  # what the trainer reads is None too, never ""
    async with Router(config, [worker.url]) as router:
        assert router.token_generated and len(router.admin_token) >= 24
        async with http.get(router.url + "/workers", headers={"Authorization": f"Bearer {token}"}) as r:
            assert r.status == 401
        async with http.get(router.url + "/workers",
                            headers={"Authorization": f"Bearer {router.admin_token}"}) as r:
            assert r.status == 200


async def test_tokenless_control_lets_slime_drive_the_router_on_loopback(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    a, b = await make_worker(name="a"), await make_worker(name="b")
    router = await make_router([a.url, b.url], admin_token=None, tokenless_control=True)
    # slime's rollout: list the workers, then abort, sending no token.
    async with http.get(router.url + "/workers") as r:
        assert r.status == 200
        urls = [w["url"] for w in (await r.json())["workers"]]
    assert urls == [a.url, b.url]
    async with http.post(router.url + "/abort_request", json={"abort_all": True}) as r:
        assert r.status == 200 and len((await r.json())["workers"]) == 2
    assert all(json.loads(w.calls("/abort_request")[0].body) == {"abort_all": True} for w in (a, b))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "router.example"])
async def test_tokenless_control_is_refused_beyond_loopback(host: str) -> None:
    config = RouterConfig(host=host, port=0, health_interval_s=0, admin_token="secret",
                          tokenless_control=True)
    with pytest.raises(ConfigError, match="tokenless_control .* needs a loopback host"):
        async with Router(config):
            pass


async def test_workers_can_be_listed_added_and_removed(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    a, b = await make_worker(name="a", weight_version="v3"), await make_worker(name="b")
    router = await make_router([a.url])
    async with http.post(router.url + "/workers", json={"url": b.url + "/"}, headers=ADMIN) as r:
        assert r.status == 201
        assert (await r.json())["worker"]["url"] == b.url
    async with http.post(router.url + "/workers", json={"url": b.url}, headers=ADMIN) as r:
        assert r.status == 200 and (await r.json())["added"] is False
    async with http.post(router.url + "/workers", json={"nope": 1}, headers=ADMIN) as r:
        assert r.status == 400
    async with http.get(router.url + "/workers", headers=ADMIN) as r:
        listed = (await r.json())["workers"]
    assert [w["url"] for w in listed] == [a.url, b.url]
    assert listed[0]["weight_version"] == "v3" and listed[0]["healthy"] is True
    async with http.delete(router.url + "/workers", params={"url": a.url}, headers=ADMIN) as r:
        assert r.status == 200
    async with http.delete(router.url + "/workers", params={"url": a.url}, headers=ADMIN) as r:
        assert r.status == 404
    for _ in range(3):
        async with http.post(router.url + "/generate", data=b"{}") as r:
            assert (await r.json())["meta_info"]["worker"] == "b"


@pytest.mark.parametrize("context", [0, 3000], ids=["rid-only", "after-input-ids"])
async def test_abort_by_rid_goes_to_every_worker_holding_it(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession,
    context: int,
) -> None:
    workers = [await make_worker(name=f"w{i}", mode="slow", delay_s=0.5) for i in range(3)]
    router = await make_router([w.url for w in workers], policy="round-robin")

    def body(rid: str) -> bytes:  # as agent-rl's client writes it: the context first
        ids = ",".join(str(i) for i in range(context))
        head = f'{{"input_ids": [{ids}], "sampling_params": {{}}, ' if context else "{"
        return f'{head}"rid": "{rid}"}}'.encode()

    # Two live requests share a rid (one SGLang server would refuse that; a router can spread it).
    pending = [asyncio.create_task(http.post(router.url + "/generate", data=body(rid)))
               for rid in ("r-42", "r-42", "other")]
    await asyncio.sleep(0.2)
    holders = {w.url for w in workers
               if any(s.body == body("r-42") for s in w.calls("/generate"))}
    assert len(holders) == 2
    async with http.post(router.url + "/abort_request", json={"rid": "r-42"}, headers=ADMIN) as r:
        body = await r.json()
    assert r.status == 200 and {w["url"] for w in body["workers"]} == holders
    for w in workers:
        aborts = [json.loads(s.body) for s in w.calls("/abort_request")]
        assert aborts == ([{"rid": "r-42"}] if w.url in holders else [])
    for response in await asyncio.gather(*pending):
        assert (await response.json())["meta_info"]["id"] in ("r-42", "other")  # rid unchanged
        response.release()
    assert router.proxy.rids == {}  # finished requests hold no rid
    # Unknown rid and abort_all go to every worker.
    async with http.post(router.url + "/abort_request", json={"rid": "gone"}, headers=ADMIN) as r:
        assert len((await r.json())["workers"]) == 3
    async with http.post(router.url + "/abort_request", json={"abort_all": True}, headers=ADMIN) as r:
        assert len((await r.json())["workers"]) == 3


@pytest.mark.parametrize(("statuses", "expected"), [
    ((400, 400), 400),  # every worker refused what the caller sent: the caller's mistake
    ((422, 422), 422),
    ((400, 404), 400),  # refused for different reasons, still the caller's request
    ((400, None), 502),  # one accepted it: the other worker failed
    ((400, 500), 502),
    ((401, 401), 502),  # the router's own credentials failed at the worker, not the caller's
])
async def test_a_worker_refusal_of_a_control_call_passes_through(
    statuses: tuple[int | None, ...], expected: int, make_worker: WorkerFactory,
    make_router: RouterFactory, http: aiohttp.ClientSession,
) -> None:
    workers = []
    for i, status in enumerate(statuses):
        if status is None:
            workers.append(await make_worker(name=f"w{i}"))
        elif status == 500:
            workers.append(await make_worker(name=f"w{i}", mode="error500"))
        else:
            workers.append(await make_worker(name=f"w{i}", mode="refuse", refuse_status=status))
    router = await make_router([w.url for w in workers])
    async with http.post(router.url + "/pause_generation", json={"mode": "bogus"}, headers=ADMIN) as r:
        reply = await r.json()
    assert r.status == expected and reply["success"] is False
    assert [w["status"] for w in reply["workers"]] == [s or 200 for s in statuses]
    async with http.get(router.url + "/v1/loads?include=bogus") as r:
        assert r.status == expected


@pytest.mark.parametrize("path", ["/pause_generation", "/continue_generation", "/flush_cache"])
async def test_control_calls_reach_every_worker_intact(
    path: str, make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    workers = [await make_worker(name=f"w{i}") for i in range(3)]
    router = await make_router([w.url for w in workers])
    body = b'{"mode": "in_place", "extra": [1]}'
    async with http.post(router.url + path, data=body, headers=ADMIN) as r:
        reply = await r.json()
    assert r.status == 200 and reply["success"] is True and len(reply["workers"]) == 3
    assert all(w.calls(path)[0].body == body for w in workers)


async def test_partial_failure_is_reported_per_worker(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    good, bad = await make_worker(name="good"), await make_worker(name="bad", mode="error500")
    router = await make_router([good.url, bad.url])
    async with http.post(router.url + "/pause_generation", json={}, headers=ADMIN) as r:
        reply = await r.json()
    assert r.status == 502 and reply["success"] is False
    by_url = {w["url"]: w for w in reply["workers"]}
    assert by_url[good.url]["success"] and not by_url[bad.url]["success"]
    assert by_url[bad.url]["status"] == 500


async def test_update_from_disk_pauses_updates_continues_every_worker(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    a = await make_worker(name="a", update_delay_s=0.05)
    b = await make_worker(name="b", update_delay_s=0.3)
    router = await make_router([a.url, b.url], update_pause_mode="in_place")
    body = {"model_path": "/ckpt/step-7", "weight_version": "v7", "unknown": True}
    update = asyncio.create_task(
        http.post(router.url + "/update_weights_from_disk", json=body, headers=ADMIN))
    await asyncio.sleep(0.15)
    # `a` finished its update, `b` has not: new sessions go to `a` only.
    names = set()
    for s in range(8):
        async with http.post(router.url + "/generate", json={"session_id": f"new-{s}"}) as r:
            names.add((await r.json())["meta_info"]["worker"])
    assert names == {"a"}
    async with await update as r:
        reply = await r.json()
    assert r.status == 200 and reply["success"] and reply["weight_version"] == "v7"
    assert {w["weight_version"] for w in reply["workers"]} == {"v7"}
    for w in (a, b):
        steps = [s.path for s in w.seen if s.path != "/generate" and s.path != "/model_info"]
        assert steps == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
        assert json.loads(w.calls("/pause_generation")[0].body) == {"mode": "in_place"}
        # Paused in place, the requests hold their KV cache: SGLang must not try to flush it.
        assert json.loads(w.calls("/update_weights_from_disk")[0].body) == dict(body, flush_cache=False)
    async with http.get(router.url + "/model_info") as r:
        info = await r.json()
    assert info["worker_weight_versions"] == {a.url: "v7", b.url: "v7"}


async def test_default_update_retracts_and_lets_sglang_flush_the_cache(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    w = await make_worker(name="w")
    router = await make_router([w.url])
    body = {"model_path": "/ckpt/step-8", "weight_version": "8"}
    async with http.post(router.url + "/update_weights_from_disk", json=body, headers=ADMIN) as r:
        assert r.status == 200
    assert json.loads(w.calls("/pause_generation")[0].body) == {"mode": "retract"}
    # No flush_cache: SGLang's default flushes the prefix cache, so no later request reuses KV
    # computed by the old weights.
    assert json.loads(w.calls("/update_weights_from_disk")[0].body) == body


async def test_begin_and_end_weight_update_bracket_all_workers(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    a, b = await make_worker(name="a"), await make_worker(name="b")
    router = await make_router([a.url, b.url])
    async with http.post(router.url + "/begin_weight_update", json={}, headers=ADMIN) as r:
        assert r.status == 200
    assert all(w.updating for w in router.pool)
    a.weight_version = b.weight_version = "v9"  # what a tensor/distributed update would do
    async with http.post(router.url + "/end_weight_update", json={}, headers=ADMIN) as r:
        reply = await r.json()
    assert reply["weight_version"] == "v9" and not any(w.updating for w in router.pool)
    async with http.post(router.url + "/update_weights_from_tensor", json={}, headers=ADMIN) as r:
        assert r.status == 400 and "each worker directly" in (await r.json())["error"]["message"]


async def test_begin_pauses_and_end_resumes_the_named_workers_only(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    # A trainer's in-memory update names the engines it reaches; a dead one is left alone.
    a, b = await make_worker(name="a"), await make_worker(name="b")
    router = await make_router([a.url, b.url])
    async with http.post(router.url + "/begin_weight_update", json={"workers": [a.url]},
                         headers=ADMIN) as r:
        reply = await r.json()
        assert r.status == 200 and reply["update_pause_mode"] == "retract"
    assert json.loads(a.calls("/pause_generation")[0].body) == {"mode": "retract"}
    assert json.loads(a.calls("/begin_weight_update")[0].body) == {}  # the list stays ours
    assert not b.calls("/pause_generation") and not b.calls("/begin_weight_update")
    async with http.post(router.url + "/end_weight_update", json={"workers": [a.url]},
                         headers=ADMIN) as r:
        assert r.status == 200
    assert len(a.calls("/continue_generation")) == 1 and not b.calls("/end_weight_update")
    assert not any(w.updating for w in router.pool)


async def test_loads_are_aggregated_and_metrics_exported(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    a, b = await make_worker(name="a"), await make_worker(name="b")
    router = await make_router([a.url, b.url])
    async with http.get(router.url + "/v1/loads?include=core") as r:
        loads = (await r.json())["loads"]
    assert sorted(x["worker"] for x in loads) == sorted([a.url, b.url])
    assert a.calls("/v1/loads")[0].raw_path == "/v1/loads?include=core"
    async with http.post(router.url + "/generate", data=b"{}") as r:
        await r.read()
    async with http.get(router.url + "/metrics") as r:
        text = await r.text()
    assert 'agent_rl_router_requests_total{code="200",route="/generate"} 1.0' in text
    for name in ("agent_rl_router_request_seconds_bucket", "agent_rl_router_in_flight",
                 "agent_rl_router_worker_healthy"):
        assert name in text
    async with http.get(router.url + "/health") as r:
        assert r.status == 200 and (await r.json())["healthy_workers"] == 2


async def test_cli_runs_the_router_until_sigterm(
    make_worker: WorkerFactory, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker(name="cli")
    env = dict(os.environ, AGENT_RL_ROUTER__HEALTH_INTERVAL_S="0")
    proc = subprocess.Popen(
        [sys.executable, "-c", "from agent_rl.app.cli import main; main()",
         "router", "--port", "0", "--worker", worker.url],
        stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        lines = []
        while not any("admin token" in line for line in lines):
            line = await asyncio.to_thread(proc.stderr.readline)  # type: ignore[union-attr]
            assert line, f"router exited: {''.join(lines)}"
            lines.append(line)
        url = re.search(r"router on (http://127\.0\.0\.1:\d+)", "".join(lines)).group(1)  # type: ignore[union-attr]
        token = lines[-1].split()[-1]
        async with http.post(url + "/generate", data=b"{}") as r:
            assert (await r.json())["meta_info"]["worker"] == "cli"
        async with http.get(url + "/workers", headers={"Authorization": f"Bearer {token}"}) as r:
            assert r.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 10) == 0
