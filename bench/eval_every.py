"""What `trainer.eval.every` costs the trainer: its step rate with and without evaluations
running beside it, side by side in one run.

Real pieces, quickstart-sized: the quickstart's recipe (its 1M-parameter model, random-init,
the `calculator` env, groups of 8, 8 groups a step), one SGLang engine behind a router for
training, `serve` writing into a SQLite store, the Megatron trainer loop (trainer/loop.py)
stepping, exporting and syncing weights every step. With `trainer.eval.every` on, every EVAL_EVERY
versions the trainer has its evaluator (one `agent-rl eval --from-stdin` process for the phase,
started when the loop opens, trainer/evals.py, at `trainer.eval.nice`, under SCHED_IDLE by
`trainer.eval.cpu_idle`, its session's scheduling group niced to match) evaluate that version on
an evaluation engine of its own behind a second router (`trainer.eval.router_url`, `agent-rl
router` in a process of its own), both at the same priority, as a deployment with an
evaluation fleet runs it. Phases run off / on / on / off, each RUN_S seconds of training after
its first step (the first step fills the pipeline and is not counted).
`step_rate_off_spread` is how far the two off phases differ (relative to their mean): the
machine's own noise, beside which the drop is read.

On this machine every process shares the same 2 CPU cores. So besides the drop in step rate,
the benchmark reports where the machine's CPU went in each kind of phase: the evaluations'
share (the evaluator's and the evaluation engine's and router's CPU seconds over the phase),
the training side's (this process: trainer loop, serve, training router; and the training
engine) and the idle share. Evaluations that take only the CPU training leaves idle show as the
idle share falling while the training share stays as it was. `trainer_waited_s` is the time the
trainer spent asking for evaluations (it never waits for one).

Run: `python bench/eval_every.py [--store postgres]` (about 4-5 minutes; needs `agent-rl engine
install`). With `--store postgres` the store is a throwaway database on
AGENT_RL_TEST_POSTGRES_URL instead of the quickstart's SQLite file, whose one writer at a time the
evaluations' writes share with serve's and the trainer's.
Last line: RESULT {"step_rate_off", "step_rate_on", "step_rate_drop", "step_rate_off_spread",
"evaluations", "eval_cpu_share", "train_cpu_share_off", "train_cpu_share_on", "idle_share_off",
"idle_share_on", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import secrets
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl.config import Config, RouterConfig, TrainerConfig  # noqa: E402
from agent_rl.kernel.priority import IDLE_GROUP_NICE, set_group_nice  # noqa: E402
from bench._proc import tree_cpu_s  # noqa: E402
from bench._serving import RouterProcess, RouterThread, ServeThread, quickstart_run  # noqa: E402
from tests._databases import fresh_postgres  # noqa: E402

RUN_S = 45.0
"""Training seconds per phase, after its first step."""
PHASES = ("off", "on", "on", "off")
"""In this order a drift of the machine's speed through the run (linear in time) weighs on both
sides alike; off / on / off / on read a drop from a machine slowing down."""
EVAL_EVERY = 2
EVAL_TASKS, EVAL_SAMPLES = 16, 4


def config(work: Path, model: Path, train: RouterThread, evals: RouterProcess, phase: int,
           eval_on: bool, store_url: str | None) -> Config:
    # The model is random-init (no SFT: it would cost minutes), so nearly every group has equal
    # rewards; `quickstart_run` trains those too, so steps cost what they cost with signal.
    return quickstart_run(
        work, model, train, f"phase{phase}-{'on' if eval_on else 'off'}",
        eval={"every": EVAL_EVERY if eval_on else 0, "tasks": EVAL_TASKS,
              "samples": EVAL_SAMPLES, "router_url": evals.url}, store_url=store_url,
    )


def own_cpu_s() -> float:
    """User + system CPU seconds of this process (the trainer loop, serve, the training router)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_idle_s() -> float:
    """Seconds all CPUs spent idle since boot (/proc/stat: idle + iowait)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return (int(fields[3]) + int(fields[4])) / os.sysconf("SC_CLK_TCK")


def renice(pid: int, nice: int, idle: bool) -> None:
    """Set `nice`, and SCHED_IDLE if `idle`, on a process (in a session of its own) and its
    descendants, and their session's scheduling group to match (agent_rl/kernel/priority.py)."""
    set_group_nice(pid, IDLE_GROUP_NICE if idle else nice)
    todo = [pid]
    while todo:
        p = todo.pop()
        for tid in os.listdir(f"/proc/{p}/task"):  # every thread: Linux nices threads alone
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            if idle:
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]


def train_for(cfg: Config, model: Path, seconds: float, eval_pids: list[int],
              train_pids: list[int]) -> dict[str, Any]:
    """The trainer loop beside a running serve for `seconds` after its first step."""
    from trainer.learner import learner
    from trainer.loop import TrainLoop

    with learner(model, cfg.trainer) as e:
        loop = TrainLoop(cfg, e, log=lambda line: None)
        loop.open()
        waited = [0.0]
        after_publish = loop.evaluations.after_publish

        def timed(version: int) -> None:  # what starting an evaluation costs the trainer
            t = time.monotonic()
            after_publish(version)
            waited[0] += time.monotonic() - t

        loop.evaluations.after_publish = timed  # type: ignore[method-assign]
        server = ServeThread(cfg, None)
        server.start()
        try:
            while loop.step_once() is None:  # fills the pipeline: not counted
                pass
            # The evaluations' CPU: the evaluator's (one process for the phase, started when the
            # loop opened, trainer/evals.py) and the evaluation fleet's, over the phase alone.
            evaluator = loop.evaluations.proc
            eval_pids = eval_pids + ([evaluator.pid] if evaluator is not None else [])
            fleet0 = sum(map(tree_cpu_s, eval_pids))
            train0 = sum(map(tree_cpu_s, train_pids)) + own_cpu_s()
            idle0 = machine_idle_s()
            steps0, t0 = loop.stats.steps, time.monotonic()
            waited[0] = 0.0
            while time.monotonic() - t0 < seconds:
                loop.step_once()
            wall = time.monotonic() - t0
            train_cpu = sum(map(tree_cpu_s, train_pids)) + own_cpu_s() - train0
            idle = machine_idle_s() - idle0
            eval_cpu = sum(map(tree_cpu_s, eval_pids)) - fleet0
            steps = loop.stats.steps - steps0
            evals_started = list(loop.evaluations.started)
        finally:
            server.stop()
            loop.close()  # waits for an evaluation in progress
        if server.error is not None:
            raise server.error
    return {"steps": steps, "wall_s": wall, "step_rate": steps / wall, "evals_started": evals_started,
            "trainer_waited_s": waited[0], "eval_cpu_s": eval_cpu, "train_cpu_s": train_cpu,
            "idle_s": idle}  # fmt: skip


def recorded_evaluations(cfg: Config) -> list[dict[str, Any]]:
    """The evaluation runs the store holds for this phase's run, with their pinned versions."""
    from agent_rl.store import Store

    async def go() -> list[dict[str, Any]]:
        async with await Store.open(cfg.store) as store:
            run = await store.run_id(cfg.run.name)
            return [{k: e[k] for k in ("version", "episodes", "failed", "mean")}
                    for e in await store.evaluations(run)]

    return asyncio.run(go())


def main(store: str) -> None:
    import torch

    from agent_rl.config import load_config
    from agent_rl.engine.launcher import EngineServer
    from agent_rl.models import init_model
    from agent_rl.app.quickstart.recipe import MODEL_PRESET
    from agent_rl.store.migrate import upgrade

    torch.set_num_threads(1)
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    venv = load_config().engine.venv
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        work = Path(tmp)
        store_url = stack.enter_context(fresh_postgres()) if store == "postgres" else None
        model = init_model(work / "model", MODEL_PRESET, seed=0)
        engines = [EngineServer(model, venv=venv, log_dir=work / "logs", startup_timeout_s=240.0)
                   for _ in range(2)]
        for engine in engines:
            engine.start()
        token = secrets.token_urlsafe(24)  # one admin token: the config has one
        train = RouterThread([engines[0].url], RouterConfig(port=0, admin_token=token))
        train.start()
        train.ready.wait(60)
        # The evaluation fleet's router in a process of its own, as it is deployed (a thread
        # here would relay the evaluations' traffic on the trainer loop's interpreter).
        evals = RouterProcess([engines[1].url], token, work / "eval-router.log")
        evals.start()
        # The evaluation engine and its router run at the evaluations' priority
        # (`trainer.eval.nice` and `trainer.eval.cpu_idle`, which an engine an evaluation starts
        # itself inherits), as a host shared with training would run its evaluation fleet.
        defaults = TrainerConfig()
        fleet = [engines[1].pid or 0, evals.pid]
        for pid in fleet:
            renice(pid, defaults.eval.nice, defaults.eval.cpu_idle)
        try:
            for i, phase in enumerate(PHASES):
                cfg = config(work, model, train, evals, i, phase == "on", store_url)
                asyncio.run(upgrade(cfg.store))
                r = {"phase": phase, **train_for(cfg, model, RUN_S, fleet, [engines[0].pid or 0])}
                r["recorded"] = recorded_evaluations(cfg)
                r["load"] = os.getloadavg()[0]
                results.append(r)
                print(f"{cfg.run.name}: {json.dumps(r)}", flush=True)
        finally:
            train.stop()
            evals.stop()
            for engine in engines:
                engine.stop()
    off = [r for r in results if r["phase"] == "off"]
    on = [r for r in results if r["phase"] == "on"]
    rate = lambda rs: sum(r["steps"] for r in rs) / sum(r["wall_s"] for r in rs)  # noqa: E731
    cores = os.cpu_count() or 1

    def share(rs: list[dict[str, Any]], key: str) -> float:
        """The CPU seconds `key` of phases `rs` as a share of the machine's over them."""
        return round(sum(r[key] for r in rs) / (cores * sum(r["wall_s"] for r in rs)), 3)

    recorded = [e for r in on for e in r["recorded"]]
    result = {
        "step_rate_off": round(rate(off), 3),
        "step_rate_on": round(rate(on), 3),
        "step_rate_drop": round(1 - rate(on) / rate(off), 3),
        "step_rate_off_spread": round(abs(rate(off[:1]) - rate(off[-1:])) / rate(off), 3),
        "evaluations": len(recorded),
        "evaluated_versions": [e["version"] for e in recorded],
        "eval_episodes_failed": sum(e["failed"] for e in recorded),
        "eval_cpu_share": share(on, "eval_cpu_s"),
        # Where the machine's CPU went: the training side's share (this process, the training
        # engine) and the idle share, off and on: an evaluation that took only idle CPU leaves
        # the training share as it was.
        "train_cpu_share_off": share(off, "train_cpu_s"),
        "train_cpu_share_on": share(on, "train_cpu_s"),
        "idle_share_off": share(off, "idle_s"),
        "idle_share_on": share(on, "idle_s"),
        "trainer_waited_s": round(sum(r["trainer_waited_s"] for r in on), 3),
        "store": store,
        "load_avg_1m": round(max(r["load"] for r in results), 2),
        "cores": cores,
    }
    print(f"wall {time.monotonic() - started:.0f} s")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite",
                        help="the store: a SQLite file (the quickstart's), or a throwaway "
                             "database on AGENT_RL_TEST_POSTGRES_URL (default the local test "
                             "server)")
    main(parser.parse_args().store)
