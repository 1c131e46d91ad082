"""`trainer.eval_every`: evaluations at pinned policy versions while training goes on.

Every k published versions the trainer starts `agent-rl eval` of that version in a process of
its own (at most one at a time: a version that comes up while one runs is skipped, and said
so), on the version's export hard-linked aside (the trainer keeps only its two newest exports,
and the evaluation's engine may load them later than that). The evaluation runs on its own
engine, or on `trainer.eval_router_url`'s, so the training fleet keeps serving the newest
policy and the trainer never waits for it; under SCHED_IDLE (`trainer.eval_cpu_idle`) and at
`trainer.eval_nice` it takes only the CPU that rollout and training leave. The child reads the
trainer's effective configuration from a private file (secrets included, mode 0600), so it
evaluates the run the trainer trains, with the same store.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from agent_rl.config import Config

CLOSE_WAIT_S = 300.0
"""How long a stopping trainer waits for an evaluation in progress before stopping it."""


class Evaluations:
    def __init__(self, cfg: Config, log: Callable[[str], None]) -> None:
        self.cfg, self.tcfg, self.log = cfg, cfg.trainer, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.version: int | None = None
        self._dir = Path(self.tcfg.export_dir) / "eval"
        self._config: Path | None = None
        self.started: list[int] = []
        """The versions an evaluation was started for."""

    def after_publish(self, version: int) -> None:
        """Start the evaluation of `version` if it is due and none is running."""
        self.poll()
        if not self.tcfg.eval_every or version % self.tcfg.eval_every:
            return
        if self.proc is not None:
            self.log(f"evaluation of v{version} skipped: v{self.version}'s is still running")
            return
        export = Path(self.tcfg.export_dir) / f"v{version:06d}"
        if not (export / "config.json").is_file():
            self.log(f"evaluation of v{version} skipped: it has no export (trainer.export_every)")
            return
        weights = self._dir / export.name
        shutil.rmtree(weights, ignore_errors=True)
        shutil.copytree(export, weights, copy_function=os.link)
        argv = [sys.executable, "-m", "agent_rl.cli", "--config", str(self._config_file()),
                "eval", "--version", str(version), "--weights", str(weights),
                "--split", self.tcfg.eval_split, "--seed", str(self.tcfg.eval_seed),
                "--tasks", str(self.tcfg.eval_tasks), "--samples", str(self.tcfg.eval_samples)]
        if self.tcfg.eval_env:
            argv += ["--env", self.tcfg.eval_env]
        if self.tcfg.eval_router_url:
            argv += ["--router-url", self.tcfg.eval_router_url]
        log_path = Path(self.cfg.engine.log_dir) / f"eval-v{version:06d}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            nice, idle = self.tcfg.eval_nice, self.tcfg.eval_cpu_idle
            lower = (lambda: spare_cpu_only(nice, idle)) if nice or idle else None
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=lower)
        self.version = version
        self.started.append(version)
        self.log(f"evaluating v{version} in the background (log: {log_path})")

    def poll(self) -> None:
        """Note an evaluation that ended, and remove its weights."""
        if self.proc is None or self.proc.poll() is None:
            return
        code, version = self.proc.returncode, self.version
        self.proc = self.version = None
        shutil.rmtree(self._dir / f"v{version:06d}", ignore_errors=True)
        if code:
            self.log(f"evaluation of v{version} failed (exit status {code}); see its log")
        else:
            self.log(f"evaluation of v{version} done (agent-rl audit / the viewer's run page)")

    def close(self) -> None:
        """Wait for the evaluation in progress (up to CLOSE_WAIT_S), then clean up."""
        if self.proc is not None:
            deadline = time.monotonic() + CLOSE_WAIT_S
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            if self.proc.poll() is None:
                self.log(f"evaluation of v{self.version} still running: stopping it")
                self.proc.terminate()
                self.proc.wait(60)
            self.poll()
        if self._config is not None:
            self._config.unlink(missing_ok=True)

    def _config_file(self) -> Path:
        if self._config is None:
            import tomli_w

            fd, name = tempfile.mkstemp(prefix="agent-rl-eval-", suffix=".toml")
            with os.fdopen(fd, "wb") as f:  # mkstemp: mode 0600
                tomli_w.dump(_plain(self.cfg.model_dump()), f)
            self._config = Path(name)
        return self._config


def spare_cpu_only(nice: int, idle: bool) -> None:
    """Lower this process's CPU priority (before an evaluation execs; what it starts inherits
    it): `nice` more, and SCHED_IDLE where the platform has it (`trainer.eval_cpu_idle`)."""
    if nice:
        os.nice(nice)
    if idle and hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _plain(value: Any) -> Any:
    """The config as TOML can hold it: secrets revealed, paths as strings, no None."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, Path):
        return str(value)
    return value
