"""A small HTTP/1.1 client: pooled keep-alive connections, httptools' parser.

Measured with a 50 ms stub engine at 256 concurrent requests, aiohttp's client was more than half
of a proxy's CPU per request (a minimal aiohttp-server proxy: 0.67 ms with an aiohttp client,
0.32 ms with a bare keep-alive client; docs/router.md). The router's hot path (to its workers)
and the engine client's (`agent_rl.sglang.client`: generate, stream, abort, model info) therefore
talk HTTP through this client: one asyncio Protocol per connection, the response parsed by
httptools (the C parser uvicorn uses), the request written in one `write`. Health checks and
control calls keep using aiohttp, where convenience matters more than microseconds. It lives in
the kernel so that the router (which imports the kernel only) and the engine client share it.

Contract:
- `Upstream.request` raises `NotSent` when no connection could be opened (nothing reached the
  worker: safe to send elsewhere) and `UpstreamFailed` for anything after the request was
  written (a reset, a malformed answer). It never retries by itself.
- A response's body is consumed with `read()` or `chunks()` (bytes as they arrive, chunked
  encoding removed); afterwards the connection returns to the pool when the worker allows
  keep-alive. `close()` (also on cancellation or timeout) drops the connection, which tells
  SGLang to abort the generation.
- Idle connections are dropped after `keepalive_s`, kept below uvicorn's 5 s, so a pooled
  connection is never reused just as the worker closes it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

# Stop reading from a worker while this much body is buffered and not yet relayed.
_HIGH_WATER = 1 << 20


class NotSent(Exception):
    """The connection to a worker could not be opened: no byte of the request reached it."""


class UpstreamFailed(Exception):
    """The worker broke the exchange after the request was sent."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; httptools calls the `on_*` methods while parsing."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self) -> None:
        loop = asyncio.get_running_loop()
        self.head: asyncio.Future[None] = loop.create_future()
        self.status = 0
        self.reason = ""
        self.headers: list[tuple[str, str]] = []
        self.body: deque[bytes] = deque()
        self.buffered = 0
        self.complete = False
        self.reuse = False
        self.until_eof = False
        self.error: BaseException | None = None
        self.wakeup: asyncio.Future[None] | None = None
        self.paused = False

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamFailed(f"malformed response: {e}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.until_eof and self.head.done() and exc is None:
            self.complete = True
            self._wake()
        if not self.complete:
            self._fail(UpstreamFailed(f"connection closed by the worker{f': {exc}' if exc else ''}"))

    # -- httptools callbacks ------------------------------------------------------------------

    def on_status(self, reason: bytes) -> None:
        self.reason += reason.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        names = {name.lower() for name, _ in self.headers}
        # Neither a length nor chunked framing: the body runs until the worker closes.
        self.until_eof = (self.status not in (204, 304) and "content-length" not in names
                          and "transfer-encoding" not in names)
        if not self.head.done():
            self.head.set_result(None)

    def on_body(self, data: bytes) -> None:
        self.body.append(data)
        self.buffered += len(data)
        if self.buffered > _HIGH_WATER and self.transport is not None and not self.paused:
            self.transport.pause_reading()
            self.paused = True
        self._wake()

    def on_message_complete(self) -> None:
        # httptools answers should_keep_alive() only inside its callbacks; it resets afterwards.
        self.reuse = self._parser.should_keep_alive()
        self.complete = True
        self._wake()

    # -- helpers ------------------------------------------------------------------------------

    def _wake(self) -> None:
        if self.wakeup is not None and not self.wakeup.done():
            self.wakeup.set_result(None)

    def _fail(self, error: BaseException) -> None:
        self.error = error
        if not self.head.done():
            self.head.set_exception(error)
            self.head.exception()  # mark retrieved: the caller may already be gone
        self._wake()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def reusable(self, now: float, keepalive_s: float) -> bool:
        return (not self.closed and self.transport is not None
                and not self.transport.is_closing() and now - self.idle_since < keepalive_s)

    def keep_alive(self) -> bool:
        return self.complete and self.reuse and not self.closed and not self.until_eof


class UpstreamResponse:
    """Status, headers and body of one worker answer."""

    def __init__(self, conn: _Connection, pool: Upstream, key: tuple[str, int]) -> None:
        self._conn = conn
        self._pool = pool
        self._key = key
        self.status = conn.status
        self.reason = conn.reason
        self.headers = conn.headers
        self._done = False

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; raises UpstreamFailed if the worker breaks off."""
        conn = self._conn
        while True:
            while conn.body:
                data = conn.body.popleft()
                conn.buffered -= len(data)
                if conn.paused and conn.buffered < _HIGH_WATER // 2 and conn.transport is not None:
                    conn.transport.resume_reading()
                    conn.paused = False
                yield data
            if conn.complete:
                self.release()
                return
            if conn.error is not None:
                raise conn.error
            conn.wakeup = asyncio.get_running_loop().create_future()
            await conn.wakeup

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    def release(self) -> None:
        """Return the connection to the pool if the exchange completed, else drop it."""
        if self._done:
            return
        self._done = True
        if self._conn.keep_alive():
            self._pool._put(self._key, self._conn)
        else:
            self._conn.close()

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._conn.close()


class Upstream:
    """Keep-alive connection pools, one per worker address."""

    def __init__(self, connect_timeout_s: float, keepalive_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    @staticmethod
    def address(base_url: str) -> tuple[str, int]:
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise ValueError(f"{base_url}: this HTTP/1.1 client speaks plain http only")
        return parts.hostname or "127.0.0.1", parts.port or 80

    async def request(
        self, key: tuple[str, int], method: str, target: str,
        headers: list[tuple[str, str]], body: bytes,
    ) -> UpstreamResponse:
        """Send one request; return once the response's status and headers arrived."""
        conn = await self._get(key)
        head = [f"{method} {target} HTTP/1.1", f"Host: {key[0]}:{key[1]}"]
        if body or method not in ("GET", "HEAD"):
            head.append(f"Content-Length: {len(body)}")
        head.extend(f"{k}: {v}" for k, v in headers)
        # aiohttp hands header values over decoded with surrogateescape; this restores the bytes.
        payload = ("\r\n".join(head) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body
        assert conn.transport is not None
        conn.transport.write(payload)
        try:
            await conn.head
        except BaseException:
            conn.close()
            raise
        return UpstreamResponse(conn, self, key)

    async def _get(self, key: tuple[str, int]) -> _Connection:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.reusable(now, self.keepalive_s):
                conn._reset()
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, key[0], key[1]), self.connect_timeout_s)
        except asyncio.TimeoutError as e:
            raise NotSent(f"no connection within {self.connect_timeout_s}s") from e
        except OSError as e:
            raise NotSent(f"cannot connect: {e.strerror or e}") from e
        return conn

    def _put(self, key: tuple[str, int], conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.setdefault(key, []).append(conn)

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
