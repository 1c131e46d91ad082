"""Faults injected into workers: the router retries only what is safe, times out, quarantines
and restores, and trips its circuit breaker. Workers are `FaultWorker`s (a fault injector)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import pytest

from router.workers import Breaker
from tests.router.conftest import RouterFactory, WorkerFactory

pytestmark = pytest.mark.anyio

BODY = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}).encode()


def _dead_url() -> str:
    """A loopback URL where nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def _metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def test_refused_connection_is_retried_on_another_worker(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    good = await make_worker(name="good")
    router = await make_router([_dead_url(), good.url], policy="round-robin")
    for _ in range(4):
        async with http.post(router.url + "/generate", data=BODY) as r:
            assert r.status == 200
            assert (await r.json())["meta_info"]["worker"] == "good"
    assert len(good.calls("/generate")) == 4
    assert await _metric(http, router.url, "agent_rl_router_retries_total") >= 1


async def test_reset_after_sending_is_not_retried(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    flaky = await make_worker(name="flaky", mode="reset")
    good = await make_worker(name="good")
    router = await make_router([flaky.url, good.url], policy="round-robin")
    statuses = []
    for _ in range(2):
        async with http.post(router.url + "/generate", data=BODY) as r:
            statuses.append(r.status)
            if r.status == 502:
                error = (await r.json())["error"]
                assert error["worker"] == flaky.url and "not retried" in error["message"]
    assert sorted(statuses) == [200, 502]
    # The request that reached the flaky worker was not sent again anywhere.
    assert len(flaky.calls("/generate")) == 1 and len(good.calls("/generate")) == 1


async def test_500_passes_through_unchanged_and_is_not_retried(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    bad = await make_worker(name="bad", mode="error500")
    router = await make_router([bad.url])
    async with http.post(router.url + "/generate", data=BODY) as r:
        assert r.status == 500
        assert await r.json() == {"error": "injected failure", "worker": "bad"}
    assert len(bad.calls("/generate")) == 1


async def test_hang_returns_504_within_the_timeout(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    hung = await make_worker(name="hung", mode="hang")
    router = await make_router([hung.url], request_timeout_s=0.5)
    started = time.monotonic()
    async with http.post(router.url + "/generate", data=BODY) as r:
        assert r.status == 504
        assert "0.5s" in (await r.json())["error"]["message"]
    assert time.monotonic() - started < 1.5
    assert len(hung.calls("/generate")) == 1
    # The router closed the upstream request; the worker's handler was cancelled with it.
    await asyncio.sleep(0.1)
    assert hung.cancelled == 1


async def test_stream_that_stalls_is_cut_at_the_timeout(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    gate = asyncio.Event()  # never set: the worker sends one chunk, then stalls
    stalled = await make_worker(name="stalled", stream_gate=gate)
    router = await make_router([stalled.url], request_timeout_s=0.5)
    body = json.dumps({"input_ids": [1], "stream": True}).encode()
    started = time.monotonic()
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(router.url + "/generate", data=body) as r:
            assert r.status == 200
            await r.read()  # a cut connection, not a stream that looks complete
    assert time.monotonic() - started < 1.5


async def test_slow_worker_completes_within_the_timeout(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    slow = await make_worker(name="slow", mode="slow", delay_s=0.3)
    router = await make_router([slow.url], request_timeout_s=2)
    async with http.post(router.url + "/generate", data=BODY) as r:
        assert r.status == 200
    body = json.dumps({"input_ids": [1], "stream": True}).encode()
    async with http.post(router.url + "/generate", data=body) as r:
        assert (await r.read()).endswith(b"data: [DONE]\n\n")


async def test_caller_disconnect_cancels_the_upstream_request(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    hung = await make_worker(name="hung", mode="hang")
    router = await make_router([hung.url])
    with pytest.raises(asyncio.TimeoutError):
        await http.post(router.url + "/generate", data=BODY, timeout=aiohttp.ClientTimeout(total=0.3))
    for _ in range(50):
        if hung.cancelled:
            break
        await asyncio.sleep(0.02)
    assert hung.cancelled == 1
    assert router.pool.all()[0].outstanding == 0


async def test_quarantine_and_recovery_by_health_checks(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    sick = await make_worker(name="sick", health_mode="error500")
    good = await make_worker(name="good")
    router = await make_router([sick.url, good.url], health_interval_s=0.05,
                               quarantine_after=2, recover_after=2, policy="round-robin")
    sick_worker = router.pool.get(sick.url)
    assert sick_worker is not None
    await _until(lambda: sick_worker.quarantined)
    for _ in range(4):
        async with http.post(router.url + "/generate", data=BODY) as r:
            assert (await r.json())["meta_info"]["worker"] == "good"
    assert await _metric(http, router.url, "agent_rl_router_quarantines_total") == 1
    sick.health_mode = None
    await _until(lambda: not sick_worker.quarantined)
    names = set()
    for _ in range(4):
        async with http.post(router.url + "/generate", data=BODY) as r:
            names.add((await r.json())["meta_info"]["worker"])
    assert names == {"sick", "good"}


async def test_circuit_breaker_opens_then_half_opens(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    bad = await make_worker(name="bad", mode="error500")
    good = await make_worker(name="good")
    router = await make_router([bad.url, good.url], policy="round-robin",
                               breaker_failures=2, breaker_cooldown_s=0.3)
    for _ in range(6):
        async with http.post(router.url + "/generate", data=BODY) as r:
            await r.read()
    bad_worker = router.pool.get(bad.url)
    assert bad_worker is not None and bad_worker.breaker is Breaker.OPEN
    assert len(bad.calls("/generate")) == 2  # after two failures it got nothing more
    await asyncio.sleep(0.35)
    bad.mode = "ok"
    for _ in range(4):
        async with http.post(router.url + "/generate", data=BODY) as r:
            assert r.status == 200
    assert bad_worker.breaker is Breaker.CLOSED  # the half-open trial succeeded
    assert len(bad.calls("/generate")) >= 3


async def test_no_worker_available_is_a_clear_503(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    router = await make_router([])
    async with http.post(router.url + "/generate", data=BODY) as r:
        assert r.status == 503
        assert "POST /workers" in (await r.json())["error"]["message"]
    sick = await make_worker(name="sick", health_mode="error500")
    router = await make_router([sick.url], health_interval_s=0.05, quarantine_after=1)
    await _until(lambda: router.pool.all()[0].quarantined)
    async with http.post(router.url + "/generate", data=BODY) as r:
        assert r.status == 503
        assert "quarantined" in (await r.json())["error"]["message"]
    # Workers that cannot be connected to received nothing: a 503 too, which the caller may
    # send again (a 502 says a worker may have generated).
    router = await make_router([_dead_url(), _dead_url()], retries=5)
    async with http.post(router.url + "/generate", data=BODY) as r:
        assert r.status == 503
        error = (await r.json())["error"]
        assert "could not connect to any worker" in error["message"]
        assert error["type"] == "router_error" and error["code"] == 503


async def _until(condition, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_restarted_worker_gets_the_current_weights_before_serving(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    # The fault worker stands in for an engine that crashed and came back on its initial
    # weights (the chaos run, bench/chaos.py, does it to real SGLang engines).
    a = await make_worker(name="a")
    b = await make_worker(name="b")
    router = await make_router([a.url, b.url], health_interval_s=0.05, quarantine_after=1,
                               recover_after=2, policy="round-robin")
    update = {"model_path": "/models/v7", "weight_version": "7"}
    async with http.post(router.url + "/update_weights_from_disk", json=update,
                         headers={"Authorization": "Bearer secret"}) as r:
        assert r.status == 200
    assert a.weight_version == b.weight_version == "7"
    worker_b = router.pool.get(b.url)
    assert worker_b is not None
    b.health_mode = "error500"  # it dies...
    await _until(lambda: worker_b.quarantined)
    b.weight_version = "default"  # ...and restarts on the weights it was launched with
    updates_before = len(b.calls("/update_weights_from_disk"))
    b.health_mode = None
    await _until(lambda: not worker_b.quarantined)
    assert b.weight_version == "7"
    assert len(b.calls("/update_weights_from_disk")) == updates_before + 1
    assert json.loads(b.calls("/update_weights_from_disk")[-1].body)["model_path"] == "/models/v7"
    versions = set()
    for _ in range(4):
        async with http.post(router.url + "/generate", data=BODY) as r:
            versions.add((await r.json())["meta_info"]["weight_version"])
    assert versions == {"7"}


async def test_restored_worker_loads_the_restore_point_of_in_memory_updates(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    # Updates sent in memory (tensor, distributed) leave no files: the trainer names its newest
    # export with /restore_point, and a worker that comes back loads it before it serves.
    a, b = await make_worker(name="a"), await make_worker(name="b")
    router = await make_router([a.url, b.url], health_interval_s=0.05, quarantine_after=1,
                               recover_after=2, policy="round-robin")
    admin = {"Authorization": "Bearer secret"}
    async with http.post(router.url + "/restore_point", json={"weight_version": "5"},
                         headers=admin) as r:
        assert r.status == 400
    async with http.post(router.url + "/restore_point", headers=admin,
                         json={"model_path": "/exports/v000005", "weight_version": 5}) as r:
        assert r.status == 200
    assert not a.calls("/update_weights_from_disk")  # sent to no worker now
    a.weight_version = b.weight_version = "5"  # what the in-memory push did
    worker_b = router.pool.get(b.url)
    assert worker_b is not None
    b.health_mode = "error500"
    await _until(lambda: worker_b.quarantined)
    b.weight_version = "default"
    b.health_mode = None
    await _until(lambda: not worker_b.quarantined)
    assert b.weight_version == "5"
    body = json.loads(b.calls("/update_weights_from_disk")[-1].body)
    assert body == {"model_path": "/exports/v000005", "weight_version": "5"}


async def test_worker_added_after_an_update_joins_on_the_newest_weights(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    # `agent-rl launch` re-places a lost engine elsewhere (a new URL, on its launch weights) and
    # adds it with POST /workers: it must not serve the older weights meanwhile.
    a, b, c = [await make_worker(name=n) for n in "abc"]
    router = await make_router([a.url], health_interval_s=0, recover_after=2)
    admin = {"Authorization": "Bearer secret"}
    async with http.post(router.url + "/update_weights_from_disk", headers=admin,
                         json={"model_path": "/models/v4", "weight_version": "4"}) as r:
        assert r.status == 200
    b.weight_version = "default"
    async with http.post(router.url + "/workers", json={"url": b.url}, headers=admin) as r:
        assert r.status == 201
        added = (await r.json())["worker"]
    assert added["healthy"] is True and added["weight_version"] == "4" and b.weight_version == "4"
    assert json.loads(b.calls("/update_weights_from_disk")[-1].body)["model_path"] == "/models/v4"
    # One that cannot take them stays out of rotation.
    c.weight_version = "default"
    c.mode = "error500"
    c.health_mode = "ok"
    async with http.post(router.url + "/workers", json={"url": c.url}, headers=admin) as r:
        added = (await r.json())["worker"]
    assert added["quarantined"] is True and "not restored" in added["last_error"]
    for _ in range(4):
        async with http.post(router.url + "/generate", data=BODY) as r:
            assert (await r.json())["meta_info"]["weight_version"] == "4"


async def test_worker_that_cannot_take_the_weights_stays_quarantined(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    a = await make_worker(name="a")
    b = await make_worker(name="b")
    router = await make_router([a.url, b.url], health_interval_s=0.05, quarantine_after=1,
                               recover_after=1)
    async with http.post(router.url + "/update_weights_from_disk",
                         json={"model_path": "/models/v3", "weight_version": "3"},
                         headers={"Authorization": "Bearer secret"}) as r:
        assert r.status == 200
    worker_b = router.pool.get(b.url)
    assert worker_b is not None
    b.health_mode = "error500"
    await _until(lambda: worker_b.quarantined)
    b.weight_version = "default"
    b.mode = "error500"  # fails the update (and everything else)...
    b.health_mode = "ok"  # ...but passes health checks
    await asyncio.sleep(0.5)
    assert worker_b.quarantined
    assert "not restored" in (worker_b.last_error or "")


async def test_update_skips_a_quarantined_worker_which_gets_it_when_restored(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    a = await make_worker(name="a")
    b = await make_worker(name="b", health_mode="error500")  # down while the trainer syncs
    router = await make_router([a.url, b.url], health_interval_s=0.05, quarantine_after=1,
                               recover_after=2)
    worker_b = router.pool.get(b.url)
    assert worker_b is not None
    await _until(lambda: worker_b.quarantined)
    async with http.post(router.url + "/update_weights_from_disk",
                         json={"model_path": "/models/v9", "weight_version": "9"},
                         headers={"Authorization": "Bearer secret"}) as r:
        assert r.status == 200, await r.text()
    async with http.get(router.url + "/model_info") as r:
        info = await r.json()
    assert info["quarantined_workers"] == [b.url]
    assert a.weight_version == "9" and not b.calls("/update_weights_from_disk")
    b.health_mode = None
    await _until(lambda: not worker_b.quarantined)
    assert b.weight_version == "9"
