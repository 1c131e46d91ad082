"""Weight sync in memory: the trainer's weights reach the engines without a file in between.

`trainer.weight_sync` picks how the engines get each new policy version:

- `disk` (the loop's own path): an HF export per version, loaded by every engine through the
  router's `/update_weights_from_disk`.
- `distributed` (`Broadcast`): the trainer (rank 0) and every engine in rotation (ranks from 1,
  each engine its TP size) form one torch process group, gloo on CPU and NCCL on GPU; each
  bucket of HF-named tensors is broadcast as one flat byte tensor while every engine receives it
  through `/update_weights_from_distributed` (`load_format: flattened_bucket`).
- `tensor` (`SharedMemory`): for engines on this host, each bucket is one flat byte tensor in
  shared memory, pickled as its handle (multiprocessing's ForkingPickler, `file_system`
  sharing) with each tensor's byte range, and loaded through `/update_weights_from_tensor`
  (`load_format: flattened_bucket`).

Both run the same sequence (`InMemorySync.push`): the router's worker list (`GET /workers`: one
call, its workers in rotation; a bare SGLang server is its own one worker), then
`/begin_weight_update` on the router, which pauses generation by its `update_pause_mode` (the
path disk updates take), every bucket, and `/end_weight_update`, which resumes and reads back
every engine's version. The policy version is the weight version, set with the last bucket.
An MTP draft's tensors travel last, in buckets of their own that SGLang loads into a speculative
engine's draft model (`selector: "draft"`; `parts`).

Failures stay bounded: every call and every collective has `weight_sync_timeout_s`. An engine
that fails a bucket (it died, or hung) is dropped: the group is torn down (which also frees the
engines still waiting in it), rebuilt without that engine, and the whole version sent again to
the others within the same pause. The push reports the engines it lost; the loop counts a
failed sync and carries on. A dropped engine rejoins at the next push once the router lists it
again, and before serving it loads the newest export from disk (the router's `/restore_point`,
the documented fallback: weights in memory leave no file).
"""

from __future__ import annotations

import abc
import asyncio
import base64
import io
import itertools
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from agent_rl.config import TrainerConfig
from agent_rl.sglang.client import EngineClient, Selector
from agent_rl.kernel.errors import EngineError
from trainer import hf_convert

Bucket = list[tuple[str, torch.Tensor]]


def buckets(weights: dict[str, torch.Tensor], limit_bytes: int) -> Iterator[Bucket]:
    """The named tensors in order, cut into buckets of at most `limit_bytes` (a larger tensor
    travels alone)."""
    bucket: Bucket = []
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def parts(weights: dict[str, torch.Tensor], limit_bytes: int) -> Iterator[tuple[Bucket, Selector]]:
    """The buckets of a push, each with the engine models that load it: the policy's tensors
    for the target, the MTP draft's (`mtp.*`, `trainer.mtp_layers`) after them, in buckets of
    their own, for the draft. A speculative engine loads each part into its one model (the
    target skips `mtp.*` anyway, and a Qwen2 target warns of every name it does not know); an
    engine serving no draft has nothing to load for the draft's parts."""
    policy = {n: t for n, t in weights.items() if not hf_convert.is_draft(n)}
    draft = {n: t for n, t in weights.items() if hf_convert.is_draft(n)}
    for bucket in buckets(policy, limit_bytes):
        yield bucket, "target"
    for bucket in buckets(draft, limit_bytes):
        yield bucket, "draft"


def broadcast_meta(bucket: Bucket) -> dict[str, list[Any]]:
    """What an engine allocates a broadcast bucket from: each tensor's name, dtype and shape, in
    order (SGLang lays them out back to back, as `Buffer.fill(align=False)` packs them)."""
    return {"names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}  # fmt: skip


class Buffer:
    """The flat byte buffer buckets are packed into, kept from bucket to bucket and push to
    push (the buckets are sent one at a time, each received before the next is packed): a new
    one per bucket cost an allocation and first-touch page faults, in shared memory a file too
    (105M parameters: 0.7-0.9 s of a 1.1 s push); one already mapped costs only the copy. It
    holds one bucket (`weight_sync_bucket_mb`), as the per-bucket allocations did."""

    def __init__(self, device: torch.device, *, shared: bool) -> None:
        self.device, self.shared = device, shared
        self._flat = torch.empty(0, dtype=torch.uint8, device=device)

    def fill(self, bucket: Bucket, *, align: bool) -> tuple[torch.Tensor, list[SimpleNamespace]]:
        """`bucket` copied into the buffer (not shared: a view of its first bytes), and each
        tensor's name, shape, dtype and byte range in it (`align`: each starts at a multiple of
        its dtype's size; otherwise back to back)."""
        spans, offset = [], 0
        for name, t in bucket:
            if align:
                offset += -offset % t.element_size()
            nbytes = t.numel() * t.element_size()
            spans.append(SimpleNamespace(name=name, shape=t.shape, dtype=t.dtype, start_idx=offset,
                                         end_idx=offset + nbytes, numel=nbytes))  # fmt: skip
            offset += nbytes
        if self._flat.numel() < offset:
            flat = torch.empty(offset, dtype=torch.uint8, device=self.device)
            self._flat = flat.share_memory_() if self.shared else flat
        for (_, t), span in zip(bucket, spans):
            dst = self._flat[span.start_idx : span.end_idx]
            dst.copy_(t.detach().reshape(-1).view(torch.uint8))
        # Shared: the whole buffer (its ranges say where each tensor is); broadcast: exactly the
        # bytes the engines allocate from the names, dtypes and shapes.
        return (self._flat if self.shared else self._flat[:offset]), spans

    def clear(self) -> None:
        self._flat = torch.empty(0, dtype=torch.uint8, device=self.device)


@dataclass
class Engine:
    """One engine of the fleet as the sync addresses it."""

    url: str
    tp_size: int = 1
    client: EngineClient | None = field(default=None, repr=False)


@dataclass
class PushReport:
    """What one push did: the engines that took the version, the ones dropped (url: why)."""

    version: int
    seconds: float = 0.0
    paused_s: float = 0.0
    """From pausing the engines (`/begin_weight_update`) until they serve again."""
    updated: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    buckets: int = 0

    @property
    def ok(self) -> bool:
        return bool(self.updated) and not self.dropped


class InMemorySync(abc.ABC):
    """The common sequence of `distributed` and `tensor` pushes; see the module docstring."""

    def __init__(self, router: EngineClient, cfg: TrainerConfig,
                 default_bucket_mb: float = 256.0) -> None:  # fmt: skip
        """`default_bucket_mb`: the bucket size when `weight_sync_bucket_mb` is unset."""
        self.router = router
        self.cfg = cfg
        self.timeout_s = cfg.weight_sync_timeout_s
        self.limit_bytes = int((cfg.weight_sync_bucket_mb or default_bucket_mb) * 1024 * 1024)
        self._clients: dict[str, EngineClient] = {}

    async def engines(self) -> list[Engine]:
        """The router's workers in rotation that answer now, each with its TP size."""
        listed = [w for w in await self.router.workers() if not w.get("quarantined")]

        async def probe(url: str) -> Engine | None:
            client = self._clients.get(url) or EngineClient(url, timeout_s=self.timeout_s)
            self._clients[url] = client
            try:
                info = await client.server_info(timeout_s=min(self.timeout_s, 10.0))
            except EngineError:
                return None
            tp = int(info.get("tp_size", 1)) if isinstance(info, dict) else 1
            return Engine(url, tp, client)

        found = await asyncio.gather(*(probe(str(w["url"])) for w in listed))
        return [e for e in found if e is not None]

    async def push(self, weights: dict[str, torch.Tensor], version: int) -> PushReport:
        """Every engine in rotation serves `weights` as `version`, or is reported dropped."""
        started = time.monotonic()
        report = PushReport(version)
        engines = await self.engines()
        if not engines:
            raise EngineError("weight sync: no engine behind the router answers")
        # A bare SGLang server takes no worker list; the router pauses only the engines named.
        named = None if [e.url for e in engines] == [self.router.base_url] else \
            [e.url for e in engines]
        paused = time.monotonic()
        try:
            # Inside the try: if one engine fails to begin, the others it paused resume.
            begin = await self.router.begin_weight_update(workers=named, timeout_s=self.timeout_s)
            # SGLang cannot flush a cache that requests paused in place still hold.
            flush = not (isinstance(begin, dict) and begin.get("update_pause_mode") == "in_place")
            while engines:
                failed = await self._send(weights, str(version), engines, flush, report)
                if not failed:
                    break
                report.dropped.update(failed)
                engines = [e for e in engines if e.url not in failed]
            report.updated = [e.url for e in engines]
        finally:
            try:
                await self.router.end_weight_update(workers=named, timeout_s=self.timeout_s)
            except EngineError:  # an engine dropped above cannot end its update
                if not report.dropped:
                    raise
            report.paused_s = time.monotonic() - paused
        report.seconds = time.monotonic() - started
        return report

    @abc.abstractmethod
    async def _send(
        self, weights: dict[str, torch.Tensor], version: str, engines: list[Engine],
        flush: bool, report: PushReport,
    ) -> dict[str, str]:  # fmt: skip
        """Send every bucket to `engines`; the engines that failed (url: why), {} when none."""

    async def close(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()


class Broadcast(InMemorySync):
    """`weight_sync = "distributed"`: one process group with the engines, broadcast buckets."""

    def __init__(self, router: EngineClient, cfg: TrainerConfig) -> None:
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.device = torch.device("cuda" if self.backend == "nccl" else "cpu")
        # gloo on loopback: a 105M model's push took 0.52 s in 64 MB buckets, 0.68 s in 256 MB
        # ones and 0.88 s in 8 MB ones (per-bucket calls add up); NCCL keeps the larger buckets.
        super().__init__(router, cfg, default_bucket_mb=64.0 if self.backend == "gloo" else 256.0)
        # Group names unique beyond this process: an engine keeps the group of a trainer that
        # died without destroying it, and refuses a new group under the same name.
        self._prefix = f"agent-rl-weights-{secrets.token_hex(6)}"
        self._names = itertools.count()
        self._group: Any = None
        self._group_name = ""
        self._members: tuple[str, ...] = ()
        self._store: Any = None
        self._buffer = Buffer(self.device, shared=False)

    async def _send(
        self, weights: dict[str, torch.Tensor], version: str, engines: list[Engine],
        flush: bool, report: PushReport,
    ) -> dict[str, str]:  # fmt: skip
        members = tuple(e.url for e in engines)
        if members != self._members or self._group is None:
            failed = await self._form_group(engines)
            if failed:
                return failed
        # Pipelined: once a bucket's broadcast is done (every engine has its bytes), the next is
        # packed and asked for while the engines still load the one before, so an engine takes
        # the next bucket as soon as it is done (105M parameters on CPU: the trainer's packing
        # and the request's round trip were a quarter of each bucket's time).
        cut = list(parts(weights, self.limit_bytes))
        loading: list[asyncio.Future[Any]] = []  # the answers of the bucket the engines load
        for i, (bucket, selector) in enumerate(cut):
            last = i == len(cut) - 1
            receives, sent = await self._broadcast_bucket(
                bucket, selector, engines, version if last else None, flush and last)
            failed = await self._answers(loading, engines, None)  # {} before the first
            if failed:
                await asyncio.gather(*receives, return_exceptions=True)  # they end too
                return failed
            if sent is not None:
                return await self._answers(receives, engines, sent)
            report.buckets += bool(loading)
            loading = receives
        failed = await self._answers(loading, engines, None)
        report.buckets += not failed
        return failed

    async def _form_group(self, engines: list[Engine]) -> dict[str, str]:
        """A new group of this trainer (rank 0) and `engines`; the engines that failed to join."""
        await self._drop_group()
        world = 1 + sum(e.tp_size for e in engines)
        name = f"{self._prefix}-{next(self._names)}"
        timeout = timedelta(seconds=self.timeout_s)
        # The store is ours: port 0 picks a free one, and dropping it ends the engines' waits.
        store = dist.TCPStore(self.cfg.weight_sync_host, 0, world, is_master=True,
                              timeout=timeout, wait_for_workers=False)
        self._store = store
        offsets = itertools.accumulate([1] + [e.tp_size for e in engines])
        joins = [
            e.client.init_weights_update_group(  # type: ignore[union-attr]
                master_address=self.cfg.weight_sync_host, master_port=store.port,
                rank_offset=offset, world_size=world, group_name=name, backend=self.backend,
                timeout_s=self.timeout_s,
            )
            for e, offset in zip(engines, offsets)
        ]
        group, *answers = await asyncio.gather(
            asyncio.to_thread(_new_group, store, world, name, self.backend, timeout),
            *joins, return_exceptions=True,
        )
        failed = {e.url: f"joining the group: {a}"[:300] for e, a in zip(engines, answers)
                  if isinstance(a, BaseException)}
        if isinstance(group, BaseException) or failed:
            if not isinstance(group, BaseException):
                self._group = group
            await self._drop_group()
            return failed or {e.url: f"group not formed: {group}"[:300] for e in engines}
        self._group, self._group_name, self._members = group, name, tuple(e.url for e in engines)
        return {}

    async def _broadcast_bucket(
        self, bucket: Bucket, selector: Selector, engines: list[Engine], version: str | None,
        flush: bool,
    ) -> tuple[list[asyncio.Future[Any]], BaseException | None]:  # fmt: skip
        """Ask every engine to receive `bucket` (into its `selector`ed models) and broadcast
        it: the engines' answers (they come once each has loaded it) and the broadcast's
        error, None when it went out."""
        # Contiguous: the engines compute the same offsets from the names, dtypes and shapes.
        # The buffer is free again: the previous broadcast is done.
        flat, _ = self._buffer.fill(bucket, align=False)
        meta = broadcast_meta(bucket)
        receives = [
            asyncio.ensure_future(e.client.update_weights_from_distributed(  # type: ignore[union-attr]
                **meta, group_name=self._group_name, weight_version=version, flush_cache=flush,
                selector=selector, timeout_s=self.timeout_s))
            for e in engines
        ]
        try:
            await asyncio.to_thread(_broadcast, self._group, flat, self.timeout_s)
            return receives, None
        except Exception as e:  # noqa: BLE001 (gloo/NCCL raise RuntimeError and kin)
            # Tear the group down now: engines still waiting in it get an error, not a hang.
            await self._drop_group()
            return receives, e

    async def _answers(self, receives: list[asyncio.Future[Any]], engines: list[Engine],
                       sent: BaseException | None) -> dict[str, str]:
        """The engines that failed a bucket (url: why), from their answers and the broadcast's
        error `sent`; {} when every engine loaded it."""
        answers = await asyncio.gather(*receives, return_exceptions=True)
        failed = {e.url: str(a)[:300] for e, a in zip(engines, answers)
                  if isinstance(a, BaseException)}
        if sent is not None and not failed:
            failed = {e.url: f"broadcast failed: {sent}"[:300] for e in engines}
        if failed and sent is None:
            await self._drop_group()
        if failed:
            # Those that received nothing from a torn-down group are fine: drop only the dead.
            alive = await asyncio.gather(*(self._alive(e) for e in engines))
            really = {url: why for (url, why), ok in
                      zip(((e.url, failed.get(e.url)) for e in engines), alive)
                      if why is not None and not ok}
            failed = really or failed
            if not really:
                # Every engine answers yet one failed: the failure is the bucket's, not an
                # engine's. Report them all rather than loop on the same failure.
                return {e.url: failed.get(e.url, "broadcast failed") for e in engines}
        return failed

    async def _alive(self, engine: Engine) -> bool:
        try:
            await engine.client.model_info(timeout_s=5.0)  # type: ignore[union-attr]
            return True
        except EngineError:
            return False

    async def _drop_group(self) -> None:
        """Destroy our side of the group (its sockets close) and ask the members to do theirs."""
        group, name, members = self._group, self._group_name, self._members
        self._group, self._group_name, self._members, self._store = None, "", (), None
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 (a half-formed group may not be registered)
                pass
            del group
        if name:
            await asyncio.gather(*(
                self._clients[url].destroy_weights_update_group(name, timeout_s=5.0)
                for url in members if url in self._clients
            ), return_exceptions=True)

    async def close(self) -> None:
        await self._drop_group()
        self._buffer.clear()
        await super().close()


def _new_group(store: Any, world: int, name: str, backend: str, timeout: timedelta) -> Any:
    """Rank 0 of the group the engines build with `init_weights_update_group`. SGLang makes its
    side with torch's own process-group helper over `PrefixStore(group name, tcp store)`; ours
    is made the same way so that every store key matches (the helper is private to torch, and
    the only way to a group outside the default world)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper

    group, _ = _new_process_group_helper(
        world, 0, [], Backend(backend), PrefixStore(name, store), group_name=name,
        timeout=timeout,
    )
    return group


def _broadcast(group: Any, flat: torch.Tensor, timeout_s: float) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([flat], options).wait(timedelta(seconds=timeout_s))


class SharedMemory(InMemorySync):
    """`weight_sync = "tensor"`: buckets handed over through this host's shared memory."""

    def __init__(self, router: EngineClient, cfg: TrainerConfig) -> None:
        super().__init__(router, cfg)
        # CPU tensors cross processes as shared-memory files; descriptors cannot be passed to
        # an engine that is not our child.
        torch.multiprocessing.set_sharing_strategy("file_system")
        self._buffer = Buffer(torch.device("cpu"), shared=True)

    async def _send(
        self, weights: dict[str, torch.Tensor], version: str, engines: list[Engine],
        flush: bool, report: PushReport,
    ) -> dict[str, str]:  # fmt: skip
        cut = list(parts(weights, self.limit_bytes))
        for i, (bucket, selector) in enumerate(cut):
            last = i == len(cut) - 1
            # SGLang's `flattened_bucket` load format: one flat byte tensor in shared memory and
            # each tensor's name, shape, dtype and byte range in it (per-tensor shared memory
            # cost a file and a second copy per tensor).
            flat, spans = self._buffer.fill(bucket, align=True)
            shared = {"flattened_tensor": flat, "metadata": spans}
            # One pickle per receiving rank: each pickle takes a reference on the shared memory
            # that its one unpickling gives back; one pickle read by two ranks gave back two,
            # and the buffer's count fell below zero (the process aborted when it was freed).
            answers = await asyncio.gather(*(
                e.client.update_weights_from_tensor(  # type: ignore[union-attr]
                    [_pickle(shared) for _ in range(e.tp_size)],
                    weight_version=version if last else None,
                    flush_cache=flush and last, flattened=True, selector=selector,
                    timeout_s=self.timeout_s)
                for e in engines
            ), return_exceptions=True)
            failed = {e.url: str(a)[:300] for e, a in zip(engines, answers)
                      if isinstance(a, BaseException)}
            if failed:
                return failed
            report.buckets += 1
        return {}

    async def close(self) -> None:
        self._buffer.clear()
        await super().close()


def _pickle(named: Any) -> str:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode()


def make_sync(router: EngineClient, cfg: TrainerConfig) -> InMemorySync | None:
    """The in-memory sync `cfg.weight_sync` asks for; None for `disk` (the loop's own path)."""
    if cfg.weight_sync == "distributed":
        return Broadcast(router, cfg)
    if cfg.weight_sync == "tensor":
        return SharedMemory(router, cfg)
    return None
