"""A typed async client for SGLang's native HTTP protocol (one server, or the router before many).

Generation is token-in, token-out: `generate(input_ids, ...)` posts `/generate` and decodes
`meta_info` into a `Generation` (`agent_rl.sglang.generation`: token ids, their logprobs, the weight version of each span of
tokens, the finish reason and, for MoE with routing replay, the routed experts as an int32 array
`[prompt + completion - 1 - routed_experts_start_len, layers, topk]`). `stream(...)` yields
cumulative `Generation`s from SGLang's server-sent events, the last one with its finish reason.
Control calls: abort, pause/continue, weight updates (from disk; begin/end around tensor and
distributed updates; behind the router they fan out to every engine and need its admin token),
the weight version each engine serves, health, loads, model/server info.

Transport: the hot calls (generate, stream, abort, model info) go through the kernel's
keep-alive HTTP/1.1 client (`agent_rl.kernel.http1`, httptools' parser: the router's client to
its workers), which costs about half the CPU of aiohttp's per request; a gateway call is one of
them, so it shows in serve's CPU per call. Control calls use aiohttp (at hundreds of concurrent
requests its pool keeps up where httpx's does not, shared/notes/perf), as does an `https` base
URL. Pass one `aiohttp.ClientSession` per process, or let the client own one. Failures raise
`EngineError` naming the endpoint, the status and SGLang's message. `EngineUnavailableError`
(a subclass) is a request that no engine received, which may be sent again: a 503 (the router
had no engine to send it to, or could connect to none) or no connection at all (the router or
engine down, e.g. restarting). A 502, a reset or a timeout after the request left is a plain
`EngineError`: an engine may have generated.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
from typing_extensions import Unpack

from agent_rl.sglang.generation import GenerateOptions, Generation, TokenIds, json_body
from agent_rl.kernel import jsonfast
from agent_rl.kernel.errors import EngineError, EngineUnavailableError
from agent_rl.kernel.http1 import NotSent, Upstream, UpstreamFailed, UpstreamResponse

PauseMode = Literal["in_place", "retract", "abort"]
Selector = Literal["target", "draft", "all"]
"""Which of a speculative engine's models an in-memory weight update loads: its target, its
draft, or both (SGLang's `selector`; an engine without a draft has its target only)."""


ROUTING_KEY_HEADER = "X-SMG-Routing-Key"

IDLE_CONNECTION_S = 4.0
"""How long a pooled connection may sit idle before it is dropped instead of reused. SGLang
serves HTTP with uvicorn, which closes idle keep-alive connections after 5 s; a client that
keeps them longer (aiohttp's default is 15 s) sometimes sends a request down a connection just
as the server closes it, and the request fails with "Server disconnected" after it may have been
read (seen when a store outage paused serve's episodes for a few seconds). Dropping ours first
means that never happens (the router's pool to its workers follows the same rule)."""

_JSON = {"Content-Type": "application/json"}


def _in_memory_update(body: dict[str, Any], *, selector: Selector, flattened: bool,
                      weight_version: str | None) -> dict[str, Any]:
    """An in-memory weight update's body with the options both kinds share (distributed and
    tensor): each is sent only when it differs from SGLang's default."""
    if selector != "all":
        body["selector"] = selector
    if flattened:
        body["load_format"] = "flattened_bucket"
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def _routed(headers: dict[str, str], options: GenerateOptions) -> dict[str, str]:
    """The request's headers, with its session key for the router's affinity if it has one."""
    key = options.get("routing_key")
    return {**headers, ROUTING_KEY_HEADER: key} if key else headers


class EngineClient:
    """Async client of one SGLang server (or of the router, which speaks the same protocol)."""

    def __init__(
        self,
        base_url: str,
        *,
        session: aiohttp.ClientSession | None = None,
        moe_topk: int | None = None,
        timeout_s: float = 1800.0,
        token: str | None = None,
    ) -> None:
        """`token`: the router's admin bearer token, sent with every request (control calls
        need it; a bare SGLang server ignores it)."""
        self.base_url = base_url.rstrip("/")
        self.moe_topk = moe_topk
        """Experts per token; read from the served model's config.json when left None."""
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session = session
        self._owns_session = session is None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._timeout_s = timeout_s
        parts = urlsplit(self.base_url)
        self._origin = f"{parts.scheme}://{parts.netloc}"
        self._prefix = parts.path
        self._address = Upstream.address(self.base_url) if parts.scheme == "http" else None
        """Where the keep-alive client connects (None for https: aiohttp then)."""
        self._h1: Upstream | None = None
        self._h1_loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._h1 is not None:
            self._h1.close()
            self._h1 = None
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # Unlimited connections: the caller's scheduler bounds concurrency, not the pool.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
                limit=0, keepalive_timeout=IDLE_CONNECTION_S))
        return self._session

    @property
    def _pool(self) -> Upstream:
        """The keep-alive pool of this event loop (a connection belongs to the loop that
        opened it)."""
        loop = asyncio.get_running_loop()
        if self._h1 is None or self._h1_loop is not loop:
            if self._h1 is not None and self._h1_loop is not None and not self._h1_loop.is_closed():
                self._h1.close()
            self._h1 = Upstream(self._timeout_s, IDLE_CONNECTION_S)
            self._h1_loop = loop
        return self._h1

    # --- generation ----------------------------------------------------------------------------
    async def _generate_body(
        self, input_ids: Sequence[int], sampling_params: dict[str, Any] | None,
        options: GenerateOptions, stream: bool,
    ) -> dict[str, Any]:  # fmt: skip
        body: dict[str, Any] = {
            "input_ids": input_ids if isinstance(input_ids, TokenIds) else list(input_ids),
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": options.get("return_logprob", True),
            "logprob_start_len": -1,  # output tokens only; prompt logprobs cost a full pass
            "stream": stream,
        }
        if options.get("rid") is not None:
            body["rid"] = options["rid"]
        if options.get("return_routed_experts"):
            await self._resolve_topk()
            body["return_routed_experts"] = True
            if options.get("routed_experts_start_len"):
                body["routed_experts_start_len"] = options["routed_experts_start_len"]
        body.update(options.get("extra") or {})
        return body

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any] | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Generation:
        """POST /generate for one prompt of token ids; `extra` fields are sent as they are."""
        body = await self._generate_body(input_ids, sampling_params, options, stream=False)
        raw = await self._fast("POST", "/generate", body, _routed(self._headers, options))
        return Generation.from_response(
            raw, self.moe_topk, options.get("routed_experts_start_len", 0)
        )

    async def stream(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any] | None = None,
        **options: Unpack[GenerateOptions],
    ) -> AsyncIterator[Generation]:
        """Yield cumulative Generations as SGLang streams them; the last has a finish reason."""
        body = await self._generate_body(input_ids, sampling_params, options, stream=True)
        start_len = options.get("routed_experts_start_len", 0)
        if self._address is not None:
            async for gen in self._stream_h1(body, _routed(self._headers, options), start_len):
                yield gen
            return
        try:
            async with self.session.post(
                self.base_url + "/generate", data=json_body(body),
                headers={**_routed(self._headers, options), **_JSON},
                timeout=self._timeout,
            ) as resp:
                await _raise_for_status(resp, "/generate")
                async for line in resp.content:
                    data = _sse_data(line)
                    if data == "[DONE]":
                        return
                    if data is not None:
                        yield Generation.from_response(json.loads(data), self.moe_topk, start_len)
        except aiohttp.ClientError as e:
            raise self._stream_failed(e) from e

    async def _stream_h1(self, body: dict[str, Any], headers: dict[str, str],
                         start_len: int) -> AsyncIterator[Generation]:
        """`stream` over the keep-alive client. The timeout bounds the whole stream, but each
        wait for the engine is timed on its own: a timeout scope must not stay open across a
        yield, where the consumer's code runs."""
        deadline = asyncio.get_running_loop().time() + self._timeout_s
        resp: UpstreamResponse | None = None
        try:
            async with asyncio.timeout_at(deadline):
                resp = await self._pool.request(
                    self._address, "POST", self._prefix + "/generate",  # type: ignore[arg-type]
                    [*headers.items(), *_JSON.items()], json_body(body))
                if resp.status != 200:
                    raise _refusal(self._origin, "/generate", resp.status, await resp.read())
            chunks, rest, done = resp.chunks(), b"", False
            while not done:
                async with asyncio.timeout_at(deadline):
                    data = await anext(chunks, None)
                if data is None:
                    return
                *lines, rest = (rest + data).split(b"\n")
                for line in lines:
                    payload = _sse_data(line)
                    if payload == "[DONE]":
                        done = True
                        break
                    if payload is not None:
                        yield Generation.from_response(json.loads(payload), self.moe_topk, start_len)
            async with asyncio.timeout_at(deadline):  # the body's end: the connection is reused
                async for _ in chunks:
                    pass
        except (NotSent, UpstreamFailed, TimeoutError) as e:
            raise self._stream_failed(e) from e
        finally:
            if resp is not None:
                resp.close()  # a no-op once the body was read and the connection pooled

    # --- control -------------------------------------------------------------------------------
    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """Abort one request (it returns its partial tokens with finish_reason abort) or all."""
        if rid is None and not abort_all:
            raise ValueError("abort needs a rid or abort_all=True")
        await self._fast(
            "POST", "/abort_request",
            {"rid": rid, "abort_all": abort_all} if rid else {"abort_all": True}, self._headers,
        )

    async def pause_generation(self, mode: PauseMode = "in_place") -> None:
        """Stop scheduling: in_place keeps requests where they are, retract recomputes them
        after continue, abort ends them with their partial tokens."""
        await self._post("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._post("/continue_generation", {})

    async def update_weights_from_disk(
        self,
        model_path: str | Path,
        *,
        weight_version: str | None = None,
        abort_all_requests: bool | None = None,
        flush_cache: bool | None = None,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        """Load new weights from a directory the engine can read (a relative path is made
        absolute here); behind the router, on every engine it serves from. Options left None
        are the server's own defaults (the router chooses `flush_cache` by its pause mode).
        EngineError unless every engine reports success."""
        body: dict[str, Any] = {"model_path": os.path.abspath(model_path)}
        for key, value in (("weight_version", weight_version), ("load_format", load_format),
                           ("abort_all_requests", abort_all_requests), ("flush_cache", flush_cache)):
            if value is not None:
                body[key] = value
        result = await self._post("/update_weights_from_disk", body)
        if not (isinstance(result, dict) and result.get("success")):
            raise EngineError(
                f"engine at {self.base_url}: update_weights_from_disk failed: {str(result)[:300]}"
            )
        return result

    async def begin_weight_update(
        self, *, workers: list[str] | None = None, timeout_s: float | None = None
    ) -> Any:
        """Open the bracket SGLang 0.5.2x requires around tensor and distributed updates (the
        router also pauses generation there, by its `update_pause_mode`; on `workers` only,
        when given, else on every worker in rotation)."""
        body = {} if workers is None else {"workers": workers}
        return await self._request("POST", "/begin_weight_update", body, timeout_s)

    async def end_weight_update(
        self, *, workers: list[str] | None = None, timeout_s: float | None = None
    ) -> Any:
        """Close the bracket (the router resumes generation and reads back every version)."""
        body = {} if workers is None else {"workers": workers}
        return await self._request("POST", "/end_weight_update", body, timeout_s)

    async def workers(self, *, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """The router's workers (`GET /workers`: url, quarantined, weight_version, ...); a bare
        SGLang server, which has no such list, is its own one worker."""
        try:
            async with self.session.get(
                self.base_url + "/workers", headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                if resp.status == 404:
                    return [{"url": self.base_url, "quarantined": False}]
                await _raise_for_status(resp, "/workers")
                return list((await resp.json()).get("workers", []))
        except (aiohttp.ClientError, TimeoutError) as e:
            raise EngineError(f"engine at {self.base_url} unreachable (/workers): {e!r}") from e

    async def init_weights_update_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str, backend: str, timeout_s: float | None = None,
    ) -> Any:  # fmt: skip
        """Join the trainer's weight-update process group (one engine: per-engine rank offset).
        Returns once every rank joined."""
        body = {"master_address": master_address, "master_port": master_port,
                "rank_offset": rank_offset, "world_size": world_size,
                "group_name": group_name, "backend": backend}
        return await self._request("POST", "/init_weights_update_group", body, timeout_s)

    async def destroy_weights_update_group(
        self, group_name: str, *, timeout_s: float | None = None
    ) -> Any:
        return await self._request(
            "POST", "/destroy_weights_update_group", {"group_name": group_name}, timeout_s
        )

    async def update_weights_from_distributed(
        self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        weight_version: str | None, flush_cache: bool, flattened: bool = True,
        selector: Selector = "all", timeout_s: float | None = None,
    ) -> Any:  # fmt: skip
        """Receive one broadcast bucket (`flattened`: one flat uint8 tensor of every named
        tensor's bytes, in order) and load it into the `selector`ed models (a speculative
        engine's target, its draft, or both; see `Selector`); `weight_version` is set once it
        is loaded."""
        body = _in_memory_update(
            {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
             "flush_cache": flush_cache},
            selector=selector, flattened=flattened, weight_version=weight_version,
        )
        return await self._request("POST", "/update_weights_from_distributed", body, timeout_s)

    async def update_weights_from_tensor(
        self, serialized: list[str], *, weight_version: str | None, flush_cache: bool,
        flattened: bool = False, selector: Selector = "all", timeout_s: float | None = None,
    ) -> Any:  # fmt: skip
        """Load named tensors the engine reads from this host's shared memory into the
        `selector`ed models: `serialized` holds one base64 pickle (multiprocessing's
        ForkingPickler) per engine TP rank, of a list of (name, tensor) or, `flattened`, of
        SGLang's flattened bucket ({"flattened_tensor": one flat uint8 tensor, "metadata": each
        tensor's name, shape, dtype and byte range})."""
        body = _in_memory_update(
            {"serialized_named_tensors": serialized, "flush_cache": flush_cache},
            selector=selector, flattened=flattened, weight_version=weight_version,
        )
        return await self._request("POST", "/update_weights_from_tensor", body, timeout_s)

    async def restore_point(self, model_path: str | Path, weight_version: str) -> Any:
        """Router only: the newest weights as files, loaded by a worker that comes back (it
        restarted, or left quarantine) before it serves; weights synced in memory leave none."""
        return await self._post("/restore_point", {"model_path": os.path.abspath(model_path),
                                                   "weight_version": weight_version})

    async def health_generate(self) -> bool:
        """True if the engine completes a one-token generation (503 while starting: False)."""
        try:
            async with self.session.get(
                self.base_url + "/health_generate", timeout=self._timeout
            ) as resp:
                return resp.status == 200
        except aiohttp.ClientError:
            return False

    async def loads(self) -> list[dict[str, Any]]:
        """Per-scheduler load (num_running_reqs, num_waiting_reqs, token_usage, ...)."""
        result = await self._get("/v1/loads?include=core")
        return list(result.get("loads", []))

    async def model_info(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """The served model (and, from the router, every engine's weight version)."""
        return await self._fast("GET", "/model_info", None, self._headers, timeout_s)

    async def served_versions(self) -> dict[str, str | None]:
        """Weight version of every engine in rotation ({} if nothing answers): behind the
        router one entry per engine (quarantined ones left out: the router updates them when
        they come back), a bare SGLang server its own under its URL."""
        try:
            info = await self.model_info(timeout_s=5.0)
        except EngineError:
            return {}
        if not isinstance(info, dict):
            return {}
        workers = info.get("worker_weight_versions")
        if isinstance(workers, dict):
            down = set(info.get("quarantined_workers") or [])
            return {str(k): v for k, v in workers.items() if k not in down}
        return {self.base_url: info.get("weight_version")}

    async def server_info(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        return await self._get("/server_info", timeout_s)

    async def flush_cache(self) -> None:
        await self._post("/flush_cache", {})

    # --- plumbing ------------------------------------------------------------------------------
    async def _resolve_topk(self) -> None:
        if self.moe_topk is not None:
            return
        path = Path((await self.model_info()).get("model_path", "")) / "config.json"
        try:
            self.moe_topk = int(json.loads(path.read_text())["num_experts_per_tok"])
        except (OSError, ValueError, KeyError) as e:
            raise EngineError(
                f"cannot shape routed experts: {path} is not readable here; "
                "pass moe_topk to EngineClient"
            ) from e

    async def _fast(
        self, method: str, path: str, body: dict[str, Any] | None, headers: dict[str, str],
        timeout_s: float | None = None,
    ) -> Any:  # fmt: skip
        """A hot call through the keep-alive client (aiohttp's `_request` for https), its
        answer decoded as `_request` does; the same errors."""
        if self._address is None:
            return await self._request(method, path, body, timeout_s, headers=headers)
        resp: UpstreamResponse | None = None
        try:
            # asyncio's own timeout, not a cancel scope: it is the cheaper of the two per call.
            async with asyncio.timeout(self._timeout_s if timeout_s is None else timeout_s):
                resp = await self._pool.request(
                    self._address, method, self._prefix + path,
                    [*headers.items(), *_JSON.items()] if body is not None else list(headers.items()),
                    b"" if body is None else json_body(body))  # fmt: skip
                data = await resp.read()
        except (NotSent, UpstreamFailed, TimeoutError) as e:
            raise self._unreachable(path, e) from e
        finally:
            if resp is not None:
                resp.close()  # a no-op once the body was read and the connection pooled
        if resp.status != 200:
            raise _refusal(self._origin, path, resp.status, data)
        return _decoded(data)

    async def _post(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
        return await self._request("POST", path, body, headers=headers)

    async def _get(self, path: str, timeout_s: float | None = None) -> Any:
        return await self._request("GET", path, None, timeout_s)

    async def _request(
        self, method: str, path: str, body: dict[str, Any] | None, timeout_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:  # fmt: skip
        timeout = self._timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self.session.request(
                method, self.base_url + path, data=None if body is None else json_body(body),
                headers={**(headers or self._headers), **_JSON} if body is not None
                else headers or self._headers,
                timeout=timeout,
            ) as resp:
                await _raise_for_status(resp, path)
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise self._unreachable(path, e) from e
        return _decoded(text)

    def _stream_failed(self, e: BaseException) -> EngineError:
        """The error for a `/generate` stream cut short: `EngineUnavailableError` when no
        connection could be opened (nothing sent), else `EngineError`."""
        error = EngineUnavailableError if _not_sent(e) else EngineError
        return error(f"engine at {self.base_url}: /generate stream failed: {e!r}")

    def _unreachable(self, path: str, e: BaseException) -> EngineError:
        """The error for a call that got no answer. No connection could be opened (the router
        restarting, say): nothing was sent, so it is `EngineUnavailableError`, safe to send
        again. Anything later (a reset, a timeout) may follow a generation: `EngineError`."""
        error = EngineUnavailableError if _not_sent(e) else EngineError
        return error(
            f"engine at {self.base_url} unreachable ({path}): {type(e).__name__}: {e}; start "
            "it (`agent-rl serve`, `agent-rl router`, `agent-rl engine start`) or fix its URL"
        )


def _not_sent(e: BaseException) -> bool:
    """Whether a call failed before a byte of it left: no connection could be opened (refused,
    or not within the timeout; a TLS handshake that fails is a setup error, not this)."""
    if isinstance(e, NotSent):
        return True
    return isinstance(e, aiohttp.ClientConnectorError) and not isinstance(e, aiohttp.ClientSSLError)


def _decoded(body: str | bytes) -> Any:
    """An answer's body: None when empty, its JSON, or the text itself."""
    if not body:
        return None
    try:
        return jsonfast.loads(body)
    except ValueError:  # not JSON, or not UTF-8: parsed as its text with replacement characters
        text = body.decode(errors="replace") if isinstance(body, bytes) else body
        try:
            return json.loads(text)
        except ValueError:
            return text


def _sse_data(line: bytes) -> str | None:
    """The payload of a server-sent event's `data:` line (`[DONE]` at the end); None for any
    other line."""
    text = line.decode().strip()
    return text[len("data:"):].strip() if text.startswith("data:") else None


async def _raise_for_status(resp: aiohttp.ClientResponse, path: str) -> None:
    if resp.status != 200:
        raise _refusal(str(resp.url.origin()), path, resp.status,
                       b"" if resp.status == 401 else await resp.read())


def _refusal(origin: str, path: str, status: int, body: bytes) -> EngineError:
    """The error for an answer other than 200: a 401 is the router's admin token missing or
    wrong, a 503 `EngineUnavailableError` (no engine took the request: safe to send again)."""
    if status == 401:
        return EngineError(
            f"router at {origin} refused {path} (401): set [router] admin_token to the "
            "router's admin token"
        )
    detail = body.decode(errors="replace")[:500]
    error = EngineUnavailableError if status == 503 else EngineError
    return error(f"engine at {origin}: {path} answered {status}: {detail}")
