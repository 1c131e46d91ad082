"""Control operations fanned out to the workers: abort, pause/continue, weight updates, loads.

SGLang's control endpoints act on one server; a trainer or scheduler talking to the router wants
them to act on the fleet. Each handler here sends the caller's body, unchanged, to the workers it
concerns and answers with one JSON object holding every worker's status and reply, so a partial
failure is visible instead of averaged away. The answer is 200 when every worker succeeded; the
workers' 4xx when every one of them refused the call as a client error (the caller's mistake,
reported as such: their common status, or 400 when they differ); 502 otherwise (a worker failed,
did not answer, or refused what another accepted). A 401 or 403 from a worker is the router's
own credentials failing there, so it counts as a worker failure, not the caller's.

Weight updates from disk run, on each worker concurrently: pause generation (`retract` by
default: in-flight requests are recomputed on the new weights and SGLang flushes its prefix
cache), update, continue, read back `weight_version` from `/model_info`. In `in_place` mode
(requests keep their place, their tokens labelled by `meta_info.weight_versions`) the update is
sent with `flush_cache: false` unless the caller chose otherwise: SGLang cannot flush a cache
that paused requests still hold. The newest update every worker took is replayed to a worker
restored from quarantine. While a worker is in that sequence it is marked `updating`, and new sessions go to
workers that already finished. Tensor and distributed updates are driven by the trainer against
each worker (they carry per-worker payloads and ranks; `GET /workers` lists them); the router
brackets them with `/begin_weight_update` (pause by the same mode, then begin) and
`/end_weight_update` (end, resume, read back versions), fanned out to the workers in rotation.
Such updates leave no files, so the trainer names its newest export with `/restore_point`: that
is what a restored worker loads before it serves.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable

import aiohttp
from aiohttp import web

from agent_rl.config import RouterConfig
from agent_rl.kernel.encoding import version_label
from router.errors import error_response
from router.proxy import Proxy
from router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)

Result = dict[str, Any]


class Control:
    """Handlers for the fan-out endpoints."""

    def __init__(
        self,
        config: RouterConfig,
        pool: WorkerPool,
        proxy: Proxy,
        session: Callable[[], aiohttp.ClientSession],
    ) -> None:
        self.config = config
        self.pool = pool
        self.proxy = proxy
        self._session = session
        self._timeout = aiohttp.ClientTimeout(
            total=config.control_timeout_s, sock_connect=config.connect_timeout_s
        )
        self.update_lock = asyncio.Lock()
        self.last_update: tuple[bytes, str | None] | None = None
        """The newest weight update every worker took (body, version): a worker that comes back
        (a restarted engine, on its initial weights) is given it before it serves again."""
        """One weight update at a time; a second waits rather than interleaving pause/continue."""

    # -- plumbing ----------------------------------------------------------------------------

    async def call(
        self, worker: Worker, method: str, path: str, body: bytes | None,
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> Result:
        """One control call to one worker; never raises, the failure is in the result."""
        headers = {"Content-Type": "application/json"} if body is not None else {}
        timeout = timeout or self._timeout
        try:
            async with self._session().request(
                method, worker.url + path, data=body, headers=headers, timeout=timeout
            ) as r:
                raw = await r.read()
                try:
                    reply: Any = json.loads(raw) if raw else None
                except ValueError:
                    reply = raw.decode(errors="replace")
                ok = r.status < 400 and not (isinstance(reply, dict) and reply.get("success") is False)
                return {"url": worker.url, "status": r.status, "success": ok, "response": reply}
        except asyncio.TimeoutError:
            return {"url": worker.url, "status": None, "success": False,
                    "response": f"no answer within {timeout.total}s"}
        except aiohttp.ClientError as e:
            return {"url": worker.url, "status": None, "success": False,
                    "response": f"{type(e).__name__}: {e}"}

    async def fan_out(
        self, method: str, path: str, body: bytes | None, workers: list[Worker] | None = None
    ) -> list[Result]:
        targets = self.pool.all() if workers is None else workers
        return list(await asyncio.gather(*(self.call(w, method, path, body) for w in targets)))

    @staticmethod
    def answer(results: list[Result], **extra: Any) -> web.Response:
        if not results:
            return error_response(503, "the router has no workers to send this to")
        ok = all(r["success"] for r in results)
        return web.json_response({"success": ok, **extra, "workers": results},
                                 status=fleet_status(results))

    # -- endpoints ---------------------------------------------------------------------------

    async def broadcast(self, request: web.Request) -> web.Response:
        """`/pause_generation`, `/continue_generation`, `/flush_cache`, `/update_weight_version`,
        `/update_weights_from_distributed`, `/destroy_weights_update_group`: same call to all."""
        body = await request.read() if request.can_read_body else None
        return self.answer(await self.fan_out(request.method, request.path, body))

    async def abort(self, request: web.Request) -> web.Response:
        """`/abort_request`: by `rid` to every worker holding it, or to all (`abort_all`, a rid
        the router does not know)."""
        body = await request.read()
        try:
            payload = json.loads(body or b"{}")
        except ValueError:
            return error_response(400, "body must be JSON: {\"rid\": ...} or {\"abort_all\": true}")
        rid = payload.get("rid") if isinstance(payload, dict) else None
        holders = self.proxy.holders(rid) if isinstance(rid, str) else []
        targets = holders if holders and not payload.get("abort_all") else None
        return self.answer(await self.fan_out("POST", "/abort_request", body, targets))

    def _in_rotation(self) -> list[Worker]:
        """The workers a fleet-wide update goes to: a quarantined one gets it when restored."""
        return [w for w in self.pool.all() if not w.quarantined] or self.pool.all()

    def _targets(self, body: bytes | None, default: list[Worker]) -> tuple[bytes | None, list[Worker]]:
        """A begin/end body may name its `workers` (the ones a trainer's update reaches; an
        engine it found dead is left alone): those, and the body SGLang gets without them."""
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            return body, default
        if not isinstance(payload, dict) or not isinstance(payload.get("workers"), list):
            return body, default
        named = set(payload.pop("workers"))
        return json.dumps(payload).encode(), [w for w in self.pool.all() if w.url in named]

    async def begin_update(self, request: web.Request) -> web.Response:
        """Open a tensor or distributed update on every worker in rotation: pause generation
        (`update_pause_mode`, the same path as disk updates), then `/begin_weight_update`. The
        answer says the pause mode, so the caller knows whether SGLang may flush its cache."""
        body, workers = self._targets(await request.read() if request.can_read_body else None,
                                      self._in_rotation())
        for w in workers:
            w.updating = True

        async def one(worker: Worker) -> Result:
            paused = await self._pause(worker)
            if paused is not None:
                return paused
            return await self.call(worker, "POST", "/begin_weight_update", body)

        results = list(await asyncio.gather(*(one(w) for w in workers)))
        return self.answer(results, update_pause_mode=self.config.update_pause_mode)

    async def end_update(self, request: web.Request) -> web.Response:
        """Close the update on every worker in rotation or updating: `/end_weight_update`,
        resume generation, read back each version."""
        body, workers = self._targets(
            await request.read() if request.can_read_body else None,
            [w for w in self.pool.all() if w.updating or not w.quarantined])

        async def one(worker: Worker) -> Result:
            try:
                return await self._resumed(worker, await self.call(
                    worker, "POST", "/end_weight_update", body))
            finally:
                worker.updating = False

        results = list(await asyncio.gather(*(one(w) for w in workers)))
        return self.answer(results, weight_version=_common([r["weight_version"] for r in results]))

    async def restore_point(self, request: web.Request) -> web.Response:
        """`POST /restore_point {model_path, weight_version}`: weights on disk that a worker
        coming back loads before it serves (as after an update from disk), for fleets whose
        updates travel in memory and leave no files behind. Sent to no worker now."""
        try:
            payload = json.loads(await request.read())
        except ValueError:
            payload = None
        if not isinstance(payload, dict) or not payload.get("model_path") \
                or payload.get("weight_version") is None:
            return error_response(400, "restore_point needs model_path and weight_version")
        body = {"model_path": payload["model_path"], "weight_version": version_label(payload["weight_version"])}
        if self.config.update_pause_mode == "in_place":
            body["flush_cache"] = False
        self.last_update = (json.dumps(body).encode(), body["weight_version"])
        return web.json_response({"success": True, **body})

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            payload = json.loads(body)
        except ValueError:
            return error_response(400, "body must be JSON with at least model_path")
        if not isinstance(payload, dict) or not payload.get("model_path"):
            return error_response(400, "update_weights_from_disk needs model_path in the body")
        if self.config.update_pause_mode == "in_place" and "flush_cache" not in payload:
            # Requests paused in place keep their KV cache, so SGLang's default flush after the
            # update would fail ("requests are still running or queued"). The radix cache then
            # keeps prefixes computed with the old weights until the next /flush_cache.
            body = json.dumps(dict(payload, flush_cache=False)).encode()
        async with self.update_lock:
            # A quarantined worker is down or unhealthy: it gets this update when it is restored
            # (bring_up_to_date), instead of failing the fleet's update now.
            workers = self._in_rotation()
            for w in workers:
                w.updating = True
            results = await asyncio.gather(*(self._update_one(w, body) for w in workers))
            if any(r["success"] for r in results):
                self.last_update = (body, payload.get("weight_version"))
        versions = [r.get("weight_version") for r in results]
        return self.answer(list(results), weight_version=_common(versions))

    async def bring_up_to_date(self, worker: Worker) -> None:
        """Before a quarantined worker serves again: read its weight version and, if it differs
        from the fleet's newest update (an engine restarted on its initial weights), apply that
        update to it. Raises RuntimeError if it cannot, so the worker stays quarantined."""
        before = worker.weight_version
        worker.weight_version = None  # refresh_version keeps it only if the worker can say
        version = await self.refresh_version(worker)
        if version is None:
            worker.weight_version = before
        if self.last_update is None:
            return
        body, wanted = self.last_update
        if wanted is None or version == str(wanted):
            return
        async with self.update_lock:
            worker.updating = True
            result = await self._update_one(worker, body)
        if not result["success"]:
            raise RuntimeError(f"could not load the current weights (version {wanted}): "
                               f"{str(result.get('response'))[:200]}")
        log.info("worker %s: restored at weight version %s (was %s)", worker.url, wanted, version)

    async def _update_one(self, worker: Worker, body: bytes) -> Result:
        try:
            paused = await self._pause(worker)
            if paused is not None:
                return paused
            return await self._resumed(worker, await self.call(
                worker, "POST", "/update_weights_from_disk", body))
        finally:
            worker.updating = False

    async def _resumed(self, worker: Worker, result: Result) -> Result:
        """Resume `worker` after an update's `result`, even a failed one (a worker left paused
        would hang every request sent to it), and read back its weight version."""
        resumed = await self._resume(worker)
        if result["success"] and resumed is not None:
            result = resumed
        result["weight_version"] = await self.refresh_version(worker)
        return result

    async def _pause(self, worker: Worker) -> Result | None:
        """Pause generation on `worker` by `update_pause_mode` (every kind of weight update goes
        through here): None when paused (or mode none), else the failed call's result."""
        mode = self.config.update_pause_mode
        if mode == "none":
            return None
        paused = await self.call(worker, "POST", "/pause_generation",
                                 json.dumps({"mode": mode}).encode())
        return None if paused["success"] else dict(paused, step="pause_generation")

    async def _resume(self, worker: Worker) -> Result | None:
        """Undo `_pause`: None when resumed (or mode none), else the failed call's result."""
        if self.config.update_pause_mode == "none":
            return None
        resumed = await self.call(worker, "POST", "/continue_generation", b"{}")
        return None if resumed["success"] else dict(resumed, step="continue_generation")

    async def refresh_version(self, worker: Worker) -> str | None:
        """Read the worker's `weight_version` from `/model_info` (None if it cannot say)."""
        # A metadata read, bounded like a health check: a wedged worker must not stall a caller.
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        info = await self.call(worker, "GET", "/model_info", None, timeout)
        if info["success"] and isinstance(info["response"], dict):
            worker.weight_version = info["response"].get("weight_version")
        return worker.weight_version

    async def loads(self, request: web.Request) -> web.Response:
        """`GET /v1/loads`: every worker's `loads` list, each entry tagged with its worker."""
        path = "/v1/loads" + (f"?{request.query_string}" if request.query_string else "")
        results = await self.fan_out("GET", path, None)
        merged: list[Any] = []
        for r in results:
            if r["success"] and isinstance(r["response"], dict):
                for load in r["response"].get("loads", []):
                    merged.append(dict(load, worker=r["url"]) if isinstance(load, dict) else load)
        return web.json_response({"loads": merged, "workers": results},
                                 status=fleet_status(results) if results else 200)

    async def model_info(self, request: web.Request) -> web.Response:
        """`GET /model_info`: the first healthy worker's answer, plus every worker's version."""
        healthy = [w for w in self.pool if not w.quarantined] or self.pool.all()
        if not healthy:
            return error_response(503, "the router has no workers")
        first = await self.call(healthy[0], "GET", "/model_info", None,
                                aiohttp.ClientTimeout(total=self.config.health_timeout_s))
        if not first["success"] or not isinstance(first["response"], dict):
            return error_response(502, f"worker could not describe its model: {first['response']}",
                                  healthy[0].url)
        info = dict(first["response"])
        info["worker_weight_versions"] = {w.url: w.weight_version for w in self.pool}
        info["quarantined_workers"] = [w.url for w in self.pool if w.quarantined]
        return web.json_response(info)


def fleet_status(results: list[Result]) -> int:
    """The status of a fanned-out call, by the rule in this module's docstring."""
    if all(r["success"] for r in results):
        return 200
    statuses = {r["status"] for r in results}
    if all(isinstance(s, int) and 400 <= s < 500 and s not in (401, 403) for s in statuses):
        return statuses.pop() if len(statuses) == 1 else 400
    return 502


def _common(versions: list[str | None]) -> str | None:
    """The version all workers agree on, or None when they differ."""
    distinct = set(versions)
    return versions[0] if len(distinct) == 1 and versions else None
