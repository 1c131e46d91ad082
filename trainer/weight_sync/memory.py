"""The in-memory modes' common sequence: the trainer's weights reach the engines without a file.

`InMemorySync.push` is what `distributed` (distributed.py) and `tensor` (tensor.py) share: the
router's worker list (`GET /workers`: one call, its workers in rotation; a bare SGLang server is
its own one worker), then `/begin_weight_update` on the router, which pauses generation by its
`update_pause_mode` (the path disk updates take), every bucket (the subclass's `_send`), and
`/end_weight_update`, which resumes and reads back every engine's version. The policy version is
the weight version, set with the last bucket. An MTP draft's tensors travel last, in buckets of
their own that SGLang loads into a speculative engine's draft model (`selector: "draft"`;
`parts`).

Failures stay bounded: every call and every collective has `trainer.weight_sync.timeout_s`.
An engine that fails a bucket (it died, or hung) is dropped and the whole version sent again
to the others within the same pause. The push reports the engines it lost; the loop counts a failed
sync and carries on. A dropped engine rejoins at the next push once the router lists it again,
and before serving it loads the newest export from disk: `exported` names each export to the
router as its restore point (`/restore_point`, the documented fallback: weights in memory leave
no file).
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import torch

from agent_rl.config.trainer import WeightSyncConfig
from agent_rl.kernel.encoding import version_label
from agent_rl.kernel.errors import EngineError
from agent_rl.sglang.client import EngineClient, Selector
from trainer import hf_convert
from trainer.weight_sync.base import PushReport, Receiver, WeightSync

Bucket = list[tuple[str, torch.Tensor]]


def buckets(weights: dict[str, torch.Tensor], limit_bytes: int) -> Iterator[Bucket]:
    """The named tensors in order, cut into buckets of at most `limit_bytes` (a larger tensor
    travels alone), never between tensors SGLang fuses only within one load
    (`hf_convert.load_groups`: DeepSeek-V3's `q_a_proj` and `kv_a_proj_with_mqa`, which travel
    together, a larger pair alone); each bucket is one `load_weights` call on the engine."""
    bucket: Bucket = []
    size = 0
    for group in hf_convert.load_groups(weights):
        nbytes = sum(weights[n].numel() * weights[n].element_size() for n in group)
        if bucket and size + nbytes > limit_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend((name, weights[name]) for name in group)
        size += nbytes
    if bucket:
        yield bucket


def parts(weights: dict[str, torch.Tensor], limit_bytes: int) -> Iterator[tuple[Bucket, Selector]]:
    """The buckets of a push, each with the engine models that load it: the policy's tensors
    for the target, the MTP draft's (`trainer.mtp.layers`: `mtp.*`, an EAGLE module's, a
    native NextN layer's `model.layers.{num_hidden_layers}.*`; `hf_convert.draft_names`) after
    them, in buckets of their own, for the draft, under the names an export gives them. A
    speculative engine loads each part into its one model (the target skips `mtp.*` and the
    NextN layer anyway, and a Qwen2 target warns of every name it does not know); an engine
    serving no draft has nothing to load for the draft's parts."""
    names = hf_convert.draft_names(weights)
    policy = {n: t for n, t in weights.items() if n not in names}
    draft = {n: t for n, t in weights.items() if n in names}
    for bucket in buckets(policy, limit_bytes):
        yield bucket, "target"
    for bucket in buckets(draft, limit_bytes):
        yield bucket, "draft"


class Buffer:
    """The flat byte buffer buckets are packed into, kept from bucket to bucket and push to
    push (the buckets are sent one at a time, each received before the next is packed): a new
    one per bucket cost an allocation and first-touch page faults, in shared memory a file too
    (105M parameters: 0.7-0.9 s of a 1.1 s push); one already mapped costs only the copy. It
    holds one bucket (`bucket_mb`), as the per-bucket allocations did."""

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


class InMemorySync(WeightSync, abc.ABC):
    """The common sequence of `distributed` and `tensor` pushes; see the module docstring."""

    in_memory = True

    def __init__(self, router: EngineClient, cfg: WeightSyncConfig,
                 default_bucket_mb: float = 256.0) -> None:  # fmt: skip
        """`default_bucket_mb`: the bucket size when `bucket_mb` is unset."""
        super().__init__(router, cfg)
        self.timeout_s = cfg.timeout_s
        self.limit_bytes = int((cfg.bucket_mb or default_bucket_mb) * 1024 * 1024)
        self._clients: dict[str, EngineClient] = {}

    async def receivers(self) -> list[Receiver]:
        """The router's workers in rotation that answer now, each with its TP size."""
        listed = [w for w in await self.router.workers() if not w.get("quarantined")]

        async def probe(url: str) -> Receiver | None:
            client = self._clients.get(url) or EngineClient(url, timeout_s=self.timeout_s)
            self._clients[url] = client
            try:
                info = await client.server_info(timeout_s=min(self.timeout_s, 10.0))
            except EngineError:
                return None
            tp = int(info.get("tp_size", 1)) if isinstance(info, dict) else 1
            return Receiver(url, tp, client)

        found = await asyncio.gather(*(probe(str(w["url"])) for w in listed))
        return [e for e in found if e is not None]

    async def push(self, weights: dict[str, torch.Tensor], version: int) -> PushReport:
        """Every engine in rotation serves `weights` as `version`, or is reported dropped."""
        started = time.monotonic()
        report = PushReport(version)
        engines = await self.receivers()
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
                failed = await self._send(weights, version_label(version), engines, flush, report)
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
        self, weights: dict[str, torch.Tensor], version: str, engines: list[Receiver],
        flush: bool, report: PushReport,
    ) -> dict[str, str]:  # fmt: skip
        """Send every bucket to `engines`; the engines that failed (url: why), {} when none."""

    async def exported(self, export: Path, version: int) -> bool:
        """The router's restore point: a returning engine loads `export` before it serves."""
        try:
            await self.router.restore_point(export, version_label(version))
        except EngineError as e:
            raise EngineError(f"the router did not take it as its restore point ({e}); a "
                              "returning engine waits for the next push") from e
        return False

    async def close(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()

