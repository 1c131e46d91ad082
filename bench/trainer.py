"""RL steps on a heavy-tailed batch: padded vs packed micro-batches, tokens per second.

One learner process (real megatron-core on CPU, fp32) of a random-init Qwen2-shaped model of
~56M parameters (`agent-rl model init` overrides: hidden 640, 12 layers, MLP 1792). The batch
is BATCH sequences with lognormal lengths (median MEDIAN tokens, sigma SIGMA, cut to
[MIN_LEN, MAX_LEN]), as agentic episodes are: a quarter prompt (loss mask 0), the rest policy
tokens, GRPO advantages. Each mode gets a warm-up step on a small batch (optimizer state, first
allocations), then one timed `rl_step` of the batch:
- padded: `micro_batch_size = MICRO` rows each, every row padded to the batch's longest;
- packed: `max_tokens_per_micro_batch = MAX_LEN`, one packed row per micro-batch;
- packed, bf16: the same with `dtype = "bf16"` (fp32 master weights), on every BF16_EVERY-th
  sequence of the batch by length, longest first (the same spread of lengths, a share of the
  tokens): a CPU without bf16 instructions steps bf16 ~20x slower than fp32, and the whole
  batch alone took 5 minutes on one;
- packed, 2 ranks: the packed fp32 step data-parallel over two processes (torchrun, gloo, one
  thread each where the one-rank runs use every core), each rank taking half of the batch's
  tokens (sequences dealt longest first to the rank with fewer); timed from a barrier to a
  barrier, so the step ends when the slower rank's does.
Tokens per second counts the real tokens of the sequences stepped. The padding fraction is the
share of the tokens the model computes that are padding.

Run: `python bench/trainer.py` (about 4.5 minutes on 2 CPU cores).
Last line: RESULT {"packed_speedup", "padding_fraction_padded", "padding_fraction_packed",
"tokens_per_s": {"padded", "packed", "packed_bf16", "packed_2_ranks"}, "step_s": {...},
"two_rank_speedup", "params", "real_tokens", "real_tokens_bf16", "load_avg_1m"}.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCH, MEDIAN, SIGMA, MIN_LEN, MAX_LEN = 24, 64, 1.0, 16, 768
MICRO = 4
BF16_EVERY = 4
MODEL = {"hidden_size": 640, "num_hidden_layers": 12, "num_attention_heads": 10,
         "num_key_value_heads": 5, "head_dim": 64, "intermediate_size": 1792}  # fmt: skip


def heavy_tailed_batch(vocab: int, n: int, seed: int = 0) -> Any:
    import torch

    from trainer.batch import Batch
    from trainer.advantages import grpo

    g = torch.Generator().manual_seed(seed)
    lengths = [min(MAX_LEN, max(MIN_LEN, round(math.exp(math.log(MEDIAN) + SIGMA * float(z)))))
               for z in torch.randn(n, generator=g)]  # fmt: skip
    tokens = [torch.randint(1, vocab, (L,), generator=g).tolist() for L in lengths]
    masks = [[0.0] * (L // 4) + [1.0] * (L - L // 4) for L in lengths]
    rollout = [[0.0] * (L // 4) + (-torch.rand(L - L // 4, generator=g) * 3 - 1).tolist() for L in lengths]
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    return Batch.from_sequences(tokens, masks, rollout, grpo(rewards, torch.arange(n) // 4).tolist())


def longest_first(lengths: list[int]) -> list[int]:
    """Row indices by length, the longest first."""
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def measure(model: Path, batch: Any, warm: Any, **cfg: Any) -> float:
    import torch

    from agent_rl.config import TrainerConfig
    from trainer.learner import learner

    with learner(model, TrainerConfig(optim={"lr": 1e-5}, threads=torch.get_num_threads(), **cfg)) as e:
        e.rl_step(warm)
        t0 = time.perf_counter()
        e.rl_step(batch)
        return time.perf_counter() - t0


def deal(lengths: list[int], ranks: int) -> list[list[int]]:
    """Row indices per rank: longest first, each to the rank with the fewest tokens so far."""
    shares: list[list[int]] = [[] for _ in range(ranks)]
    tokens = [0] * ranks
    for i in longest_first(lengths):
        r = tokens.index(min(tokens))
        shares[r].append(i)
        tokens[r] += lengths[i]
    return shares


def rank_role(model: Path, out: Path) -> None:
    """One data-parallel rank of the 2-rank run (under torchrun): rank 0 writes the step time."""
    import torch
    import torch.distributed as dist

    from agent_rl.config import TrainerConfig
    from trainer.arch import ModelArch
    from trainer.learner import learner

    vocab = ModelArch.from_hf_dir(model).vocab_size
    batch, warm = heavy_tailed_batch(vocab, BATCH), heavy_tailed_batch(vocab, 2, seed=1)
    cfg = TrainerConfig(optim={"lr": 1e-5}, threads=1, max_tokens_per_micro_batch=MAX_LEN)
    with learner(model, cfg) as e:
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = torch.tensor(deal([int(n) for n in batch.lengths], world)[rank])
        e.rl_step(warm.rows(slice(rank, rank + 1)))
        dist.barrier()
        t0 = time.perf_counter()
        e.rl_step(batch.rows(mine))
        dist.barrier()
        if rank == 0:
            out.write_text(json.dumps({"step_s": time.perf_counter() - t0}))


def two_ranks(model: Path, tmp: Path) -> float:
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp / "two_ranks.json"
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(port), __file__,
         "--rank-role", str(model), str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, timeout=600,
    )  # fmt: skip
    return float(json.loads(out.read_text())["step_s"])


def main() -> None:
    import torch

    from agent_rl.models import init_model
    from trainer.arch import ModelArch
    from trainer.packing import plan

    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        model = init_model(Path(tmp) / "model", "tiny-dense", seed=0, **MODEL)
        arch = ModelArch.from_hf_dir(model)
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).parameters())
        batch = heavy_tailed_batch(arch.vocab_size, BATCH)
        warm = heavy_tailed_batch(arch.vocab_size, 2, seed=1)
        lengths = [int(n) for n in batch.lengths]
        real = sum(lengths)
        padded_tokens = batch.size * batch.length
        packed_tokens = sum(max(sum(lengths[r] for r in b), 2) for b in plan(lengths, MAX_LEN))
        print(f"model {params / 1e6:.1f}M parameters; batch {BATCH} sequences, lengths "
              f"{sorted(lengths)} ({real} real tokens; padded {padded_tokens}, packed {packed_tokens})",
              flush=True)
        step = {}
        step["padded"] = measure(model, batch, warm, micro_batch_size=MICRO)
        print(f"padded: {step['padded']:.1f} s", flush=True)
        step["packed"] = measure(model, batch, warm, max_tokens_per_micro_batch=MAX_LEN)
        print(f"packed: {step['packed']:.1f} s", flush=True)
        share = longest_first(lengths)[::BF16_EVERY]
        real_bf16 = sum(lengths[i] for i in share)
        step["packed_bf16"] = measure(model, batch.rows(torch.tensor(share)), warm,
                                      max_tokens_per_micro_batch=MAX_LEN, dtype="bf16")
        print(f"packed, bf16 ({len(share)} sequences, {real_bf16} tokens): "
              f"{step['packed_bf16']:.1f} s", flush=True)
        step["packed_2_ranks"] = two_ranks(model, Path(tmp))
        print(f"packed, 2 ranks: {step['packed_2_ranks']:.1f} s", flush=True)
    tok_s = {k: round((real_bf16 if k == "packed_bf16" else real) / v, 1) for k, v in step.items()}
    result = {
        "packed_speedup": round(step["padded"] / step["packed"], 2),
        "padding_fraction_padded": round(1 - real / padded_tokens, 3),
        "padding_fraction_packed": round(1 - real / packed_tokens, 3),
        "tokens_per_s": tok_s,
        "two_rank_speedup": round(step["packed"] / step["packed_2_ranks"], 2),
        "step_s": {k: round(v, 2) for k, v in step.items()},
        "params": params,
        "real_tokens": real,
        "real_tokens_bf16": real_bf16,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "wall_s": round(time.monotonic() - started, 1),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-role"]:
        rank_role(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
