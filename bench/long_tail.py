"""The long tail, end to end: does staleness control throw the long episodes away?

Real pieces on CPU: one SGLang engine (tiny-dense) behind the router (which retracts in-flight
generations at each weight update and continues them on the new weights), `serve` running the
built-in `long-tail` env (turn counts and completion lengths lognormal, sigma 1; ~4% of
episodes run into `rollout.max_turns`), and the Megatron trainer loop consuming the store with
a weight sync after every step. Two loads:

- `trainer-fast`: few concurrent episodes, a quick trainer; the trainer waits for data and
  steps as soon as a batch is ready, so versions advance while the long episodes run;
- `rollout-fast`: many concurrent episodes, the trainer's step padded to STEP_S (standing for
  a model whose step costs that much; the data path is unchanged), so rollout outpaces it.

Each load runs twice, with the design before (`baseline`: staleness counted from an episode's
oldest token, admission bounded only by the served version) and now (`fair`: the bound applies
to tokens, `agent_rl.store.staleness`: tokens sampled below the floor do not train, the rest of
the episode does; admission bounded by the groups queued for the trainer,
`rollout.max_queued_groups`). Measured from the store at the end of each run: lost and not
terminal episodes (audit), the trainer's idle fraction, the share of model tokens left out for
staleness, the staleness histogram of trained episodes, the length bias (mean token length of trained episodes / that of all completed ones;
1.0 = no bias) and the stale-filtered share (stale-filtered / completed).

Run: `python bench/long_tail.py --designs` (about 4-5 minutes; needs `agent-rl engine
install`). Last line: RESULT {"lost", "not_terminal", "length_bias", "stale_filtered_share",
"baseline_length_bias", "baseline_stale_filtered_share", "trainer_idle", ...} (the fair
design's worst over both loads).

The long tail II (issue 49), `python bench/long_tail.py` (the default; 4-7 minutes at load 9-22, 10 at load 22-30): a
searcher-shaped `long-tail` (`SEARCH`: each episode's turns drawn around its task's, a few to
30, so a group's short siblings finish long before its long ones; the env's and the rollout's
max_turns 30, past which an episode is truncated with reward 0, so a task whose turns lie past
it fails in every sibling; 6 tasks that come back, of 21, 89, 90, 3, 9 and 14 turns: two no
sibling can finish, four whose siblings' rewards differ), at `trainer.max_staleness = 1` and an
admission queue 4x the default (`rollout.max_queued_groups = 4 x groups_per_step`), zero-variance
groups filtered as serve does by default, the ready groups bounded as serve does by default
(`rollout.max_ready_groups`: the trainer's next step's worth), and in both arms admission
keeping the oldest running group's tokens trainable (`rollout.protect_oldest_group`; `--protect
0` turns it off): the groups that finish beside a long one do not step the trainer past its
early tokens. Two runs paired: the same seed,
task stream and work (each stops once the trainer has published `II_VERSIONS` versions, so a
busier machine makes a run longer, not shorter in data; `--versions N`), requests sampled with
seeds (`rollout.seeded_sampling`, so an episode of the same stream position and turn samples the
same tokens while the weights agree), without task selection and with
`rollout.task_selection = "skip_all_equal"` (its default pause). Each run's load average at
its start and end is in `by_run`. Measured from the store:

- `stale_filtered_share`: episodes of groups filtered as stale / finished episodes (a stale
  sibling no longer takes its group with it: `stale_sibling_share` is those that counted in
  their group's baseline and trained no token);
- `length_bias_tokens`: mean tokens of the episodes trained / of all that reached the trainer
  (trained, stale siblings, stale groups); > 1 when it is the short siblings that are left out;
- `tokens_generated_per_trained` (with selection) and `..._without_selection`: model tokens
  generated in the run (every episode's, as the audit counts them: those still running when the
  run stops too, since their compute was spent) / model tokens trained (the steps' loss-mask
  tokens, stale ones masked); `decided_per_trained` (and `waste_cut_decided`) counts only the
  episodes decided (trained or filtered), leaving out those the stop caught running or ready;
  `waste_cut_before_stale_mask` divides by the model tokens of the trained episodes instead,
  before `max_staleness` masks their old tokens (`by_run`'s `stale_token_share`), to tell the
  two apart;
- `reward_at_version`: each run's mean trained reward over the versions both reached (the env's
  reward is a coin and the truncation, so this shows selection does not change what is
  trained, not learning).

Last line: RESULT {"stale_filtered_share", "length_bias_tokens", "tokens_generated_per_trained",
"tokens_generated_per_trained_without_selection", "waste_cut", "reward_at_version", ...} (the
stale share and bias: the worse of the two runs).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl.config import (  # noqa: E402
    Config,
    EngineConfig,
    RolloutConfig,
    RouterConfig,
    StoreConfig,
    TrainerConfig,
)
from agent_rl.store.migrate import upgrade  # noqa: E402
from bench._serving import RouterThread, ServeThread  # noqa: E402

RUN_S = 38.0  # training time per run, after the trainer is up
STEP_S = 2.5  # the rollout-fast load's padded trainer step
ETA = 2
LOADS = {
    # name: (concurrent episodes, groups per step, padded step seconds)
    "trainer-fast": (8, 2, 0.0),
    "rollout-fast": (32, 2, STEP_S),
}
DESIGNS = {
    "baseline": {"staleness_measure": "oldest", "max_queued_groups": 0},
    "fair": {"staleness_measure": "tokens", "max_queued_groups": None},
}


def config(work: Path, router: RouterThread, model: Path, run: str, load: str, design: str) -> Config:
    concurrency, groups, _ = LOADS[load]
    choice = DESIGNS[design]
    return Config(
        run={"name": run},
        store=StoreConfig(url=f"sqlite:///{work / f'{run}.db'}"),
        engine=EngineConfig(model=model),
        router={"admin_token": router.token},
        rollout=RolloutConfig(
            env="long-tail", router_url=router.url, group_size=4, max_turns=12,
            max_new_tokens=256, max_tokens=4096, filter_zero_variance=False,
            max_concurrent_episodes=concurrency, heartbeat_s=1.0,
            max_queued_groups=choice["max_queued_groups"],
        ),  # fmt: skip
        trainer=TrainerConfig(
            groups_per_step=groups, micro_batch_size=8, optim={"lr": 1e-5}, max_staleness=ETA,
            staleness_measure=choice["staleness_measure"],
            weight_sync={"router_url": router.url},
            data_poll_s=0.05, checkpoint_every=10_000, export_every=1,
            checkpoint_dir=work / run / "ckpt", export_dir=work / run / "exports",
            tensorboard_dir=None,
        ),  # fmt: skip
    )


def train_for(cfg: Config, model: Path, seconds: float, pad_s: float,
              versions: int | None = None) -> dict[str, Any]:
    """The trainer loop for `seconds` (or until it has published `versions` versions, whichever
    comes first) beside a continuously running serve; then serve stops."""
    from trainer.learner import learner
    from trainer.loop import TrainLoop

    with learner(model, cfg.trainer) as e:
        loop = TrainLoop(cfg, e, log=lambda line: None)
        loop.open()
        server = ServeThread(cfg, None)
        server.start()
        idle = busy = 0.0
        try:
            end = time.monotonic() + seconds
            while time.monotonic() < end and (versions is None or loop.stats.steps < versions):
                t0 = time.monotonic()
                metrics = loop.step_once() or {}
                took = time.monotonic() - t0
                if took < pad_s + metrics.get("idle_s", 0.0):
                    time.sleep(pad_s + metrics.get("idle_s", 0.0) - took)
                idle += metrics.get("idle_s", 0.0)
                busy += max(time.monotonic() - t0 - metrics.get("idle_s", 0.0), 0.0)
        finally:
            server.stop()
            loop.close()
        if server.error is not None:
            raise server.error
    history = loop.stats.history
    stale = sum(h.get("stale_tokens", 0) for h in history)
    trained = sum(h.get("tokens", 0) for h in history)
    return {"steps": loop.stats.steps, "trainer_idle": idle / max(idle + busy, 1e-9),
            "stale_token_share": stale / max(stale + trained, 1), "trained_tokens": trained,
            "rewards": [h.get("reward_mean", 0.0) for h in history]}


def measure(cfg: Config) -> dict[str, Any]:
    from agent_rl.store import Store
    from agent_rl.store.staleness import bucket

    async def go() -> dict[str, Any]:
        async with await Store.open(cfg.store) as store:
            run = await store.run_id(cfg.run.name)
            audit = await store.audit(run)
            endings = await store.endings(run)
            episodes = await store.list_episodes(run_id=run, limit=1_000_000)
        completed = [e for e in episodes if e.status in ("completed", "trained", "filtered")]
        trained = [e for e in episodes if e.status == "trained"]
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        histogram: dict[str, int] = {}
        for e in trained:
            if e.staleness is not None:
                histogram[str(bucket(e.staleness))] = histogram.get(str(bucket(e.staleness)), 0) + 1
        return {
            "lost": audit.lost,
            "not_terminal": audit.not_terminal,
            "problems": audit.problems(finished=False),
            "completed": len(completed),
            "trained": len(trained),
            "length_bias": mean([e.num_tokens for e in trained]) / mean([e.num_tokens for e in completed]),
            "stale_filtered_share": endings.filtered.get("stale", 0) / max(len(completed), 1),
            "truncated": endings.truncated,
            "staleness_histogram": dict(sorted(histogram.items(), key=lambda kv: int(kv[0]))),
            "turns_p99": sorted(e.num_turns for e in completed)[int(0.99 * (len(completed) - 1))] if completed else 0,
        }

    return asyncio.run(go())


SEARCH = {"turns_median": 16.0, "sigma": 1.4, "sibling_sigma": 0.5, "length_median": 3.0,
          "max_length": 8, "max_drawn_turns": 90, "task_pool": 6, "pool_seed": 32,
          "max_turns": 30}
"""Issue 49's searcher, shaped: turns a few to 30 (the limit), short siblings beside long ones."""
II_VERSIONS = 10  # each arm trains this many versions (the same work), then stops
II_MAX_S = 240.0  # ... or stops after this long (a very busy machine)
II_GROUPS = 2
II_ETA = 1
II_CONCURRENCY = 12
II_PROTECT = 1
"""`rollout.protect_oldest_group` in both arms (`--protect 0` turns it off)."""
SELECTIONS = ("all", "skip_all_equal")


def config_ii(work: Path, router: RouterThread, model: Path, run: str, selection: str) -> Config:
    return Config(
        run={"name": run},
        store=StoreConfig(url=f"sqlite:///{work / f'{run}.db'}"),
        engine=EngineConfig(model=model),
        router={"admin_token": router.token},
        rollout=RolloutConfig(
            env="long-tail", env_kwargs=SEARCH, router_url=router.url, group_size=4,
            max_turns=30, max_new_tokens=64, max_tokens=8192, max_concurrent_episodes=II_CONCURRENCY,
            heartbeat_s=1.0, max_queued_groups=4 * max(II_ETA, 1) * II_GROUPS,
            task_selection=selection, seed=0, seeded_sampling=True,
            protect_oldest_group=bool(_arg("--protect", II_PROTECT)),
        ),  # fmt: skip
        trainer=TrainerConfig(
            groups_per_step=II_GROUPS, micro_batch_size=8, optim={"lr": 1e-5},
            max_staleness=II_ETA, weight_sync={"router_url": router.url}, data_poll_s=0.05,
            checkpoint_every=10_000, export_every=1, checkpoint_dir=work / run / "ckpt",
            export_dir=work / run / "exports", tensorboard_dir=None,
        ),  # fmt: skip
    )


def measure_ii(cfg: Config) -> dict[str, Any]:
    from agent_rl.store import Store

    async def go() -> dict[str, Any]:
        async with await Store.open(cfg.store) as store:
            run = await store.run_id(cfg.run.name)
            audit = await store.audit(run)
            endings = await store.endings(run)
            episodes = await store.list_episodes(run_id=run, limit=1_000_000)
            reasons = {e.id: (await store.get_episode(e.id)).episode.filter_reason or ""
                       for e in episodes if e.status == "filtered"}
            keys = {t: (await store.get_task(t))["key"] for t in {e.task_id for e in episodes}}
        finished = [e for e in episodes if e.status in ("completed", "trained", "filtered")]
        trained = [e for e in episodes if e.status == "trained"]
        stale = [e for e in episodes if e.status == "filtered" and reasons[e.id].startswith("stale")]
        decided = [e for e in episodes if e.status in ("trained", "filtered")]
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        return {
            "lost": audit.lost, "not_terminal": audit.not_terminal,
            "finished": len(finished), "trained": len(trained),
            "stale_filtered": endings.filtered.get("stale", 0),
            "stale_siblings": endings.filtered.get("stale_sibling", 0),
            "zero_variance": endings.filtered.get("zero_variance", 0),
            "length_bias_tokens": mean([e.num_tokens for e in trained])
            / mean([e.num_tokens for e in trained + stale]),
            "length_bias_turns": mean([e.num_turns for e in trained])
            / mean([e.num_turns for e in trained + stale]),
            "generated": sum(e.num_model_tokens for e in episodes),
            "generated_decided": sum(e.num_model_tokens for e in decided),
            "trained_model_tokens": sum(e.num_model_tokens for e in trained),
            "turns_max": max((e.num_turns for e in finished), default=0),
            "episodes_per_task": dict(sorted(Counter(keys[e.task_id] for e in episodes).items())),
            "at_limit": sum(e.num_turns >= 30 for e in finished),
            "truncated": endings.truncated,
        }

    return asyncio.run(go())


def long_tail_ii(work: Path, router: RouterThread, model: Path, reset: Any) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = {}
    versions = _arg("--versions", II_VERSIONS)
    for selection in SELECTIONS:
        run = f"search-{selection}"
        cfg = config_ii(work, router, model, run, selection)
        asyncio.run(upgrade(cfg.store))
        reset()
        load = [_load()]
        t0 = time.monotonic()
        trained = train_for(cfg, model, II_MAX_S, 0.0, versions)
        load.append(_load())
        m = measure_ii(cfg)
        m["wall_s"] = round(time.monotonic() - t0, 1)
        m["load"] = load
        m["rewards"] = trained["rewards"]
        m["steps"] = trained["steps"]
        m["trainer_idle"] = round(trained["trainer_idle"], 3)
        m["protect_oldest_group"] = cfg.rollout.protect_oldest_group
        m["trained_tokens"] = trained["trained_tokens"]  # the steps' loss-mask tokens
        m["stale_token_share"] = round(trained["stale_token_share"], 3)
        m["generated_per_trained"] = m["generated"] / max(m["trained_tokens"], 1)
        m["decided_per_trained"] = m["generated_decided"] / max(m["trained_tokens"], 1)
        m["stale_filtered_share"] = m["stale_filtered"] / max(m["finished"], 1)
        m["stale_sibling_share"] = m["stale_siblings"] / max(m["finished"], 1)
        results[selection] = m
        print(f"{run}: {json.dumps({k: v for k, v in m.items() if k != 'rewards'})}", flush=True)
    off, on = results["all"], results["skip_all_equal"]
    versions = min(len(off["rewards"]), len(on["rewards"]))
    reward = {k: round(sum(r["rewards"][:versions]) / max(versions, 1), 3) for k, r in results.items()}
    return {
        "lost": off["lost"] + on["lost"], "not_terminal": off["not_terminal"] + on["not_terminal"],
        "stale_filtered_share": round(max(off["stale_filtered_share"], on["stale_filtered_share"]), 4),
        "stale_sibling_share": {k: round(r["stale_sibling_share"], 4) for k, r in results.items()},
        "length_bias_tokens": round(min(off["length_bias_tokens"], on["length_bias_tokens"]), 3),
        "length_bias_turns": round(min(off["length_bias_turns"], on["length_bias_turns"]), 3),
        "tokens_generated_per_trained": round(on["generated_per_trained"], 3),
        "tokens_generated_per_trained_without_selection": round(off["generated_per_trained"], 3),
        "waste_cut": round(1 - on["generated_per_trained"] / off["generated_per_trained"], 3),
        "waste_cut_decided": round(1 - on["decided_per_trained"] / off["decided_per_trained"], 3),
        "decided_per_trained": {k: round(r["decided_per_trained"], 3) for k, r in results.items()},
        # The same cut before the staleness mask (model tokens of the trained episodes): what
        # selection saves apart from the tokens max_staleness leaves out of the episodes trained.
        "waste_cut_before_stale_mask": round(
            1 - (on["generated"] / max(on["trained_model_tokens"], 1))
            / (off["generated"] / max(off["trained_model_tokens"], 1)), 3),
        "reward_at_version": {"versions": versions, **reward},
        "by_run": {k: {"steps": r["steps"], "wall_s": r["wall_s"], "load": r["load"],
                       "protect_oldest_group": r["protect_oldest_group"],
                       "trainer_idle": r["trainer_idle"],
                       "stale_token_share": r["stale_token_share"],
                       "generated": r["generated"], "trained_tokens": r["trained_tokens"],
                       "trained_model_tokens": r["trained_model_tokens"],
                       "finished": r["finished"], "trained": r["trained"],
                       "zero_variance": r["zero_variance"], "stale_filtered": r["stale_filtered"],
                       "stale_siblings": r["stale_siblings"], "at_limit": r["at_limit"],
                       "episodes_per_task": r["episodes_per_task"],
                       "turns_max": r["turns_max"]} for k, r in results.items()},
    }


def _arg(flag: str, default: int) -> int:
    return int(sys.argv[sys.argv.index(flag) + 1]) if flag in sys.argv else default


def _load() -> float:
    """The 1-minute load average (the machine is shared: figures are read beside it)."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def main() -> None:
    import torch

    from agent_rl.config import load_config
    from agent_rl.sglang.client import EngineClient
    from agent_rl.engine.launcher import EngineServer
    from agent_rl.models import init_model

    torch.set_num_threads(1)
    started = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = init_model(work / "tiny-dense", "tiny-dense", seed=0)
        engine = EngineServer(model, venv=load_config().engine.venv, log_dir=work / "logs",
                              startup_timeout_s=240.0).start()
        router = RouterThread([engine.url], RouterConfig(port=0))
        router.start()
        router.ready.wait(60)
        try:
            def reset_weights() -> None:
                async def go() -> None:
                    async with EngineClient(engine.url) as c:
                        await c.update_weights_from_disk(model, weight_version="default")

                asyncio.run(go())

            if "--designs" not in sys.argv:
                result = long_tail_ii(work, router, model, reset_weights)
                print(f"wall {time.monotonic() - started:.0f} s")
                print("RESULT " + json.dumps(result))
                return
            for load in LOADS:
                for design in DESIGNS:
                    run = f"{load}-{design}"
                    cfg = config(work, router, model, run, load, design)
                    asyncio.run(upgrade(cfg.store))

                    async def reset() -> None:
                        async with EngineClient(engine.url) as c:
                            await c.update_weights_from_disk(model, weight_version="default")

                    asyncio.run(reset())
                    trained = train_for(cfg, model, RUN_S, LOADS[load][2])
                    results[run] = {**trained, **measure(cfg)}
                    print(f"{run}: {json.dumps(results[run])}", flush=True)
        finally:
            router.stop()
            engine.stop()
    fair = [results[f"{load}-fair"] for load in LOADS]
    base = [results[f"{load}-baseline"] for load in LOADS]
    result = {
        "lost": sum(r["lost"] for r in fair + base),
        "not_terminal": sum(r["not_terminal"] for r in fair + base),
        "length_bias": round(min(r["length_bias"] for r in fair), 3),
        "stale_filtered_share": round(max(r["stale_filtered_share"] for r in fair), 4),
        "baseline_length_bias": round(min(r["length_bias"] for r in base), 3),
        "baseline_stale_filtered_share": round(max(r["stale_filtered_share"] for r in base), 4),
        "trainer_idle": {load: round(results[f"{load}-fair"]["trainer_idle"], 3) for load in LOADS},
        "stale_token_share": {load: round(results[f"{load}-fair"]["stale_token_share"], 4)
                              for load in LOADS},
        "by_load": {run: {"length_bias": round(r["length_bias"], 3),
                          "stale_filtered_share": round(r["stale_filtered_share"], 4),
                          "trained": r["trained"], "completed": r["completed"]}
                    for run, r in results.items()},
    }
    print(f"wall {time.monotonic() - started:.0f} s")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
