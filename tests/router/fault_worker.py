"""A fault-injecting stand-in for an SGLang worker, served by aiohttp on loopback.

The router under test talks to it over real HTTP through real sockets; only the engine behind it
is scripted. Tests that need an engine's actual outputs (token ids, logprobs, routed experts,
weight versions) use real SGLang instead (test_real_sglang.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Seen:
    """One request as the worker received it."""

    method: str
    path: str
    raw_path: str
    headers: dict[str, str]
    body: bytes
    peer: tuple[str, int] | None = None
    """The router's end of the connection, to tell reused connections from new ones."""


@dataclass
class FaultWorker:
    """A fault injector posing as an SGLang worker, for testing the router's failure handling.

    Depending on `mode` it answers normally (`ok`), hangs without answering (`hang`), answers
    500 (`error500`), refuses every call with `refuse_status` (`refuse`, a 4xx), resets the TCP
    connection after reading the request (`reset`), or answers after `delay_s` seconds (`slow`).
    `health_mode`, when set, applies to /health_generate only, so health probes and live traffic
    can fail independently. `stored` holds the response ids this worker answers
    `/v1/responses/{id}` for (any other id is a 404, as in SGLang's response store). Every
    request is recorded in `seen` with its exact body bytes. Generation replies are small
    SGLang-shaped JSON naming the worker, the request's rid and the worker's weight version;
    streaming replies are SSE chunks released one by one through `stream_gate` when a test
    wants to control their pace.
    """

    name: str
    mode: str = "ok"
    health_mode: str | None = None
    delay_s: float = 0.0
    refuse_status: int = 400
    stored: dict[str, dict[str, Any]] = field(default_factory=dict)
    weight_version: str = "v0"
    update_delay_s: float = 0.0
    seen: list[Seen] = field(default_factory=list)
    stream_gate: asyncio.Event | None = None
    in_flight: int = 0
    peak_in_flight: int = 0
    cancelled: int = 0
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def calls(self, path: str) -> list[Seen]:
        return [s for s in self.seen if s.path == path]

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                                     shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _fault(self, request: web.Request, mode: str) -> web.StreamResponse | None:
        if mode == "hang":
            await asyncio.sleep(3600)
        if mode == "error500":
            return web.json_response({"error": "injected failure", "worker": self.name}, status=500)
        if mode == "refuse":
            return web.json_response({"success": False, "message": "injected refusal"},
                                     status=self.refuse_status)
        if mode == "reset":
            sock = request.transport.get_extra_info("socket") if request.transport else None
            if sock is not None:  # linger 0: close() sends RST instead of FIN
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=500)
        if mode == "slow":
            await asyncio.sleep(self.delay_s)
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        path = request.path
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.seen.append(Seen(request.method, path, request.raw_path, dict(request.headers), body, peer))
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            mode = self.health_mode if (path == "/health_generate" and self.health_mode) else self.mode
            faulted = await self._fault(request, mode)
            if faulted is not None:
                return faulted
            return await self._answer(request, path, body)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1

    async def _answer(self, request: web.Request, path: str, body: bytes) -> web.StreamResponse:
        payload: Any = json.loads(body) if body else {}
        if path == "/health_generate":
            return web.Response(text="")
        if path == "/model_info":
            return web.json_response({"model_path": "fault-worker", "weight_version": self.weight_version})
        if path == "/v1/loads":
            return web.json_response({"loads": [{"dp_rank": 0, "num_running_reqs": self.in_flight - 1}]})
        if path == "/update_weights_from_disk":
            await asyncio.sleep(self.update_delay_s)
            self.weight_version = payload.get("weight_version", self.weight_version)
            return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})
        if path.startswith("/v1/responses/"):
            response_id = path.split("/")[3]
            if response_id not in self.stored:
                return web.json_response({"message": f"{response_id} not found"}, status=404)
            return web.json_response(dict(self.stored[response_id], worker=self.name))
        if path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            if isinstance(payload, dict) and payload.get("stream"):
                return await self._stream(request, payload)
            reply = self._reply(payload)
            return web.json_response(reply, headers={"X-Worker": self.name})
        return web.json_response({"success": True, "path": path})

    def _reply(self, payload: Any) -> dict[str, Any]:
        rid = payload.get("rid") if isinstance(payload, dict) else None
        return {"text": "ok", "output_ids": [1, 2, 3],
                "meta_info": {"id": rid, "worker": self.name, "weight_version": self.weight_version,
                              "finish_reason": {"type": "length", "length": 3}}}

    async def _stream(self, request: web.Request, payload: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Worker": self.name})
        await response.prepare(request)
        for i in range(3):
            chunk = {"text": "ok"[: i + 1], "output_ids": [1, 2, 3][: i + 1],
                     "meta_info": {"worker": self.name, "chunk": i}}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if self.stream_gate is not None:
                await self.stream_gate.wait()
                self.stream_gate.clear()
            elif self.mode == "slow":
                await asyncio.sleep(self.delay_s)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
