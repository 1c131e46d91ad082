"""One rank of parallel-equivalence runs (launched by torchrun; `train` also runs in-process
for the one-process baseline).

Each run takes the logprobs of a fixed batch, trains 2 RL steps on fixed batches (each
data-parallel rank takes its contiguous share; MoE batches carry routed experts for replay),
exports HF weights into OUT_DIR/NAME, checkpoints, takes an SFT step, and takes it again from
the loaded checkpoint; rank 0 writes the step metrics to OUT_DIR/NAME/metrics.json and the
starting logprobs to OUT_DIR/NAME/logprobs.pt. Several runs share one launch (imports dominate
the cost). Usage: _parallel_worker.py MODEL_DIR OUT_DIR RUN..., a RUN being the sizes (tp2, pp2,
ep2pp2, ...), `+mtpK` for K MTP modules (tp2+mtp1; `+mtpKtv` with `mtp.objective` tv), `@DIR`
to train the model in DIR instead (tp2pp2@/models/tied); NAME is the RUN without its `@DIR`.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.arch import ModelArch
    from trainer.batch import Batch

# torch, megatron and the trainer are imported inside the functions: dist_checkpointing's save
# starts a helper with multiprocessing "spawn", which re-imports this script as its main module.


def batch_for(arch: ModelArch, seed: int) -> Batch:
    import torch

    from tests.trainer._batches import rl_batch
    from trainer.batch import Batch

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
    model_dir: Path, out_dir: Path, tp: int = 1, ep: int = 1, mtp_layers: int = 0, pp: int = 1,
    mtp_objective: str = "nll",
) -> list[dict[str, float]]:
    import torch
    from megatron.core import parallel_state as ps

    from agent_rl.config import TrainerConfig
    from trainer.arch import ModelArch
    from trainer.learner import Learner

    arch = ModelArch.from_hf_dir(model_dir)
    cfg = TrainerConfig(parallel={"tp": tp, "pp": pp, "ep": ep}, optim={"lr": 1e-3},
                        micro_batch_size=2, mtp={"layers": mtp_layers, "objective": mtp_objective})
    # The process group stays up between runs (re-creating it under torchrun hangs); each
    # Learner re-initialises megatron's parallel groups for its sizes.
    e = Learner(model_dir, cfg)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    # Logprobs of the starting weights, the whole batch on every rank.
    start = e.logprobs(batch_for(arch, 0))["logprobs"]
    steps = []
    for seed in range(2):
        full = batch_for(arch, seed)
        share = full.size // dp
        steps.append(e.rl_step(full.rows(slice(rank * share, (rank + 1) * share))))
    e.export_hf(out_dir / "export")
    # An SFT step, then the checkpoint round trip across ranks: the same SFT step again from
    # the loaded model and optimizer must give the same weights (logprobs) bit for bit.
    probe = batch_for(arch, 0).rows(slice(rank * share, (rank + 1) * share))
    saved = e.save_checkpoint(out_dir / "ckpt")
    steps.append(e.sft_step(probe))
    after = e.logprobs(probe)["logprobs"]
    e.load_checkpoint(saved)
    e.sft_step(probe)
    steps[-1]["resume_max_diff"] = float((e.logprobs(probe)["logprobs"] - after).abs().max())
    if torch.distributed.get_rank() == 0:
        (out_dir / "metrics.json").write_text(json.dumps(steps))
        torch.save(start, out_dir / "logprobs.pt")
    return steps


def main() -> None:
    from trainer import dist_env

    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument(
        "runs", nargs="+",
        help="sizes such as tp2, pp2 or ep2pp2; +mtpK: K MTP modules (+mtpKtv: objective tv); @DIR",
    )
    args = parser.parse_args()
    for run in args.runs:
        name, _, model_dir = run.partition("@")
        split, _, mtp = name.partition("+mtp")
        layers, objective = re.fullmatch(r"(\d*)([a-z]*)", mtp).groups()  # type: ignore[union-attr]
        sizes = {axis: int(n) for axis, n in re.findall(r"(tp|pp|ep)(\d+)", split)}
        train(
            Path(model_dir) if model_dir else args.model_dir,
            args.out_dir / name,
            mtp_layers=int(layers or 0),
            mtp_objective=objective or "nll",
            **sizes,
        )
    dist_env.teardown()


if __name__ == "__main__":
    main()
