"""`trainer.eval.every`: evaluations at pinned policy versions while training goes on.

Every k published versions the trainer asks its evaluator for that version's evaluation. The
evaluator is one `agent-rl eval --from-stdin` process, started when the trainer opens and kept
for the run (agent_rl/app/evaluation.py `evaluate_each`): a process started per evaluation spent
most of what the evaluation cost the host importing itself, and without
`trainer.eval.router_url` starting an engine. At most one evaluation runs at a time: a version
that comes up while one runs is skipped, and said so. Each is of the version's export
hard-linked aside (the trainer keeps only its two newest exports, and the evaluator may load
them later than that). The evaluation runs on the evaluator's own engine, or on
`trainer.eval.router_url`'s, so the training fleet keeps serving the newest policy and the
trainer never waits for it; under SCHED_IDLE (`trainer.eval.cpu_idle`) and at
`trainer.eval.nice` it takes only the CPU that rollout and training leave. The evaluator reads
the trainer's effective configuration from a private file (secrets included, mode 0600), so it
evaluates the run the trainer trains, with the same store. An evaluator that dies is started
again for the next evaluation due; its log is `engine.log_dir/evals.log`.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from pydantic import SecretStr

from agent_rl.config import Config
from agent_rl.kernel.priority import spare_cpu_only

CLOSE_WAIT_S = 300.0
"""How long a stopping trainer waits for an evaluation in progress before stopping it."""


class Evaluations:
    def __init__(self, cfg: Config, log: Callable[[str], None]) -> None:
        self.cfg, self.tcfg, self.log = cfg, cfg.trainer, log
        self.proc: subprocess.Popen[bytes] | None = None
        """The evaluator process (None until started, and after it exited)."""
        self.version: int | None = None
        """The version being evaluated; None: the evaluator is idle."""
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._dir = Path(self.tcfg.export_dir) / "eval"
        self._config: Path | None = None
        self.log_path = Path(self.cfg.engine.log_dir) / "evals.log"
        self.started: list[int] = []
        """The versions an evaluation was started for."""
        self.results: list[dict[str, Any]] = []
        """The evaluator's replies, in order (`evaluate_each`'s)."""

    def open(self) -> None:
        """Start the evaluator if this run evaluates (its start-up then overlaps the trainer's)."""
        if self.tcfg.eval.every and self.proc is None:
            self._start()

    def after_publish(self, version: int) -> None:
        """Ask for the evaluation of `version` if it is due and none is running."""
        self.poll()
        if not self.tcfg.eval.every or version % self.tcfg.eval.every:
            return
        if self.version is not None:
            self.log(f"evaluation of v{version} skipped: v{self.version}'s is still running")
            return
        export = Path(self.tcfg.export_dir) / f"v{version:06d}"
        if not (export / "config.json").is_file():
            self.log(f"evaluation of v{version} skipped: it has no export (trainer.export_every)")
            return
        weights = self._dir / export.name
        shutil.rmtree(weights, ignore_errors=True)
        shutil.copytree(export, weights, copy_function=os.link)
        if self.proc is None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"version": version, "weights": str(weights)})
                                  .encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:  # it died since the last poll: the next poll says how
            shutil.rmtree(weights, ignore_errors=True)
            self.log(f"evaluation of v{version} not started: the evaluator exited "
                     f"(see {self.log_path})")
            self.poll()
            return
        self.version = version
        self.started.append(version)
        self.log(f"evaluating v{version} in the background (log: {self.log_path})")

    def poll(self) -> None:
        """Note the evaluations that ended (removing their weights), and an evaluator that
        exited (it is started again for the next evaluation due)."""
        while True:
            try:
                reply = self._replies.get_nowait()
            except queue.Empty:
                break
            if reply is None:  # the evaluator's output ended: it exited
                self._exited()
                continue
            self._done(reply)

    def close(self) -> None:
        """Let the evaluation in progress finish (up to CLOSE_WAIT_S), then stop the evaluator."""
        proc = self.proc
        if proc is not None:
            assert proc.stdin is not None
            try:
                proc.stdin.close()  # no more requests: it exits after the one in progress
            except OSError:
                pass
            try:
                proc.wait(CLOSE_WAIT_S if self.version is not None else 60)
            except subprocess.TimeoutExpired:
                self.log(f"evaluation of v{self.version} still running: stopping it"
                         if self.version is not None else "the evaluator did not stop: stopping it")
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self._reader.join(10)
            self.poll()
        if self._config is not None:
            self._config.unlink(missing_ok=True)

    # ----- the evaluator -------------------------------------------------------------------------

    def _start(self) -> None:
        argv = [sys.executable, "-m", "agent_rl.app.cli", "--config", str(self._config_file()),
                "eval", "--from-stdin", "--split", self.tcfg.eval.split,
                "--seed", str(self.tcfg.eval.seed), "--tasks", str(self.tcfg.eval.tasks),
                "--samples", str(self.tcfg.eval.samples)]
        if self.tcfg.eval.env:
            argv += ["--env", self.tcfg.eval.env]
        if self.tcfg.eval.router_url:
            argv += ["--router-url", self.tcfg.eval.router_url]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as err:
            nice, idle = self.tcfg.eval.nice, self.tcfg.eval.cpu_idle
            lower = (lambda: spare_cpu_only(nice, idle)) if nice or idle else None
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, start_new_session=True, preexec_fn=lower)
        assert self.proc.stdout is not None
        self._reader = threading.Thread(target=_read_replies, name="evaluator-replies",
                                        args=(self.proc.stdout, self._replies), daemon=True)
        self._reader.start()

    def _done(self, reply: dict[str, Any]) -> None:
        self.results.append(reply)
        version = reply.get("version")
        if version is not None:
            shutil.rmtree(self._dir / f"v{version:06d}", ignore_errors=True)
        if version == self.version:
            self.version = None
        if reply.get("ok"):
            self.log(f"evaluation of v{version} done: mean reward {reply['mean']:.3f} "
                     f"(agent-rl audit / the viewer's run page)")
        else:
            self.log(f"evaluation of v{version} failed: {reply.get('error')} (see {self.log_path})")

    def _exited(self) -> None:
        assert self.proc is not None
        code = self.proc.wait()
        self.proc = None
        how = (f"was killed by {signal.Signals(-code).name}" if code < 0
               else f"exited with status {code}")
        if self.version is not None:
            shutil.rmtree(self._dir / f"v{self.version:06d}", ignore_errors=True)
            self.log(f"evaluation of v{self.version} failed: the evaluator {how} "
                     f"(see {self.log_path}); the next evaluation due starts another")
            self.version = None
        elif code:
            self.log(f"the evaluator {how} (see {self.log_path}); the next evaluation due "
                     "starts another")

    def _config_file(self) -> Path:
        if self._config is None:
            import tomli_w

            fd, name = tempfile.mkstemp(prefix="agent-rl-eval-", suffix=".toml")
            with os.fdopen(fd, "wb") as f:  # mkstemp: mode 0600
                tomli_w.dump(_plain(self.cfg.model_dump()), f)
            self._config = Path(name)
        return self._config


def _read_replies(out: IO[bytes], replies: queue.Queue[dict[str, Any] | None]) -> None:
    """The evaluator's replies, one JSON line each, into `replies`; None once it ends."""
    try:
        for line in out:
            try:
                reply = json.loads(line)
            except ValueError:
                continue  # not a reply (the evaluator sends everything else to its log)
            if isinstance(reply, dict):
                replies.put(reply)
    finally:
        replies.put(None)


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
