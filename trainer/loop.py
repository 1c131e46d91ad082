"""The asynchronous training loop: claim ready groups, step, commit, publish, checkpoint.

Each step (`step_once`):
1. claim `groups_per_step` ready groups within the staleness bound under a lease (the floor is
   the current version - max_staleness, `--sync`: the current version, only data of the current
   policy; tokens sampled below the floor do not train, `agent_rl.store.staleness`); if fewer
   are ready, give them back and wait, counting the wait as idle time and saying so on the
   terminal; the batch is built from the stored tokens (trainer/data.py `load_batch`);
2. take one RL step (trainer/learner.py);
3. ONE `store.commit` marks the groups' episodes trained and publishes the new policy version
   (with the step's metrics, read by the web API);
4. publish the weights through the `trainer.weight_sync.mode`'s `WeightSync`
   (trainer/weight_sync/): an in-memory mode pushes them every step; every `export_every` steps
   they are exported as HF safetensors and the sync takes the export (disk: every engine loads
   it); every `eval.every` versions one is evaluated in a process of its own (trainer/evals.py).
Every `checkpoint_every` steps and at shutdown a dist_checkpointing checkpoint is written (the
newest `keep_checkpoints` stay, when set). A restart resumes from the latest checkpoint;
versions continue from the store's latest, and groups a dead trainer held return to the store
when its lease expires (commits are by claim id, so no episode is trained twice). If a commit
loses its lease, the step's data is discarded (logged), and while it waits for data the loop
brings engines that lag back to the newest version.

Multi-rank (torchrun): every rank steps; only rank 0 talks to the store and the router, and
broadcasts each step's data to the others.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from agent_rl.config import Config
from agent_rl.sglang.client import EngineClient
from agent_rl.kernel.errors import EngineError, LeaseLostError
from agent_rl.kernel.encoding import version_label
from agent_rl.store import Claim, Span, Store
from agent_rl.store.staleness import bucket
from trainer.data import TrainingData, load_batch
from trainer.evals import Evaluations
from trainer.checkpoint import latest_checkpoint
from trainer.learner import Learner
from trainer import weight_sync
from trainer.weight_sync.base import WeightSync

T = TypeVar("T")
WAIT_LOG_S = 30.0  # repeat the "waiting for data" line this often


@dataclass
class LoopStats:
    """What a run of the loop did (returned to the CLI, tests and the benchmark)."""

    steps: int = 0
    start_step: int = 0
    version: int = 0
    idle_s: float = 0.0
    wall_s: float = 0.0
    lost_leases: int = 0
    failed_syncs: int = 0
    """Weight syncs that left an engine without the new version (the engine was dropped)."""
    episodes: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def idle_fraction(self) -> float:
        return self.idle_s / self.wall_s if self.wall_s else 0.0


class _StopRequested(Exception):
    """Raised inside the waiting loop once `request_stop` was called. `agreed`: every rank
    knows it already (the ranks agreed on it while rank 0 waited), so no rank waits for data."""

    def __init__(self, agreed: bool = False) -> None:
        super().__init__()
        self.agreed = agreed


_WAITING = "waiting for data"
"""What rank 0 broadcasts for a step's data at every poll that found too little: the ranks
waiting for the data then agree on their stop flags, so a stop asked of any one of them ends
the job while rank 0 waits, not only once data comes."""


class TrainLoop:
    """Consumes the store for run `cfg.run.name`; see the module docstring."""

    def __init__(
        self,
        cfg: Config,
        learner: Learner,
        *,
        sync_mode: bool = False,
        router_url: str | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.cfg, self.tcfg, self.learner = cfg, cfg.trainer, learner
        self.sync_mode = sync_mode
        self.router_url = weight_sync.router_url(cfg, router_url)
        self.log = log
        self.rank0 = not dist.is_initialized() or dist.get_rank() == 0
        self.trainer_id = f"trainer-{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.stats = LoopStats()
        self._aio = asyncio.Runner()
        self._store: Store | None = None
        self._router: EngineClient | None = None
        """The router (or SGLang server) in front of the engines: one pooled client, rank 0."""
        self.sync: WeightSync | None = None
        """How each version reaches the engines (`trainer.weight_sync.mode`), through `_router`;
        rank 0, None without a router."""
        self._tb: Any = None
        self._last_checkpoint_step = -1
        self._spans: list[Span] = []
        """This step's spans of time, recorded once it is done."""
        self.evaluations = Evaluations(cfg, log)
        """`trainer.eval.every`: evaluations of published versions, in a process of their own."""
        self.stopping = False
        """Set by `request_stop` (a signal handler): the loop ends at its next safe point."""

    def request_stop(self) -> None:
        """Graceful stop: finish the step in progress (or stop waiting), checkpoint, return."""
        self.stopping = True

    # ----- plumbing ----------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._aio.run(coro)

    @property
    def store(self) -> Store:
        assert self._store is not None, "only rank 0 talks to the store"
        return self._store

    def _stop_agreed(self) -> bool:
        """Whether any rank was asked to stop; then every rank stops here, at the same step.
        A signal reaches torchrun's ranks at different moments (or only one of them), and a
        rank that left the loop alone would leave the others in the next step's collectives."""
        if self._multi_rank:
            flags: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(flags, self.stopping)
            # The answer is the gathered flags, the same on every rank. A signal handled on this
            # rank during the gather (a rank spends most of its wait inside collectives) sets its
            # flag after it was sent: that stop is kept for the next gather, neither cleared (it
            # would be lost) nor acted on now (this rank would leave alone).
            agreed = any(flags)
            if agreed:
                self.stopping = True
            return agreed
        return self.stopping

    @property
    def _multi_rank(self) -> bool:
        return dist.is_initialized() and dist.get_world_size() > 1

    def _broadcast(self, obj: Any) -> Any:
        if not self._multi_rank:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # ----- lifecycle ---------------------------------------------------------------------------

    def open(self) -> None:
        """Open the store, resume from the latest checkpoint, check the router."""
        latest = latest_checkpoint(self.tcfg.checkpoint_dir)
        if latest is not None:
            step = self.learner.load_checkpoint(latest)
            self.log(f"resumed from checkpoint {latest} (step {step})")
        self._last_checkpoint_step = self.learner.step
        self.stats.start_step = self.learner.step
        if not self.rank0:
            return
        self._store = self._call(Store.open(self.cfg.store))
        self.run_id = self._call(self.store.ensure_run(self.cfg.run.name))
        self.stats.version = self._call(self.store.latest_version(self.run_id))
        if self.router_url:
            token = self.cfg.router.admin_token
            self._router = EngineClient(
                self.router_url, token=token.get_secret_value() if token is not None else None
            )
            self._call(self._router.model_info(timeout_s=5.0))  # a wrong URL fails now
            self.sync = weight_sync.make_sync(self._router, self.tcfg.weight_sync)
        else:
            self.log("no router configured: weights are exported but not synced to engines")
        if self.tcfg.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.tcfg.tensorboard_dir))
        self.evaluations.open()

    def close(self) -> None:
        """Checkpoint if steps were taken since the last one; close the store."""
        try:
            if self.learner.step != self._last_checkpoint_step:
                self._checkpoint()
        finally:
            self.evaluations.close()
            if self._tb is not None:
                self._tb.close()
            if self.sync is not None:
                self._call(self.sync.close())
            if self._router is not None:
                self._call(self._router.aclose())
            if self._store is not None:
                self._call(self._store.close())
            self._aio.close()

    def run(self, max_steps: int | None = None, until_version: int | None = None) -> LoopStats:
        """Train until `max_steps` steps are taken in this process, or until the run's policy
        version reaches `until_version` (a restarted trainer then finishes the same run); None:
        until interrupted."""
        self.open()
        started = time.monotonic()
        try:
            while (max_steps is None or self.stats.steps < max_steps) and (
                until_version is None or self.stats.version < until_version
            ) and not self._stop_agreed():
                try:
                    self.step_once()
                except _StopRequested:
                    break
                self.stats.wall_s = time.monotonic() - started
        finally:
            self.stats.wall_s = time.monotonic() - started
            self.close()
        return self.stats

    # ----- one step ----------------------------------------------------------------------------

    def step_once(self) -> dict[str, Any]:
        """Claim, train, commit, publish, checkpoint; returns the step's metrics. Its spans of
        wall-clock time (waiting, stepping, exporting, syncing) go to the store after the step,
        for the compute audit (`agent_rl.store.audit`)."""
        self._spans = []
        claim, data, waited = self._next_batch()
        metrics = self._train(data, waited)
        step = self.learner.step
        checkpoint = self._checkpoint() if step % self.tcfg.checkpoint_every == 0 else None
        # No new version after a lost lease: nothing to label an export with until the next one.
        committed = self.rank0 and self._commit(claim, step, metrics, data, checkpoint)
        if self._broadcast(committed):
            self._publish(step)
        if self.rank0 and self._spans:
            self._call(self.store.record_timings(self.run_id, self._spans))
        self.stats.steps += 1
        return metrics

    def _next_batch(self) -> tuple[Any, TrainingData, float]:
        """Rank 0 claims a full batch of groups and loads it (trainer/data.py); every rank
        gets the data. The claim (None on other ranks) and rank 0's idle seconds go with it.
        `_StopRequested` when a stop came while waiting."""
        claim, data, waited = None, None, 0.0
        if self.rank0:
            wait_started = time.time()
            try:
                claim, waited = self._wait_for_claim()
            except _StopRequested as stop:
                if stop.agreed:
                    raise
                claim = None  # the other ranks, waiting for this step's data, stop with it
            else:
                self._span("wait", wait_started)
                data = self._call(
                    load_batch(self.store, claim, self.stats.version, self.floor,
                               measure=self.tcfg.staleness_measure,
                               advantage=self.tcfg.loss.advantage,
                               use_experts=self.learner.routing_replay is not None)
                )
        data = self._broadcast(data)
        while isinstance(data, str):  # _WAITING; not rank 0: it polled the store and found too little
            if self._stop_agreed():
                raise _StopRequested(agreed=True)
            data = self._broadcast(None)
        if data is None:
            self.stopping = True
            raise _StopRequested
        assert isinstance(data, TrainingData)
        return claim, data, waited

    @property
    def floor(self) -> int:
        """The oldest policy version this step may train tokens of (`--sync`: the current one)."""
        return self.stats.version - (0 if self.sync_mode else self.tcfg.max_staleness)

    def _wait_for_claim(self) -> tuple[Claim, float]:
        """Claim a full batch of groups, waiting (idle) while fewer are ready."""
        need = self.tcfg.groups_per_step
        floor = self.floor
        waited, announced = 0.0, -WAIT_LOG_S
        t0 = time.monotonic()
        # Once per step, not per poll: a write transaction each poll would contend with serve.
        if floor > 0:
            dropped = self._call(
                self.store.filter_stale(self.run_id, floor, self.tcfg.staleness_measure,
                                        self.tcfg.stale_siblings))
            if dropped:
                self.log(f"filtered {dropped} groups sampled below policy version {floor} (stale)")
        while True:
            if self.stopping:
                raise _StopRequested
            claim = self._call(
                self.store.claim(self.run_id, self.trainer_id, need, min_version=floor,
                                 measure=self.tcfg.staleness_measure,
                                 siblings=self.tcfg.stale_siblings,
                                 lease_s=self.tcfg.claim_lease_s)
            )
            if len(claim.groups) >= need:
                return claim, waited
            self._call(self.store.release(claim))
            if self._multi_rank:
                self._broadcast(_WAITING)
                if self._stop_agreed():
                    raise _StopRequested(agreed=True)
            self._reconcile_weights()
            waited = time.monotonic() - t0
            if waited - announced >= WAIT_LOG_S:
                announced = waited
                self.log(
                    f"waiting for data: {len(claim.groups)}/{need} groups ready in run "
                    f"{self.cfg.run.name!r} at policy version >= {max(floor, 0)} "
                    f"(idle {waited:.0f}s; is `agent-rl serve` running?)"
                )
            time.sleep(self.tcfg.data_poll_s)

    def _train(self, data: TrainingData, waited: float) -> dict[str, Any]:
        """One RL step on the batch; the learner's metrics and the step's own."""
        t0, step_started = time.monotonic(), time.time()
        self._record_trainer_logprobs(data)
        metrics: dict[str, Any] = dict(self.learner.rl_step(data.batch))
        step_s = time.monotonic() - t0
        self._span("step", step_started)
        self.stats.idle_s += waited
        metrics.update(
            idle_s=waited,
            step_s=step_s,
            idle_fraction=waited / max(waited + step_s, 1e-9),
            tokens_per_s=data.model_tokens / max(step_s, 1e-9),
            episodes=len(data.episode_ids),
            stale_siblings=len(data.stale_siblings),
            stale_tokens=data.stale_tokens,
            failed_syncs=self.stats.failed_syncs,
            reward_mean=sum(data.rewards) / len(data.rewards),
            staleness_mean=sum(data.staleness) / len(data.staleness),
            staleness_histogram={str(k): v for k, v in
                                 sorted(Counter(map(bucket, data.staleness)).items())},
        )
        return metrics

    def _span(self, kind: str, started: float) -> None:
        self._spans.append(Span(kind, started, time.time(), self.trainer_id))

    def _record_trainer_logprobs(self, data: TrainingData) -> None:
        """The trainer's (pre-step) logprobs of the first micro-batch, kept for inspection."""
        mb = data.batch.rows(slice(0, self.tcfg.micro_batch_size))
        lp = self.learner.logprobs(mb)["logprobs"]
        if not self.rank0:
            return
        rows: dict[int, list[Any]] = {}
        for row, eid in enumerate(data.rows_of_episodes()):
            rows.setdefault(eid, []).append(lp[row, : data.lengths[row]] if row < mb.size else None)
        for eid, spans in rows.items():  # an episode's segments joined back into its stream
            if all(span is not None for span in spans):
                self._call(self.store.record_trainer_logprobs(eid, torch.cat(spans).numpy()))

    def _commit(
        self, claim: Claim, step: int, metrics: dict[str, Any], data: TrainingData,
        checkpoint: Path | None,
    ) -> bool:
        version = self.stats.version + 1
        try:
            self._call(
                self.store.commit(claim, self.run_id, step=step, version=version,
                                  checkpoint=str(checkpoint) if checkpoint else None,
                                  metrics=metrics, advantages=data.advantages,
                                  staleness=dict(zip(data.episode_ids, data.staleness)),
                                  stale_siblings=data.stale_siblings)
            )
        except LeaseLostError as e:
            self.stats.lost_leases += 1
            self.log(f"step {step}: {e}")
            return False
        self.stats.version = version
        self.stats.episodes += len(data.episode_ids)
        self.stats.history.append(dict(metrics, version=version))
        self._report(step, version, metrics)
        return True

    def _report(self, step: int, version: int, m: dict[str, Any]) -> None:
        self.log(
            f"step {step} v{version} | loss {m.get('loss', 0):+.4f} kl {m.get('policy_kl', 0):.2e} "
            f"clip {m.get('clip_fraction', 0):.3f} gnorm {m.get('grad_norm', 0):.3f} "
            f"ent {m.get('entropy', 0):.3f} |lp-rollout| {m.get('train_rollout_logprob_abs_diff', 0):.1e} "
            f"stale {m['staleness_histogram']} idle {m['idle_fraction']:.2f} "
            f"{m['tokens_per_s']:.0f} tok/s reward {m['reward_mean']:.3f}"
        )
        if self._tb is not None:
            for key, value in m.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(f"train/{key}", value, step)
            self._tb.flush()

    def _checkpoint(self) -> Path:
        path = self.learner.save_checkpoint(self.tcfg.checkpoint_dir, self.tcfg.keep_checkpoints)
        self._last_checkpoint_step = self.learner.step
        return path

    # ----- publishing the weights --------------------------------------------------------------

    def _publish(self, step: int) -> None:
        """The committed version reaches the engines: an in-memory mode pushes it every step;
        every `export_every` steps it is exported and the sync takes the export (disk: every
        engine loads it; in memory: the weights a returning engine loads before it serves).
        Then, every `eval.every` versions, an evaluation starts beside training."""
        version = self._broadcast(self.stats.version)
        if weight_sync.MODES[self.tcfg.weight_sync.mode].in_memory:
            self._push(step, version)
        if step % self.tcfg.export_every == 0:
            self._export(step, version)
        if self.rank0:
            self.evaluations.after_publish(version)

    def _push(self, step: int, version: int) -> None:
        """Every engine in rotation serves `version` from the trainer's memory. A failure (an
        engine dropped, or none reached) is counted in `failed_syncs` and logged; training
        goes on."""
        started = time.time()
        weights = self.learner.hf_state_dict()  # collective: every rank gathers
        if not self.rank0 or self.sync is None:
            return
        try:
            report = self._call(self.sync.push(weights, version))
            problem = "" if report.ok else f"engines dropped: {report.dropped}"
        except EngineError as e:
            report, problem = None, str(e)
        self._span("sync", started)
        if problem:
            self.stats.failed_syncs += 1
            self.log(f"step {step}: weight sync of v{version} incomplete ({problem[:500]}); "
                     f"{self.stats.failed_syncs} failed so far; training continues")
        if self.stats.history and self.stats.history[-1].get("version") == version:
            self.stats.history[-1].update(
                weight_sync_s=time.time() - started, weight_sync_ok=not problem,
                failed_syncs=self.stats.failed_syncs)
        if report is not None and self._tb is not None:
            self._tb.add_scalar("train/weight_sync_s", report.seconds, step)
            self._tb.add_scalar("train/failed_syncs", self.stats.failed_syncs, step)

    def _export(self, step: int, version: int) -> None:
        """Write `version`'s HF export (every rank takes part) and hand it to the sync."""
        out = self._export_path(version)
        started = time.time()
        self.learner.export_hf(out)
        if not self.rank0:
            return
        self._span("export", started)
        # Keep the two newest exports: an engine may still be reading the previous one.
        for old in sorted(Path(self.tcfg.export_dir).glob("v*"))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        if self.sync is None:
            return
        started = time.time()
        try:
            if self._call(self.sync.exported(out, version)):
                self._span("sync", started)
        except EngineError as e:
            # An engine down mid-update (crashed, restarting) must not stop training: the
            # router gives a restored engine the newest weights, and while waiting for data
            # this loop re-syncs engines that lag.
            self.log(f"step {step}: v{version}'s export: {e}; training continues")

    def _export_path(self, version: int) -> Path:
        return Path(self.tcfg.export_dir) / f"v{version:06d}"

    def _reconcile_weights(self) -> None:
        """While waiting for data: if an engine behind the router serves another version than
        the newest published one (it restarted, or the router did and an engine with it), send
        it the newest weights again. Otherwise the fleet could sit on weights too stale for
        serve to admit anything, and this trainer would wait forever."""
        version = self.stats.version
        export = self._export_path(version)
        # From memory only in a trainer of one rank: the weights are gathered collectively, and
        # the other ranks are not in this loop. Otherwise the newest export, as for disk.
        from_memory = self.sync is not None and self.sync.in_memory and not self._multi_rank
        if self.sync is None or version == 0 or not (
                from_memory or (export / "config.json").is_file()):
            return
        served = self._call(self.sync.router.served_versions())
        behind = {url: v for url, v in served.items() if v != version_label(version)}
        if not behind:
            return
        self.log(f"engines {behind} do not serve policy version {version}: loading it again")
        if from_memory:
            self._push(self.learner.step, version)
            return
        try:
            self._call(self.sync.load(export, version))
        except EngineError as e:
            self.log(f"weight re-sync failed ({e}); will retry")
