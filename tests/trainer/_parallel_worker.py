"""One rank of parallel-equivalence runs (launched by torchrun; `train` also runs in-process
for the one-process baseline).

Each run trains 2 RL steps on fixed batches (each data-parallel rank takes its contiguous
share; MoE batches carry routed experts for replay), then exports HF weights into
OUT_DIR/NAME and round-trips a checkpoint; rank 0 writes the step metrics to OUT_DIR/NAME/metrics.json. Several runs share
one launch (imports dominate the cost). Usage: _parallel_worker.py MODEL_DIR OUT_DIR tp2 ep2 ...
(`tp2+mtp1`: the same with one MTP draft module).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from agent_rl.config import TrainerConfig
from tests.trainer._batches import rl_batch
from trainer import dist_env
from trainer.arch import ModelArch
from trainer.batch import Batch
from trainer.learner import Learner


def batch_for(arch: ModelArch, seed: int) -> Batch:
    batch = rl_batch(arch.vocab_size, size=8, length=40, seed=seed)
    if not arch.is_moe:
        return batch
    g = torch.Generator().manual_seed(100 + seed)
    scores = torch.rand(8, 40, arch.num_layers, arch.num_experts, generator=g)
    experts = scores.topk(arch.moe_topk, dim=-1).indices  # distinct experts per token
    valid = batch.loss_mask.bool() | (torch.arange(40) < 10)
    experts[~valid] = -1  # rows without recorded routing
    return Batch(batch.tokens, batch.loss_mask, batch.rollout_logprobs, batch.advantages, experts)


def train(
    model_dir: Path, out_dir: Path, tp: int = 1, ep: int = 1, mtp_layers: int = 0
) -> list[dict[str, float]]:
    from megatron.core import parallel_state as ps

    arch = ModelArch.from_hf_dir(model_dir)
    cfg = TrainerConfig(tp=tp, ep=ep, lr=1e-3, micro_batch_size=2, mtp_layers=mtp_layers)
    # The process group stays up between runs (re-creating it under torchrun hangs); each
    # Learner re-initialises megatron's parallel groups for its sizes.
    e = Learner(model_dir, cfg)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    steps = []
    for seed in range(2):
        full = batch_for(arch, seed)
        share = full.size // dp
        steps.append(e.rl_step(full.rows(slice(rank * share, (rank + 1) * share))))
    e.export_hf(out_dir / "export")
    # Checkpoint round trip across ranks: save, perturb, load, same logprobs again.
    probe = batch_for(arch, 0).rows(slice(rank * share, (rank + 1) * share))
    before = e.logprobs(probe)["logprobs"]
    saved = e.save_checkpoint(out_dir / "ckpt")
    with torch.no_grad():
        for p in e.module.parameters():
            p.add_(0.01)
    e.load_checkpoint(saved)
    steps[-1]["resume_max_diff"] = float((e.logprobs(probe)["logprobs"] - before).abs().max())
    if torch.distributed.get_rank() == 0:
        (out_dir / "metrics.json").write_text(json.dumps(steps))
    return steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("runs", nargs="+", help="tpN or epN, +mtpK for K MTP modules")
    args = parser.parse_args()
    for run in args.runs:
        split, _, mtp = run.partition("+mtp")
        size = int(split[2:])
        train(
            args.model_dir,
            args.out_dir / run,
            tp=size if split.startswith("tp") else 1,
            ep=size if split.startswith("ep") else 1,
            mtp_layers=int(mtp or 0),
        )
    dist_env.teardown()


if __name__ == "__main__":
    main()
