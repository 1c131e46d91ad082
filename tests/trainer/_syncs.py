"""Weight-sync checks shared by the weight-sync and family tests: what an engine serves after a
sync, measured as its logprobs of fixed tokens against the learner's (fp32, within 1e-5); the
buckets a sync sends an MTP draft, for SGLang's draft class to load (`save_draft_buckets`), and
what SGLang's own draft class loads from them and from an export (`sglang_draft_loads`)."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import torch

from agent_rl.config.trainer import WeightSyncConfig
from agent_rl.sglang.client import EngineClient
from tests._engine_scripts import EngineScripts
from tests.trainer._batches import rl_batch
from trainer.batch import Batch
from trainer.learner import Learner
from trainer.weight_sync import MODES, make_sync
from trainer.weight_sync.distributed import broadcast_meta
from trainer.weight_sync.memory import Buffer, parts

def save_draft_buckets(weights: dict[str, torch.Tensor], path: Path) -> list[list[str]]:
    """The buckets both in-memory syncs send the draft (`parts`' `selector: "draft"` ones, cut
    small: several, each packed as it goes), saved at `path` as tests/trainer/_sglang_mtp_draft.py
    receives them: a `distributed` bucket's bytes with its broadcast metadata, a `tensor`
    bucket's shared bytes with each tensor's span. The names of each bucket."""
    drafts = [b for b, selector in parts(weights, 64 << 10) if selector == "draft"]
    sent: dict[str, list[dict]] = {"distributed": [], "tensor": []}
    for bucket in drafts:
        flat, _ = Buffer(torch.device("cpu"), shared=False).fill(bucket, align=False)
        sent["distributed"].append({**broadcast_meta(bucket), "flat": flat.clone()})
        flat, spans = Buffer(torch.device("cpu"), shared=False).fill(bucket, align=True)
        sent["tensor"].append({"flat": flat.clone(), "metadata": [vars(s) for s in spans]})
    torch.save(sent, path)
    return [[name for name, _ in bucket] for bucket in drafts]


def sglang_draft_loads(
    export: Path, engine_scripts: EngineScripts, out: Path
) -> dict[str, dict[str, torch.Tensor]]:
    """What SGLang's own draft class for `export` holds after loading each source of weights
    (tests/trainer/_sglang_mtp_draft.py, run in the engine environment on the CPU): the export's
    files and, when `out / "buckets.pt"` holds them (`save_draft_buckets`), each in-memory
    sync's draft buckets; by source (`disk`, `target`, `distributed`, `tensor`, ...)."""
    from safetensors.torch import load_file

    script = Path(__file__).with_name("_sglang_mtp_draft.py")
    run = engine_scripts.run(str(script), str(export), str(out), str(out / "buckets.pt"))
    assert run.returncode == 0, run.stderr[-3000:]
    return {f.stem: load_file(str(f)) for f in out.glob("*.safetensors")}


SEQUENCES = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 300, 17, 18]]


def trainer_logprobs(e: Learner) -> list[list[float]]:
    """The learner's logprob of every token of SEQUENCES after the first."""
    batch = Batch.from_sequences(
        SEQUENCES, loss_masks=[[1.0] * len(s) for s in SEQUENCES],
        rollout_logprobs=[[0.0] * len(s) for s in SEQUENCES], advantages=[0.0, 0.0],
    )  # fmt: skip
    lp = e.logprobs(batch)["logprobs"]
    return [lp[i, 1 : len(s)].tolist() for i, s in enumerate(SEQUENCES)]


async def engine_logprobs(url: str) -> tuple[str | None, list[list[float]]]:
    """The engine's weight version and its logprob of every token of SEQUENCES after the first."""
    out = []
    async with EngineClient(url) as c:
        await c.flush_cache()
        for seq in SEQUENCES:
            g = await c.generate(seq, {"max_new_tokens": 1, "temperature": 0.0},
                                 extra={"logprob_start_len": 0})
            out.append([float(t[0]) for t in g.meta_info["input_token_logprobs"][1:]])
        version = (await c.model_info())["weight_version"]
    return version, out


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb, strict=True))


async def _sync(e: Learner, mode: str, url: str, version: int, exports: Path) -> None:
    """One sync of the learner's weights as `version`, in `mode`, to the bare SGLang server at
    `url` (its own one worker: no router needed)."""
    async with EngineClient(url, timeout_s=120) as client:
        sync = make_sync(client, WeightSyncConfig(mode=mode, bucket_mb=0.5, timeout_s=60))  # type: ignore[arg-type]
        try:
            if sync.in_memory:
                report = await sync.push(e.hf_state_dict(), version)
                assert report.ok and report.buckets >= 2, report  # several buckets
            else:
                assert await sync.exported(e.export_hf(exports / f"v{version}"), version)
        finally:
            await sync.close()


def assert_every_sync_serves_the_learner(e: Learner, url: str, label: str) -> None:
    """Each weight-sync mode in turn (disk, distributed, tensor: trainer.weight_sync.MODES), after
    an RL step of its own, leaves the engine at `url` serving the learner `e`'s weights as the
    step's version: its logprobs equal the learner's within 1e-5, where before the sync they were
    more than 1e-3 away. `e` must train with a learning rate that moves them (1e-3 does)."""
    vocab = e.arch.vocab_size
    with tempfile.TemporaryDirectory(prefix="exports-") as exports:
        for version, mode in enumerate(MODES, start=1):
            e.rl_step(rl_batch(vocab, size=4, seed=version))
            ours = trainer_logprobs(e)
            before = asyncio.run(engine_logprobs(url))[1]
            asyncio.run(_sync(e, mode, url, version, Path(exports)))
            served, theirs = asyncio.run(engine_logprobs(url))
            diff = max_diff(theirs, ours)
            print(f"{label}, {mode} sync: the engine serves {served}; max |engine - learner| "
                  f"logprob {diff:.2e} (before the sync {max_diff(before, ours):.2e})")
            assert served == str(version)
            assert max_diff(before, ours) > 1e-3 and diff <= 1e-5
