"""Weight sync, disk against in memory: from the end of an optimizer step until every engine
serves the new version, side by side in one run.

For each of three Qwen2 models made with `agent-rl model init` overrides (about 3M, 27M and
105M parameters), one real SGLang engine behind the real router and the real Megatron learner
on the same model take one RL step; then, in interleaved rounds, each mode publishes a new
version the way trainer/loop.py does it:

- `disk`: the learner's HF export (safetensors) then the router's `/update_weights_from_disk`;
- `distributed`: the gathered HF weights broadcast over a gloo group (trainer/weight_sync/distributed.py);
- `tensor`: the same weights through shared memory (`/update_weights_from_tensor`).

A mode's time runs from the call after the step until the router reports the version on the
engine. `pause_s` is the part during which the engine serves nothing: for disk the router's
pause-load-continue (the export is written while the engine still serves); in memory from
`/begin_weight_update` (which pauses) until `/end_weight_update` returns. Each value is the
median of ROUNDS rounds. The first push of each in-memory mode, before the rounds, also forms
its process group (once per fleet membership in a run): reported apart as `first_push_s`. A
run publishes every version the same way, so in each round a mode's timed push follows an
untimed one of the same mode (right after a disk load, the engine took a 105M broadcast in
~1.0 s instead of ~0.55). All runs share this machine's cores with whatever else runs on it:
the load average is printed beside the numbers.

Run: `python bench/weight_sync.py` (about 3-4 minutes; needs `agent-rl engine install`).
Last line: RESULT {"disk_s": {size: s}, "distributed_s": ..., "tensor_s": ..., "pause_s":
{mode: {size: s}}, "first_push_s": ..., "params": {size: n}, "speedup_largest": disk /
distributed at the largest, ...}.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROUNDS = 3
MODES = ("disk", "distributed", "tensor")
# hidden = heads x head_dim (SGLang's CPU path sizes its KV cache by it).
SIZES: dict[str, dict[str, int]] = {
    "small": {},  # tiny-dense as it is
    "medium": {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
               "num_key_value_heads": 4, "intermediate_size": 1536},
    "large": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
              "num_key_value_heads": 4, "intermediate_size": 3072},
}


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()


async def publish(mode: str, e: Any, client: Any, sync: dict[str, Any], version: int,
                  export_dir: Path) -> tuple[float, float]:
    """(seconds until the engine serves `version`, seconds it did not serve) for one mode."""
    from agent_rl.kernel.encoding import version_label

    t0 = time.monotonic()
    if mode == "disk":
        out = e.export_hf(export_dir / f"v{version:06d}")
        t1 = time.monotonic()
        await client.update_weights_from_disk(out, weight_version=version_label(version))
        paused = time.monotonic() - t1
    else:
        report = await sync[mode].push(e.hf_state_dict(), version)
        if not report.ok:
            raise RuntimeError(f"{mode} push failed: {report}")
        paused = report.paused_s
    took = time.monotonic() - t0
    served = await client.served_versions()
    if set(served.values()) != {version_label(version)}:
        raise RuntimeError(f"{mode}: engines serve {served}, not {version}")
    return took, paused


def measure_size(name: str, work: Path, venv: Path) -> dict[str, Any]:
    from agent_rl.config import RouterConfig, TrainerConfig
    from agent_rl.sglang.client import EngineClient
    from agent_rl.engine.launcher import EngineServer
    from agent_rl.models import init_model
    from router import Router
    from trainer.batch import Batch
    from trainer.learner import learner
    from trainer.weight_sync import make_sync

    model = init_model(work / name, "tiny-dense", seed=0, **SIZES[name])
    cfg = TrainerConfig(optim={"lr": 1e-4}, micro_batch_size=2)
    seqs = [[5, 6, 7, 8, 9, 10], [40, 41, 42, 43]]
    batch = Batch.from_sequences(seqs, loss_masks=[[0.0, 1, 1, 1, 1, 1], [0.0, 1, 1, 1]],
                                 rollout_logprobs=[[-5.0] * 6, [-5.0] * 4], advantages=[1.0, -1.0])
    times: dict[str, list[float]] = {m: [] for m in MODES}
    pauses: dict[str, list[float]] = {m: [] for m in MODES}
    first: dict[str, float] = {}
    with EngineServer(model, venv=venv, log_dir=work / "logs") as engine, \
            learner(model, cfg) as e:
        params = sum(p.numel() for p in e.module.parameters())
        e.rl_step(batch)

        async def rounds() -> None:
            rcfg = RouterConfig(port=0, health_interval_s=0, admin_token="bench")
            async with Router(rcfg, [engine.url]) as router:
                client = EngineClient(router.url, token="bench")
                syncs = {m: make_sync(client, cfg.weight_sync.model_copy(update={"mode": m}))
                         for m in ("distributed", "tensor")}
                version = 0
                for mode in ("distributed", "tensor"):
                    version += 1
                    first[mode], _ = await publish(mode, e, client, syncs, version,
                                                   work / "exports" / name)
                for _ in range(ROUNDS):
                    for mode in MODES:
                        # A run pushes every version the same way: the timed push follows one
                        # of its own mode (after a disk load, a broadcast took ~1.0 s instead
                        # of ~0.55 on the 105M model: the engine's memory as the load left it).
                        version += 1
                        await publish(mode, e, client, syncs, version, work / "exports" / name)
                        version += 1
                        took, paused = await publish(mode, e, client, syncs, version,
                                                     work / "exports" / name)
                        times[mode].append(took)
                        pauses[mode].append(paused)
                for s in syncs.values():
                    await s.close()  # type: ignore[union-attr]
                await client.aclose()

        asyncio.run(rounds())
    row = {m: statistics.median(times[m]) for m in MODES}
    pause = {m: statistics.median(pauses[m]) for m in MODES}
    print(f"{name:>6} {params / 1e6:6.1f}M params | " + "  ".join(
        f"{m} {row[m]:6.2f}s (pause {pause[m]:5.2f}s)" for m in MODES)
        + f" | load {loadavg()}", flush=True)
    return {"params": params, "times": row, "pauses": pause, "first": first}


def main() -> None:
    from agent_rl.config import load_config

    venv = load_config().engine.venv
    started = time.monotonic()
    print(f"load average at start: {loadavg()}", flush=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
        for name in SIZES:
            results[name] = measure_size(name, Path(tmp), venv)
    largest = list(SIZES)[-1]
    out = {
        f"{m}_s": {n: round(r["times"][m], 3) for n, r in results.items()} for m in MODES
    }
    out["pause_s"] = {m: {n: round(r["pauses"][m], 3) for n, r in results.items()} for m in MODES}
    out["first_push_s"] = {m: {n: round(r["first"][m], 3) for n, r in results.items()}
                           for m in ("distributed", "tensor")}
    out["params"] = {n: r["params"] for n, r in results.items()}
    out["speedup_largest"] = round(
        results[largest]["times"]["disk"] / results[largest]["times"]["distributed"], 2)
    out["tensor_speedup_largest"] = round(
        results[largest]["times"]["disk"] / results[largest]["times"]["tensor"], 2)
    out["loadavg_end"] = loadavg()
    out["wall_s"] = round(time.monotonic() - started, 1)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
