"""The quickstart's stages, each recorded in `quickstart.json` so a second run resumes.

1. model: a random-init tiny model (`runs/model`; `--family`: that family's, at the same size).
2. fleet: SGLang engine(s) behind a standalone router, as supervised processes.
3. eval base, 4. SFT (`agent-rl train --sft`), 5. eval sft,
6. RL: `agent-rl serve` process(es) and one `agent-rl train` against the router, until the
   policy version reaches `rl_steps` or the stage's time is up (a resumed run continues from
   the store and the trainer's checkpoint); with `--cluster`, these roles (two engines, the
   router, two serves, the trainer) are placed on a local Ray cluster by `agent-rl launch`,
7. eval rl (the newest export, pinned by its version), 8. the report.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anyio
from rich.console import Console

from agent_rl.config import Config
from agent_rl.engine.launcher import free_port
from agent_rl.kernel.encoding import version_label
from agent_rl.kernel.errors import AgentRLError, ConfigError
from agent_rl.app.evaluation import Evaluation, score
from agent_rl.app.quickstart.processes import Supervisor, agent_rl_command
from agent_rl.app.quickstart.progress import Progress
from agent_rl.app.quickstart.recipe import (
    BASE_MODEL,
    CONFIG_FILE,
    ENV_ID,
    SFT_MODEL,
    STATE_FILE,
    Options,
    base_model,
    sft_demonstrations,
    write_or_load,
)  # fmt: skip
from agent_rl.store import Store

ENGINE_START_TIMEOUT_S = 600.0
EVAL_SPLIT = "eval"
EVAL_SEED = 1234
"""The evaluation seed: the task order and every request's sampling seed, so two quickstarts
that reach the same weights score them the same."""


class QuickstartError(AgentRLError):
    """A stage failed; the message names the log to read."""


@dataclass
class State:
    """What is done, persisted after every stage."""

    path: Path
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> State:
        return cls(path, json.loads(path.read_text()) if path.is_file() else {})

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)

    def evaluation(self, label: str) -> Evaluation | None:
        d = self.data.get("evals", {}).get(label)
        return Evaluation.from_dict(d) if d else None

    def set_evaluation(self, e: Evaluation) -> None:
        self.data.setdefault("evals", {})[e.label] = e.as_dict()
        self.save()


STOP_ORDER = ["train", "sft", "serve-0", "serve-1", "router", "engine-0", "engine-1"]
"""Consumers before what they consume from."""


@dataclass
class Fleet:
    """Where to reach the run's engines and router, and its serve processes' names."""

    router_url: str
    engines: list[str]
    serves: list[str]


class Quickstart:
    def __init__(self, opts: Options, workdir: Path, console: Console) -> None:
        self.opts, self.console = opts, console
        self.workdir = workdir.resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        os.chdir(self.workdir)  # every path of the recipe is relative to it
        self.started = time.monotonic()
        moe = self.make_model()  # first: the recipe asks whether the engines return its experts
        self.cfg: Config = write_or_load(self.workdir, opts, moe=moe)
        self.state = State.load(self.workdir / STATE_FILE)
        self.token = self.cfg.router.admin_token.get_secret_value() if self.cfg.router.admin_token else None
        self.fleet: Fleet | None = None
        self.supervisor: Supervisor | None = None
        """Set by the caller, which also runs its watcher."""

    async def ensure_fleet(self) -> Fleet:
        """The engines and router, started on first need (a finished run needs none)."""
        if self.fleet is None:
            assert self.supervisor is not None
            self.fleet = await self.start_fleet(self.supervisor)
        return self.fleet

    async def stop_processes(self) -> None:
        """Stop every supervised process, in STOP_ORDER (shielded: also on cancellation)."""
        if self.supervisor is not None:
            with anyio.CancelScope(shield=True):
                await self.supervisor.stop_all(STOP_ORDER)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Supervisor]:
        """The run prepared and its processes supervised for the block; on the way out (a
        failure included) every process is stopped in STOP_ORDER."""
        await self.prepare()
        supervisor = self.supervisor = Supervisor(self.workdir, on_event=self.say)
        async with anyio.create_task_group() as tg:
            tg.start_soon(supervisor.watch)
            try:
                yield supervisor
            finally:
                await self.stop_processes()
                tg.cancel_scope.cancel()

    def say(self, line: str) -> None:
        self.console.print(f"[dim]{time.monotonic() - self.started:6.0f}s[/] {line}", highlight=False)

    # ----- the stages --------------------------------------------------------------------------

    async def prepare(self) -> None:
        from agent_rl.store.db import database_url
        from agent_rl.store.migrate import upgrade

        sqlite = database_url(self.cfg.store.url).drivername == "sqlite"
        if self.opts.cluster and sqlite:
            raise ConfigError("the multi-process mode shares one store between processes on a "
                              "cluster: pass --store-url postgresql://...")
        await upgrade(self.cfg.store)

    def make_model(self) -> bool:
        """The run's random-init base model, made on the first run (`base_model`: the
        quickstart preset, or `--family`'s at its size); whether it is an MoE."""
        from agent_rl.families.arch import ModelArch

        if not (BASE_MODEL / "config.json").is_file():
            from transformers.utils import logging as hf_logging

            from agent_rl.models import init_model

            hf_logging.disable_progress_bar()  # a bar for one tiny file is noise in the summary
            preset, size = base_model(self.opts.family)
            init_model(BASE_MODEL, preset, seed=self.opts.seed, **size)
            self.say(f"made a random-init {preset!r} model{' at the quickstart size' if size else ''}"
                     f" in {BASE_MODEL}")
        return ModelArch.from_hf_dir(BASE_MODEL).is_moe

    async def start_fleet(self, supervisor: Supervisor) -> Fleet:
        n = 2 if self.opts.cluster else 1
        engines = []
        for i in range(n):
            port = free_port()
            supervisor.add(f"engine-{i}", agent_rl_command(
                "engine", "start", "--model", str(BASE_MODEL), "--port", str(port)),
                log_path=Path(f"runs/logs/engine-{i}.log"))  # fmt: skip
            engines.append(f"http://127.0.0.1:{port}")
        workers = [a for url in engines for a in ("--worker", url)]
        supervisor.add("router", agent_rl_command("router", *workers),
                       log_path=Path("runs/logs/router.log"))
        router_url = f"http://127.0.0.1:{self.cfg.router.port}"
        self.say(f"starting {n} SGLang engine{'s' if n > 1 else ''} behind the router at {router_url}")
        for url in engines:
            await _wait_http(url + "/health", ENGINE_START_TIMEOUT_S, supervisor, "engine")
        await _wait_http(router_url + "/model_info", 60, supervisor, "router")
        self.say("engines and router are up")
        serves = [f"serve-{i}" for i in range(n)]
        return Fleet(router_url, engines, serves)

    async def eval_stage(self, label: str, weights: Path, version: int | None) -> Evaluation:
        """`agent-rl eval` of `weights` as policy `version` on the fleet's engines, as a
        supervised process; the result is read from the store."""
        done = self.state.evaluation(label)
        if done is not None and done.version == version:
            return done
        fleet = await self.ensure_fleet()
        assert self.supervisor is not None
        self.say(f"evaluating {label} ({weights}): {self.opts.eval_tasks} fixed tasks x "
                 f"{self.opts.eval_samples} samples")
        run = await _fresh_run_name(self.cfg, f"{self.cfg.run.name}-eval-{label}")
        name = f"eval-{label}"
        m = self.supervisor.add(name, agent_rl_command(
            "eval", "--version", "none" if version is None else str(version),
            "--weights", str(weights), "--router-url", fleet.router_url, "--name", run,
            "--split", EVAL_SPLIT, "--seed", str(EVAL_SEED),
            "--tasks", str(self.opts.eval_tasks), "--samples", str(self.opts.eval_samples)),
            log_path=Path(f"runs/logs/{name}.log"), restart=False)  # fmt: skip
        code = await self.supervisor.wait(name)
        if code != 0:
            raise QuickstartError(f"evaluation {label} failed (exit status {code}); see "
                                  f"{self.workdir / m.log_path}")
        result = await score(self.cfg, run, label=label, weights=weights, version=version,
                             seed=EVAL_SEED)
        self.state.set_evaluation(result)
        self.say(f"{label}: mean reward {result.mean:.3f} (tool use {result.tool_use:.0%})")
        return result

    async def sft_stage(self) -> None:
        if self.state.data.get("sft") == self.opts.sft_steps and (SFT_MODEL / "config.json").is_file():
            return
        assert self.supervisor is not None
        shutil.rmtree(SFT_MODEL, ignore_errors=True)
        self.say(f"SFT warm start: {self.opts.sft_steps} steps on {ENV_ID} demonstrations")
        sup = self.supervisor
        sft_env, kwargs = sft_demonstrations(self.opts, self.cfg)
        m = sup.add("sft", agent_rl_command(
            "train", "--sft", "--model", str(BASE_MODEL), "--output", str(SFT_MODEL),
            "--max-steps", str(self.opts.sft_steps), "--env", sft_env),
            log_path=Path("runs/logs/sft.log"), restart=False,
            # The engines idle meanwhile: the trainer may use both cores.
            env={"AGENT_RL_TRAINER__THREADS": "2", **kwargs})  # fmt: skip
        with Progress(self.console, "SFT") as progress:
            while m.running:
                progress.update(_last_line(m.log_path, "SFT step"))
                await anyio.sleep(1.0)
        code = await sup.wait("sft")
        if code != 0:
            raise QuickstartError(f"SFT failed (exit status {code}); see {self.workdir / m.log_path}")
        self.state.data["sft"] = self.opts.sft_steps
        self.state.save()

    async def rl_stage(self) -> int:
        """Serve and train together; returns the policy version reached."""
        from agent_rl.sglang.client import EngineClient

        if self.opts.cluster:
            return await self.rl_stage_on_ray()

        store = await Store.open(self.cfg.store)
        try:
            run_id = await store.ensure_run(self.cfg.run.name)
            version = await store.latest_version(run_id)
            if version >= self.opts.rl_steps:
                return version
            fleet = await self.ensure_fleet()
            # The engines start on the base weights: give them the policy training resumes from.
            weights = export_path(self.cfg, version) if version else SFT_MODEL
            async with EngineClient(fleet.router_url, token=self.token) as router:
                await router.update_weights_from_disk(weights, weight_version=version_label(version))
            self.say(f"RL: serve and train together from policy version {version} to "
                     f"{self.opts.rl_steps} (at most {self.opts.rl_minutes:g} min)")
            sup = self.supervisor
            assert sup is not None
            for name in fleet.serves:
                sup.add(name, agent_rl_command("serve", "--router-url", fleet.router_url,
                                               "--no-api"), log_path=Path(f"runs/logs/{name}.log"))
            train = sup.add("train", agent_rl_command(
                "train", "--router-url", fleet.router_url,
                "--until-version", str(self.opts.rl_steps)), log_path=Path("runs/logs/train.log"))
            deadline = time.monotonic() + self.opts.rl_minutes * 60
            reached = False
            with Progress(self.console, "RL") as progress:
                while time.monotonic() < deadline:
                    progress.update(await _rl_status(store, run_id, sup, self.opts.rl_steps))
                    reached = await store.latest_version(run_id) >= self.opts.rl_steps
                    if reached or train.stopped or (train.proc is not None and train.proc.poll() == 0):
                        break  # reached the target (or stopped by someone else)
                    await anyio.sleep(1.0)
            self.say("stopping serve (running episodes finish first)")
            with anyio.CancelScope(shield=True):
                for name in fleet.serves:
                    await sup.stop(name, grace_s=60)
                if train.stopped:
                    pass  # someone else is stopping it
                elif train.running and not reached:
                    self.say("RL time is up: stopping the trainer (it checkpoints first)")
                    await sup.stop("train", grace_s=120, sig=signal.SIGINT)
                elif train.running:  # past its last step: let it finish its export and summary
                    with anyio.move_on_after(180):
                        while train.running and "trained " not in _last_line(train.log_path, "trained "):
                            await anyio.sleep(0.5)
                    # (its interpreter can take a minute to tear down megatron's state)
                    await sup.stop("train", grace_s=10)
                # Anything a killed serve left running ends as interrupted, with that cause.
                await store.resolve_interrupted(stale_after_s=0.0, run_id=run_id)
            version = await store.latest_version(run_id)
        finally:
            await store.close()
        self.state.data["rl_version"] = version
        self.state.save()
        return version

    async def rl_stage_on_ray(self) -> int:
        """The RL stage through `agent-rl launch` on a local Ray cluster (on_ray.py): the
        fleet of the evaluations is stopped first (the launch runs engines and a router of its
        own) and started again by the next evaluation."""
        from agent_rl.app.quickstart.on_ray import rl_on_ray

        async with await Store.open(self.cfg.store) as store:
            version = await store.latest_version(await store.ensure_run(self.cfg.run.name))
        if version < self.opts.rl_steps:
            await self.stop_fleet()
            weights = export_path(self.cfg, version) if version else SFT_MODEL
            with Progress(self.console, "RL") as progress:
                version = await rl_on_ray(
                    self.workdir / CONFIG_FILE, start_weights=weights, rl_steps=self.opts.rl_steps,
                    rl_minutes=self.opts.rl_minutes, engines=2, serves=2, say=self.say,
                    progress=progress.update)  # fmt: skip
        self.state.data["rl_version"] = version
        self.state.save()
        return version

    async def stop_fleet(self) -> None:
        """Stop the engines and router (`ensure_fleet` starts them again on next need)."""
        if self.fleet is not None and self.supervisor is not None:
            with anyio.CancelScope(shield=True):
                for name in ("router", *(f"engine-{i}" for i in range(len(self.fleet.engines)))):
                    await self.supervisor.stop(name)
            self.fleet = None


async def _fresh_run_name(cfg: Config, base: str) -> str:
    """`base`, or `base-2`, `-3`... if an interrupted earlier attempt already used it."""
    async with await Store.open(cfg.store) as store:
        names = {r["name"] for r in await store.list_runs()}
    name, n = base, 1
    while name in names:
        n += 1
        name = f"{base}-{n}"
    return name


def export_path(cfg: Config, version: int) -> Path:
    """The trainer's HF export of policy `version` (QuickstartError if it is gone)."""
    path = Path(cfg.trainer.export_dir) / f"v{version:06d}"
    if not (path / "config.json").is_file():
        raise QuickstartError(f"the export of policy version {version} ({path}) is missing")
    return path


async def _rl_status(store: Store, run_id: int, sup: Supervisor, target: int) -> str:
    ledger = await store.ledger(run_id)
    versions = await store.policy_versions(run_id)
    recent = [v["metrics"] or {} for v in versions[-5:]]
    version = versions[-1]["version"] if versions else 0

    def mean(key: str) -> str:
        vals = [m[key] for m in recent if isinstance(m.get(key), (int, float))]
        return f"{sum(vals) / len(vals):.2f}" if vals else "-"

    restarts = sum(max(m.starts - 1, 0) for m in sup.procs.values())
    return (f"v{version}/{target} | episodes: {ledger.trained} trained, {ledger.filtered} "
            f"filtered, {ledger.failed} failed | reward {mean('reward_mean')} | staleness "
            f"{mean('staleness_mean')} | idle {mean('idle_fraction')}"
            + (f" | restarts {restarts}" if restarts else ""))


def _last_line(path: Path, prefix: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if prefix in ln]
    except OSError:
        return ""
    return lines[-1].strip() if lines else "starting"


async def _wait_http(url: str, timeout_s: float, sup: Supervisor, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass
            await anyio.sleep(1.0)
    logs = ", ".join(str(m.log_path) for m in sup.procs.values() if m.name.startswith(what))
    raise QuickstartError(f"{url} did not answer within {timeout_s:.0f}s; see {logs}")
