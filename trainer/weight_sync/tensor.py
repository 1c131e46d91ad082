"""`trainer.weight_sync.mode = "tensor"`: the weights handed over in this host's shared memory.

For engines on the trainer's host: each bucket is one flat byte tensor in shared memory (one
buffer kept from push to push), pickled as its handle (multiprocessing's ForkingPickler,
`file_system` sharing) with each tensor's byte range, and loaded through
`/update_weights_from_tensor` (`load_format: flattened_bucket`). The push's sequence around the
buckets is memory.py's `InMemorySync.push`.
"""

from __future__ import annotations

import asyncio
import base64
import io
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from agent_rl.config.trainer import WeightSyncConfig
from agent_rl.sglang.client import EngineClient
from trainer.weight_sync.base import PushReport, Receiver
from trainer.weight_sync.memory import Buffer, InMemorySync, parts


class SharedMemory(InMemorySync):
    """`mode = "tensor"`: buckets handed over through this host's shared memory."""

    def __init__(self, router: EngineClient, cfg: WeightSyncConfig) -> None:
        super().__init__(router, cfg)
        # CPU tensors cross processes as shared-memory files; descriptors cannot be passed to
        # an engine that is not our child.
        torch.multiprocessing.set_sharing_strategy("file_system")
        self._buffer = Buffer(torch.device("cpu"), shared=True)

    async def _send(
        self, weights: dict[str, torch.Tensor], version: str, engines: list[Receiver],
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

