"""Online vs frozen MTP draft in a quickstart-sized RL run: the draft's expected acceptance per
policy version, the learner's step-time overhead of MTP, and the reward with and without the
MTP loss (issue 21).

Real pieces, quickstart-sized: the quickstart's recipe (its 1M-parameter Qwen2 model,
random-init, the `calculator` env, groups of 8, 8 groups a step, lr 1e-4), an SFT warm start
with `trainer.mtp.layers = 1` (a dense model's draft: SGLang's EAGLE layout, docs/trainer.md,
its MLP DRAFT_FFN wide, a third of the model's: `trainer.mtp.ffn_hidden_size`, `--draft-ffn`,
its attention with the model's heads unless `--draft-heads` (`trainer.mtp.num_attention_heads`)
says fewer; SFT_STEPS steps on the calculator's demonstrations: the draft is trained with
the policy on the SFT data), then two RL runs from that export, one after the other, each
with `serve` into a SQLite store, a router, one SGLang engine (reset to the SFT weights as
version 0 before each) and the trainer loop (trainer/loop.py) for VERSIONS versions:
- online: `mtp.train = true`, the draft trains on every RL batch at `--mtp-lr`
  (`trainer.mtp.lr`, default MTP_LR) to `--objective`
  (`trainer.mtp.objective`, default tv: the total variation from the policy's distribution,
  one minus the expected acceptance; nll is slime's loss, the cross-entropy of the sampled
  tokens);
- frozen: `mtp.train = false`, the draft stays the SFT one. Its loss is not added, and the
  policy then trains exactly as without MTP (tests/trainer/test_mtp.py), detached or not.
- frozen, paired: the online run's own batches replayed, in order, through a learner from the
  same SFT weights with `mtp.train = false`. A detached draft leaves the policy's update
  bit-exact given the same batch, so this replay walks the online run's exact policy
  trajectory (checked: the entropy each step reports agrees, `paired_entropy_max_diff`) and
  scores the SFT draft on exactly the (policy, batch) pairs the online draft was scored on:
  the control without the second run's rollout noise (other episodes, another policy
  trajectory), which moves the two runs' acceptance apart by more than the draft's training
  does: 0.015 over the last five versions at the recipe's lr, 0.09 in one run at lr 3e-4.
- `--compare lr=policy,nll`: the online run's batches replayed with the draft trained with each
  of these settings instead, on the same policy trajectory: another objective, or another
  learning rate (`lr=X`; `lr=policy`: the policy's) (`compare_lead_last_mean`: the online
  draft's acceptance minus each one's, over the last LAST versions).
Acceptance is what the learner reports with each version (`mtp_acceptance_1`: per policy token,
the sum over the vocabulary of min(p_policy, q_draft), at the weights the step starts from, on
the step's batch; with one draft it is also the expected accepted length), read from the
store's policy versions. The served speedup needs SGLang on a GPU and is not measured here.

- reward_delta: mean reward of the online run's versions minus the frozen run's, over the
  versions both reached. The frozen run's policy is the no-MTP policy, and a detached draft
  leaves the policy's update bit-exact given the same batch, so the runs differ by rollout
  noise only: which episodes finish first (asynchronous rollout beside steps of different
  cost) and what they sample. `reward_delta_stderr` treats the per-version differences as
  independent; they are not (each run is one RL trajectory), so it understates that noise.
- mtp_step_overhead: the learner's time for what the loop does per step (the trainer logprobs of
  the first micro-batch, then `rl_step`) on the online run's last TIMED_BATCHES batches, with
  `mtp_layers = 1` over `mtp_layers = 0`, after the runs (no engine or serve beside it), in
  ROUNDS rounds (the two learners timed back to back, the order flipping every round; the
  draft shaped as in the runs, `--draft-ffn`, `--draft-heads`): each
  batch's fastest time over the rounds, summed (`overhead`). The median over rounds of each
  round's ratio of mean times, the estimate before, is `mtp_step_overhead_round_median`: one
  busy moment on two shared cores moved it between 0.13 and 0.34 in runs of the same code.

Run: `python bench/mtp.py` (needs `agent-rl engine install`); `--sft-steps 400 --versions 80
--run-cap-s 420` runs the quickstart's lengths instead (8-9 minutes). It takes 3.2-3.5 minutes
on 2 CPU cores of a recent machine (load up to 3.8: the bench's own engine and learners), 5.7
on an older one; shared with other runs it took 8.5 minutes at load 5-30 and 9.4 at 23-38.
Last line: RESULT {"acceptance_online_last", "acceptance_frozen_last", "mtp_step_overhead",
"reward_delta", "acceptance_last_mean", "acceptance_online", "acceptance_frozen",
"acceptance_frozen_paired_last", "acceptance_gap_paired_last", "paired_entropy_max_diff",
"objective", "mtp_lr", "compare_lead_last_mean", ...};
targets: online >= frozen + 0.1 at the last version, overhead <= 0.15.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl.config import Config, RouterConfig, TrainerConfig  # noqa: E402
from bench._serving import RouterThread, ServeThread, quickstart_run  # noqa: E402

SFT_STEPS = 150
MTP_LR = 1e-3
"""The online draft's learning rate (`trainer.mtp.lr`), 10x the policy's RL lr: the best of a
sweep on one run's batches (1e-4 / 1e-3 / 3e-3 / 1e-2; docs/trainer.md)."""
DRAFT_FFN = 128
"""The draft layer's MLP width (`trainer.mtp.ffn_hidden_size`), a third of the model's 384: the
draft is one decoder layer beside the model's four, and at the model's width it cost the
learner 0.20-0.23 of a step; at 128, 0.12-0.18 (docs/benchmarks.md)."""
DRAFT_HEADS = 0
"""The draft layer's attention heads (`trainer.mtp.num_attention_heads`; 0: the model's 2). One
head cut the overhead by 0.01-0.03 and the online draft's lead over the frozen one by about
half (docs/benchmarks.md), so the default keeps the model's."""
VERSIONS = 24
"""RL versions per run."""
RUN_CAP_S = 100.0
"""Wall-clock bound of one RL run (it stops earlier at VERSIONS)."""
LAST = 5
ROUNDS, TIMED_BATCHES = 5, 3
ARMS = ("online", "frozen")
OBJECTIVES = ("nll", "kl", "tv")


def config(work: Path, sft: Path, router: RouterThread, arm: str, objective: str,
           mtp_lr: float | None, draft: dict[str, Any]) -> Config:
    return quickstart_run(work, sft, router, f"mtp-{arm}", mtp={
        "layers": 1, "lr": mtp_lr, "train": arm == "online", "objective": objective, **draft})


def variant(item: str) -> dict[str, Any]:
    """A `--compare` item as `trainer.mtp` settings: an objective's name, or `lr=X` (`mtp.lr`;
    `lr=policy`: the policy's lr)."""
    if item in OBJECTIVES:
        return {"objective": item}
    if item.startswith("lr="):
        value = item.removeprefix("lr=")
        return {"lr": None if value == "policy" else float(value)}
    raise ValueError(f"{item!r}: use one of {', '.join(OBJECTIVES)} or lr=X")


def sft(work: Path, model: Path, steps: int, draft: dict[str, Any]) -> Path:
    """The quickstart's SFT stage, shortened, with an MTP draft trained beside the policy."""
    from agent_rl.app.quickstart.recipe import ENV_ID, ENV_KWARGS, Options, recipe
    from agent_rl.rollout.sft_data import demonstration_sequences
    from trainer.sft import run_sft

    qs = recipe(Options())["trainer"]
    keys = ("seed", "sft", "micro_batch_size")
    cfg = TrainerConfig(mtp={"layers": 1, **draft}, **{k: qs[k] for k in keys})
    data = asyncio.run(demonstration_sequences(ENV_ID, cfg.sft.batch_size * steps, model,
                                               seed=cfg.seed, env_kwargs=ENV_KWARGS))
    out = work / "sft"
    result = run_sft(cfg, model, out, data.sequences, steps=steps, log=lambda line: None)
    print(f"SFT {steps} steps with the draft: final loss {result['loss']:.3f} "
          f"(at {time.strftime('%H:%M:%S')})", flush=True)
    return out


def reset_engine(router: RouterThread, model: Path) -> None:
    """Every engine behind the router back to `model`, as policy version 0."""
    from agent_rl.sglang.client import EngineClient

    async def go() -> None:
        async with EngineClient(router.url, token=router.token) as client:
            await client.update_weights_from_disk(model, weight_version="0")

    asyncio.run(go())


def rl_run(cfg: Config, batches: list[Any], last: int, cap_s: float) -> list[dict[str, Any]]:
    """The trainer loop beside a running serve until version `last` (or `cap_s`); every step's
    batch is appended to `batches`; returns the store's policy versions."""
    from trainer.learner import learner
    from trainer.loop import TrainLoop

    with learner(cfg.trainer.model, cfg.trainer) as e:
        step = e.rl_step

        def kept(batch: Any) -> dict[str, float]:
            batches.append(batch)
            return step(batch)

        e.rl_step = kept  # type: ignore[method-assign]
        loop = TrainLoop(cfg, e, log=lambda line: None)
        loop.open()
        server = ServeThread(cfg, None)
        server.start()
        t0 = time.monotonic()
        try:
            while loop.stats.version < last and time.monotonic() - t0 < cap_s:
                loop.step_once()
        finally:
            server.stop()
            loop.close()
        if server.error is not None:
            raise server.error
    return versions(cfg)


def versions(cfg: Config) -> list[dict[str, Any]]:
    from agent_rl.store import Store

    async def go() -> list[dict[str, Any]]:
        async with await Store.open(cfg.store) as store:
            rows = await store.policy_versions(await store.run_id(cfg.run.name))
        return [{"version": r["version"], **r["metrics"]} for r in rows if r["metrics"]]

    return asyncio.run(go())


def paired(cfg: Config, batches: list[Any], **update: Any) -> list[dict[str, float]]:
    """The online run's batches replayed in order with the `trainer.mtp` settings `update`d (the
    draft frozen at the SFT one, or trained to another objective): each step's metrics (see
    the module docstring)."""
    from trainer.learner import learner

    replay = cfg.trainer.model_copy(update={"mtp": cfg.trainer.mtp.model_copy(update=update)})
    with learner(replay.model, replay) as e:
        return [e.rl_step(batch) for batch in batches]


def step_times(model: Path, batches: list[Any], objective: str,
               draft: dict[str, Any]) -> list[dict[int, list[float]]]:
    """Per round, seconds of each loop step's learner work (trainer logprobs of the first
    micro-batch, then `rl_step`) on each of the last TIMED_BATCHES batches, without (0) and
    with (1) the draft; the order flips every round (0 1, 1 0, ...) so a load that drifts
    favours neither."""
    from trainer.learner import learner

    rounds = []
    for r in range(ROUNDS):
        times: dict[int, list[float]] = {}
        for layers in (0, 1) if r % 2 == 0 else (1, 0):
            cfg = TrainerConfig(optim={"lr": 1e-4}, micro_batch_size=32, mtp={
                "layers": layers, "objective": objective, **(draft if layers else {})})
            with learner(model, cfg) as e:
                e.rl_step(batches[0])  # optimizer state, first allocations: not timed
                times[layers] = []
                for batch in batches[-TIMED_BATCHES:]:
                    t0 = time.perf_counter()
                    e.logprobs(batch.rows(slice(0, cfg.micro_batch_size)))
                    e.rl_step(batch)
                    times[layers].append(time.perf_counter() - t0)
        rounds.append(times)
    return rounds


def overhead(rounds: list[dict[int, list[float]]]) -> float:
    """The draft's share of a step: each batch's fastest time over the rounds, with the draft
    over without, summed over the batches. Other work on the machine only ever adds time to a
    step, so a batch's fastest time is the closest to what the code costs (timeit's reasoning)."""
    fastest = [[min(r[layers][b] for r in rounds) for b in range(TIMED_BATCHES)]
               for layers in (0, 1)]  # fmt: skip
    return sum(fastest[1]) / sum(fastest[0]) - 1


def main() -> None:
    import argparse

    import torch

    from agent_rl.config import load_config
    from agent_rl.engine.launcher import EngineServer
    from agent_rl.models import PRESETS, init_model
    from agent_rl.app.quickstart.recipe import MODEL_PRESET
    from agent_rl.store.migrate import upgrade

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objective", default="tv", choices=OBJECTIVES,
                        help="trainer.mtp.objective of the online run (default: tv)")
    parser.add_argument("--mtp-lr", default=str(MTP_LR),
                        help=f"trainer.mtp.lr of the online run (default {MTP_LR:g}; "
                        "'policy': the policy's lr)")
    parser.add_argument("--draft-ffn", type=int, default=DRAFT_FFN,
                        help=f"trainer.mtp.ffn_hidden_size, the draft layer's MLP width (default "
                        f"{DRAFT_FFN}; 0: the model's, {PRESETS[MODEL_PRESET].intermediate_size})")
    parser.add_argument("--draft-heads", type=int, default=DRAFT_HEADS,
                        help="trainer.mtp.num_attention_heads, the draft layer's attention heads "
                        f"(default {DRAFT_HEADS}; 0: the model's, "
                        f"{PRESETS[MODEL_PRESET].num_attention_heads})")
    parser.add_argument("--compare", default="", help="other draft settings, comma-separated, "
                        "each replayed on the online run's batches (about 40 s each): "
                        "objectives (nll, kl, tv) or lr=X (lr=policy: the policy's lr)")
    parser.add_argument("--sft-steps", type=int, default=SFT_STEPS,
                        help=f"SFT steps before RL (default {SFT_STEPS}; the quickstart's 400)")
    parser.add_argument("--versions", type=int, default=VERSIONS,
                        help=f"RL versions per run (default {VERSIONS}; the quickstart's 80)")
    parser.add_argument("--run-cap-s", type=float, default=RUN_CAP_S,
                        help=f"wall-clock bound of one RL run (default {RUN_CAP_S:.0f})")
    args = parser.parse_args()
    try:
        compare = {o: variant(o) for o in args.compare.split(",") if o}
        mtp_lr = variant(f"lr={args.mtp_lr}")["lr"]
    except ValueError as e:
        parser.error(str(e))
    draft = {"ffn_hidden_size": args.draft_ffn or None,
             "num_attention_heads": args.draft_heads or None}
    torch.set_num_threads(1)
    started = time.monotonic()
    runs: dict[str, list[dict[str, Any]]] = {}
    batches: list[Any] = []
    configs: dict[str, Config] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = init_model(work / "model", MODEL_PRESET, seed=0)
        engine = EngineServer(model, venv=load_config().engine.venv, log_dir=work / "logs",
                              startup_timeout_s=600.0)
        engine.launch()  # on the base model, starting while SFT runs; the runs load the SFT weights
        try:
            sft_model = sft(work, model, args.sft_steps, draft)
            engine.wait_until_healthy()
            token = secrets.token_urlsafe(24)
            router = RouterThread([engine.url], RouterConfig(port=0, admin_token=token))
            router.start()
            router.ready.wait(60)
            try:
                for arm in ARMS:
                    cfg = configs[arm] = config(work, sft_model, router, arm, args.objective,
                                                mtp_lr, draft)
                    asyncio.run(upgrade(cfg.store))
                    reset_engine(router, sft_model)
                    t0 = time.monotonic()
                    runs[arm] = rl_run(cfg, batches if arm == "online" else [], args.versions,
                                       args.run_cap_s)
                    print(f"{arm} ({time.monotonic() - t0:.0f} s): " + json.dumps([
                        {k: round(v[k], 3) for k in ("version", "mtp_acceptance_1", "reward_mean")}
                        for v in runs[arm]]), flush=True)  # fmt: skip
            finally:
                router.stop()
        finally:
            engine.stop()
        load_runs = os.getloadavg()[0]
        frozen_pair = paired(configs["online"], batches, train=False)
        others = {o: paired(configs["online"], batches, **update)
                  for o, update in compare.items()}
        step = step_times(sft_model, batches, args.objective, draft)
    acc = {arm: [round(v["mtp_acceptance_1"], 4) for v in runs[arm]] for arm in ARMS}
    reward = {arm: [v["reward_mean"] for v in runs[arm]] for arm in ARMS}
    # The runs are compared at the versions both reached (a run may stop at RUN_CAP_S).
    n = min(len(reward["online"]), len(reward["frozen"]))
    diffs = [a - b for a, b in zip(reward["online"][:n], reward["frozen"][:n])]
    # The online run's versions are its steps: the replay's step i is version i + 1.
    m = min(len(frozen_pair), len(runs["online"]))
    acc_paired = [round(x["mtp_acceptance_1"], 4) for x in frozen_pair[:m]]
    acc_others = {o: [round(x["mtp_acceptance_1"], 4) for x in v[:m]] for o, v in others.items()}
    result = {
        "acceptance_online_last": acc["online"][n - 1],
        "acceptance_frozen_last": acc["frozen"][n - 1],
        "acceptance_gap_last": round(acc["online"][n - 1] - acc["frozen"][n - 1], 4),
        "last_version": n,
        # One version's acceptance is one batch's: the mean of the last LAST versions is steadier.
        "acceptance_last_mean": {arm: round(statistics.fmean(acc[arm][n - LAST:n]), 4)
                                 for arm in ARMS},  # fmt: skip
        "acceptance_frozen_paired_last": acc_paired[m - 1],
        "acceptance_gap_paired_last": round(acc["online"][m - 1] - acc_paired[m - 1], 4),
        "acceptance_gap_paired_last_mean": round(statistics.fmean(
            a - b for a, b in zip(acc["online"][m - LAST:m], acc_paired[m - LAST:m])), 4),
        "paired_entropy_max_diff": max(abs(x["entropy"] - v["entropy"])
                                       for x, v in zip(frozen_pair[:m], runs["online"][:m])),
        "acceptance_frozen_paired": acc_paired,
        "objective": args.objective,
        "mtp_lr": mtp_lr,
        "draft_ffn": args.draft_ffn or PRESETS[MODEL_PRESET].intermediate_size,
        "draft_heads": args.draft_heads or PRESETS[MODEL_PRESET].num_attention_heads,
        # Other draft settings on the same policy trajectory: the online draft's lead over
        # each, over the last LAST versions.
        "compare_lead_last_mean": {o: round(statistics.fmean(
            a - b for a, b in zip(acc["online"][m - LAST:m], v[m - LAST:m])), 4)
            for o, v in acc_others.items()},
        "acceptance_paired": acc_others,
        "mtp_step_overhead": round(overhead(step), 3),
        # The median over rounds of each round's ratio of mean step times (the estimate before).
        "mtp_step_overhead_round_median": round(statistics.median(
            statistics.fmean(r[1]) / statistics.fmean(r[0]) for r in step) - 1, 3),
        "reward_delta": round(statistics.fmean(diffs), 4),
        "reward_delta_stderr": round(statistics.stdev(diffs) / n**0.5, 4) if n > 1 else None,
        "reward_mean": {arm: round(statistics.fmean(reward[arm]), 4) for arm in ARMS},
        "acceptance_online": acc["online"],
        "acceptance_frozen": acc["frozen"],
        "versions": {arm: len(runs[arm]) for arm in ARMS},
        "step_s_rounds": [{arm: [round(t, 3) for t in r[layers]]
                           for arm, layers in (("no_mtp", 0), ("mtp", 1))} for r in step],
        "step_s_in_run_median": {arm: round(statistics.median(v["step_s"] for v in runs[arm]), 3)
                                 for arm in ARMS},  # fmt: skip
        "sft_steps": args.sft_steps,
        "load_avg_1m": round(max(load_runs, os.getloadavg()[0]), 2),
        "wall_s": round(time.monotonic() - started, 1),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
