"""`trainer.weight_sync.mode = "distributed"`: weights broadcast over one process group.

The trainer (rank 0) and every engine in rotation (ranks from 1, each engine its TP size) form
one torch process group, gloo on CPU and NCCL on GPU; each bucket of HF-named tensors is
broadcast as one flat byte tensor while every engine receives it through
`/update_weights_from_distributed` (`load_format: flattened_bucket`). Pipelined: the next
bucket is packed and asked for while the engines load the one before. An engine that fails a
bucket tears the group down (which also frees the engines still waiting in it); the group is
rebuilt without it and the version sent again (memory.py's `InMemorySync.push`).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from agent_rl.config.trainer import WeightSyncConfig
from agent_rl.kernel.errors import EngineError
from agent_rl.sglang.client import EngineClient, Selector
from trainer.weight_sync.base import PushReport, Receiver
from trainer.weight_sync.memory import Bucket, Buffer, InMemorySync, parts


def broadcast_meta(bucket: Bucket) -> dict[str, list[Any]]:
    """What an engine allocates a broadcast bucket from: each tensor's name, dtype and shape, in
    order (SGLang lays them out back to back, as `Buffer.fill(align=False)` packs them)."""
    return {"names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}  # fmt: skip



class Broadcast(InMemorySync):
    """`mode = "distributed"`: one process group with the engines, broadcast buckets."""

    def __init__(self, router: EngineClient, cfg: WeightSyncConfig) -> None:
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
        self, weights: dict[str, torch.Tensor], version: str, engines: list[Receiver],
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

    async def _form_group(self, engines: list[Receiver]) -> dict[str, str]:
        """A new group of this trainer (rank 0) and `engines`; the engines that failed to join."""
        await self._drop_group()
        world = 1 + sum(e.tp_size for e in engines)
        name = f"{self._prefix}-{next(self._names)}"
        timeout = timedelta(seconds=self.timeout_s)
        # The store is ours: port 0 picks a free one, and dropping it ends the engines' waits.
        store = dist.TCPStore(self.cfg.host, 0, world, is_master=True,
                              timeout=timeout, wait_for_workers=False)
        self._store = store
        offsets = itertools.accumulate([1] + [e.tp_size for e in engines])
        joins = [
            e.client.init_weights_update_group(  # type: ignore[union-attr]
                master_address=self.cfg.host, master_port=store.port,
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
        self, bucket: Bucket, selector: Selector, engines: list[Receiver], version: str | None,
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

    async def _answers(self, receives: list[asyncio.Future[Any]], engines: list[Receiver],
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

    async def _alive(self, engine: Receiver) -> bool:
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

