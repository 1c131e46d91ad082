"""Requests reach the worker byte for byte and answers reach the caller byte for byte."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from yarl import URL

from agent_rl.config import RouterConfig
from router import Router
from tests.router.conftest import RouterFactory, WorkerFactory

pytestmark = pytest.mark.anyio

# Fields the stock sglang-router drops, an unknown one, odd spacing and non-ASCII: the router
# must not re-serialize any of it.
RAW_BODY = (
    b'{"input_ids": [5, 6, 7],  "rid": "r-1", "session_id": "s-1", "return_logprob": true,'
    b' "return_routed_experts": true, "routed_experts_start_len": 0,'
    b' "sampling_params": {"max_new_tokens": 3, "sampling_seed": 7,'
    b' "custom_params": {"reward_hint": [1, {"x": null}], "\xc3\xa9t\xc3\xa9": 1e-30}},'
    b' "my_unknown_field": {"nested": [1.0, 2.50]}}'
)


async def test_request_body_and_headers_arrive_intact(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker()
    router = await make_router([worker.url])
    headers = {"Content-Type": "application/json", "X-Custom": "kept"}
    async with http.post(router.url + "/generate", data=RAW_BODY, headers=headers) as r:
        assert r.status == 200
    seen = worker.calls("/generate")[-1]
    assert seen.body == RAW_BODY
    assert seen.headers["X-Custom"] == "kept"
    assert seen.headers["Content-Type"] == "application/json"
    # The client's own choices pass through; the router adds none of its own.
    assert "aiohttp" in seen.headers.get("User-Agent", "")


async def test_query_string_is_forwarded_raw(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker()
    router = await make_router([worker.url])
    url = URL(router.url + "/v1/completions?a=%2F&b=%20x", encoded=True)
    async with http.post(url, data=b"{}") as r:
        assert r.status == 200
    assert worker.calls("/v1/completions")[-1].raw_path == "/v1/completions?a=%2F&b=%20x"


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/v1/completions"])
async def test_response_bytes_equal_direct(
    path: str, make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker(name="solo")
    router = await make_router([worker.url])
    async with http.post(worker.url + path, data=RAW_BODY) as r:
        direct, direct_headers = await r.read(), r.headers
    async with http.post(router.url + path, data=RAW_BODY) as r:
        routed, routed_headers = await r.read(), r.headers
    assert routed == direct
    assert routed_headers["X-Worker"] == direct_headers["X-Worker"] == "solo"
    assert routed_headers["Content-Type"] == direct_headers["Content-Type"]


async def test_upstream_connections_are_kept_alive(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker()
    router = await make_router([worker.url])
    for path in ("/generate", "/v1/completions", "/generate"):
        for _ in range(5):
            async with http.post(router.url + path, data=b"{}") as r:
                assert r.status == 200
    body = json.dumps({"stream": True}).encode()
    async with http.post(router.url + "/generate", data=body) as r:
        await r.read()
    async with http.post(router.url + "/generate", data=b"{}") as r:
        assert r.status == 200
    # Sequential requests, plain and streamed, all travel on one pooled connection.
    peers = {s.peer for s in worker.seen if s.path != "/model_info"}
    assert len(peers) == 1


async def test_expect_continue_is_answered_by_the_router(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker()
    router = await make_router([worker.url])
    # curl sends Expect: 100-continue for bodies over 1 KiB; the worker must not see it, or its
    # interim 100 would be taken for the answer.
    big = json.dumps({"input_ids": list(range(2000))}).encode()
    async with http.post(router.url + "/generate", data=big, expect100=True) as r:
        assert r.status == 200 and (await r.json())["text"] == "ok"
    assert "Expect" not in worker.calls("/generate")[-1].headers


async def test_batch_request_passes_through(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker()
    router = await make_router([worker.url])
    body = json.dumps({"input_ids": [[1, 2], [3]], "rid": ["a", "b"]}).encode()
    async with http.post(router.url + "/generate", data=body) as r:
        assert r.status == 200
    assert worker.calls("/generate")[-1].body == body


async def test_stream_is_relayed_chunk_by_chunk(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    # The worker holds each chunk until the test has read the previous one through the router.
    # A router that buffered the stream would never deliver the first chunk: the test would
    # time out instead of passing.
    gate = asyncio.Event()
    worker = await make_worker(stream_gate=gate)
    router = await make_router([worker.url])
    body = json.dumps({"input_ids": [1], "stream": True}).encode()
    received: list[bytes] = []
    async with http.post(router.url + "/generate", data=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/event-stream"
        buffer = b""
        async for chunk in r.content.iter_any():
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                received.append(event)
                gate.set()
    assert received[-1] == b"data: [DONE]"
    events = [json.loads(e[len(b"data: "):]) for e in received[:-1]]
    assert [e["meta_info"]["chunk"] for e in events] == [0, 1, 2]


async def test_traceparent_continues_through_the_router(
    make_worker: WorkerFactory, http: aiohttp.ClientSession
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    worker = await make_worker()
    caller_trace = "0af7651916cd43dd8448eb211c80319c"
    traceparent = f"00-{caller_trace}-b7ad6b7169203331-01"
    config = RouterConfig(port=0, health_interval_s=0, admin_token="secret")
    async with Router(config, [worker.url], tracer_provider=provider) as router:
        async with http.post(router.url + "/v1/chat/completions", data=b"{}",
                             headers={"traceparent": traceparent}) as r:
            assert r.status == 200
    (span,) = exporter.get_finished_spans()
    assert span.name == "chat"
    assert span.attributes["gen_ai.operation.name"] == "chat"
    assert format(span.context.trace_id, "032x") == caller_trace
    assert format(span.parent.span_id, "016x") == "b7ad6b7169203331"
    forwarded = worker.calls("/v1/chat/completions")[-1].headers["traceparent"]
    # The worker's parent is the router's span, in the caller's trace.
    assert forwarded == f"00-{caller_trace}-{format(span.context.span_id, '016x')}-01"


async def test_without_tracing_the_callers_traceparent_is_forwarded(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker()
    router = await make_router([worker.url])
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with http.post(router.url + "/generate", data=b"{}", headers={"traceparent": traceparent}):
        pass
    assert worker.calls("/generate")[-1].headers["traceparent"] == traceparent


async def test_binds_loopback_by_default(make_worker: WorkerFactory) -> None:
    worker = await make_worker()
    assert RouterConfig().host == "127.0.0.1"
    async with Router(RouterConfig(port=0, health_interval_s=0), [worker.url]) as router:
        assert router.url.startswith("http://127.0.0.1:")
        assert router.token_generated and len(router.admin_token) >= 24
