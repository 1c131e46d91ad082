"""The router answers only its own Host (DNS rebinding: a web page whose name its author points
at 127.0.0.1 is same-origin with a loopback router), and a POST only from no Origin or an
allowed one: the admin routes, even in tokenless control mode, and the proxied routes, which
would let the page generate and read the answers. Two `Authorization` headers carry no token.
The worker behind the router is `FaultWorker` in its fault-free mode, recording what reaches it."""

from __future__ import annotations

import aiohttp
import pytest

from tests.router.conftest import RouterFactory, WorkerFactory

pytestmark = pytest.mark.anyio

ADMIN = {"Authorization": "Bearer secret"}


async def test_admin_routes_answer_their_own_hosts_only(
    make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    router = await make_router([], allowed_hosts=["router.internal", "proxy.example:8443"])
    port = router.url.rsplit(":", 1)[1]
    for host in (
        f"127.0.0.1:{port}",
        f"localhost:{port}",
        "router.internal",
        "router.internal:9",
        "proxy.example:8443",
    ):
        async with http.get(router.url + "/workers", headers={**ADMIN, "Host": host}) as r:
            assert r.status == 200, host
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1:1", "proxy.example:1"):
        async with http.get(router.url + "/workers", headers={**ADMIN, "Host": host}) as r:
            assert r.status == 421, host
            assert "allowed_hosts" in (await r.json())["error"]["message"]
    # A browser's cross-origin POST carries its page's Origin.
    body = {"url": "http://127.0.0.1:9"}
    async with http.post(
        router.url + "/workers", json=body, headers={**ADMIN, "Origin": "http://evil.example"}
    ) as r:
        assert r.status == 403
    async with http.post(
        router.url + "/workers", json=body, headers={**ADMIN, "Origin": f"http://127.0.0.1:{port}"}
    ) as r:
        assert r.status == 201


async def test_tokenless_control_still_checks_the_host(
    make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    router = await make_router([], admin_token=None, tokenless_control=True)
    async with http.get(router.url + "/workers") as r:
        assert r.status == 200
    async with http.get(router.url + "/workers", headers={"Host": "rebound.example"}) as r:
        assert r.status == 421


async def test_two_authorization_headers_carry_no_token(
    make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    router = await make_router([])
    for pair in (["Bearer secret", "Bearer wrong"], ["Bearer wrong", "Bearer secret"]):
        headers = [("Authorization", value) for value in pair]
        async with http.get(router.url + "/workers", headers=headers) as r:
            assert r.status == 401, pair
    async with http.get(router.url + "/workers", headers={"Authorization": "bearer secret"}) as r:
        assert r.status == 200


async def test_proxied_routes_answer_their_own_hosts_only(
    make_worker: WorkerFactory, make_router: RouterFactory, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker()
    router = await make_router([worker.url], allowed_hosts=["engines.internal"])
    port = router.url.rsplit(":", 1)[1]
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "engines.internal"):
        async with http.post(router.url + "/generate", json=body, headers={"Host": host}) as r:
            assert r.status == 200, host

    def proxied() -> int:  # the worker also sees the router's version refresh
        return sum(seen.path != "/model_info" and seen.path != "/get_model_info"
                   for seen in worker.seen)  # fmt: skip

    assert proxied() == 3
    for host in ("rebound.example", f"rebound.example:{port}", "127.0.0.1:1"):
        for method, path in (("POST", "/generate"), ("POST", "/v1/chat/completions"),
                             ("GET", "/v1/models"), ("GET", "/v1/responses/resp_1")):  # fmt: skip
            async with http.request(method, router.url + path, json=body,
                                    headers={"Host": host}) as r:  # fmt: skip
                assert r.status == 421, (host, path)
                assert "allowed_hosts" in (await r.json())["error"]["message"]
    # A browser's cross-origin POST carries its page's Origin; the router's own passes.
    async with http.post(router.url + "/generate", json=body,
                         headers={"Origin": "http://rebound.example"}) as r:  # fmt: skip
        assert r.status == 403
    assert proxied() == 3  # nothing refused reached the worker
    async with http.post(router.url + "/generate", json=body,
                         headers={"Origin": f"http://127.0.0.1:{port}"}) as r:  # fmt: skip
        assert r.status == 200
