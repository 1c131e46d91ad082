"""Start, health-wait, log, watch and stop one SGLang server as a subprocess.

`EngineServer` is what `agent-rl engine start`, `agent-rl serve` (its embedded engine) and the
test fixtures use. Contract:

- `start()` checks what can be checked before spending half a minute on a launch (the model
  directory, the port, the engine environment), starts `sglang.launch_server` from the engine
  venv in its own process group with its output in a log file, and returns once
  `/health_generate` answers 200. `astart()` is the same for an event loop; `launch()` only
  spawns, so several engines can start side by side before `wait_until_healthy()`. Any
  failure raises `EngineError` with one line that says what to do, plus the log's telling
  line when the engine itself died.
- On CPU the server runs SGLang's CPU engine with agent-rl's compatibility layer on its
  PYTHONPATH (`agent_rl/engine/sglang_cpu/sitecustomize.py`); on a GPU it runs stock SGLang,
  with `speculative_steps` the model's MTP draft too (agent_rl/sglang/speculative.py; refused
  on CPU before a launch).
- `check()` raises `EngineError` if the process has exited (a crash); `watch()` is the same as
  an async loop for a supervisor's task group.
- `stop()` terminates the whole process group (SGLang's scheduler and detokenizer children
  included), escalating to SIGKILL, and returns once it is gone; `astop()` awaits the same.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NoReturn

import httpx

from agent_rl.config.secrets import redact_args
from agent_rl.engine.install import engine_env, engine_python
from agent_rl.sglang.speculative import speculative_args
from agent_rl.kernel.errors import EngineError
from agent_rl.kernel.priority import pass_priority_on
from agent_rl.kernel.processes import die_with_parent

if TYPE_CHECKING:
    from agent_rl.config import EngineConfig

# Flags SGLang 0.5.23 needs on a CPU-only host (see docs/engine.md).
CPU_ARGS = [
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    # Constrained decoding (the gateway's tool_choice "required" / a named function) runs on
    # CPU too: xgrammar builds its token masks on the host.
    "--grammar-backend", "xgrammar",
    "--disable-cuda-graph",
    "--skip-server-warmup",
    "--dtype", "float32",
    "--tp-size", "1",
    # An idle scheduler otherwise spins on its sockets and takes a core from the trainer.
    "--sleep-on-idle",
]  # fmt: skip
# SGLang refuses to start when host memory available after loading drops below
# (1 - fraction) x before: on CPU that drop includes every other process's allocations meanwhile,
# so 0.05 failed on a busy host (seen: 0.073 needed). The KV pool stays capped by
# CPU_MAX_TOTAL_TOKENS, so a larger fraction reserves nothing more.
CPU_MEM_FRACTION = 0.3
CPU_MAX_TOTAL_TOKENS = 16384
# Seconds between health probes while an engine starts: a probe before it listens costs ~0.2 ms
# of CPU here, and at 0.5 s the wait overshot the engine's readiness by 0.25 s on average.
HEALTH_POLL_S = 0.1


def detect_device() -> Literal["cpu", "cuda"]:
    """cuda when an NVIDIA GPU is visible to this machine, else cpu (the main venv's torch is a
    CPU build, so torch.cuda cannot tell)."""
    if shutil.which("nvidia-smi") and Path("/dev/nvidiactl").exists():
        return "cuda"
    return "cpu"


def free_port(host: str = "127.0.0.1") -> int:
    """A port free to listen on now, picked outside the kernel's ephemeral range.

    A port from `bind(0)` is one the kernel also hands to outgoing connections, and an engine
    binds its port only after loading (20 s on a loaded CPU): seen, an evaluation engine's bind
    failing with "address already in use" because a connection had taken its port meanwhile.
    Ports outside the range are never given to connections; another process picking the same
    one at random is left to the bind check here and the engine's own error."""
    low, high = _ephemeral_range()
    ports = [p for r0, r1 in ((10_000, low - 1), (high + 1, 65_535)) for p in range(r0, r1 + 1)]
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.choice(ports) if ports else 0  # 0: the range covers them all
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise EngineError(f"no free port to listen on at {host}: set engine.port")


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default otherwise)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32_768, 60_999


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _in_main_thread() -> bool:
    # PR_SET_PDEATHSIG fires when the *thread* that forked exits; a worker thread (anyio's
    # to_thread pool) may exit while the engine should live on, so only the main thread uses it.
    return sys.platform == "linux" and threading.current_thread() is threading.main_thread()


class EngineServer:
    """One SGLang server process; also a context manager (start on enter, stop on exit)."""

    def __init__(
        self,
        model: Path | str,
        *,
        venv: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        device: Literal["auto", "cpu", "cuda"] = "auto",
        moe_routing_replay: bool = False,
        log_dir: Path = Path("runs/logs"),
        log_path: Path | None = None,
        startup_timeout_s: float = 300.0,
        cpu_threads: int = 1,
        mem_fraction_static: float | None = None,
        max_total_tokens: int | None = None,
        max_running_requests: int | None = None,
        speculative_steps: int = 0,
        extra_args: list[str] | tuple[str, ...] = (),
    ) -> None:
        self.model = Path(model).expanduser().absolute()
        self.venv = Path(venv).expanduser()
        self.host = host
        self.port = port or free_port(host)
        self.device: Literal["cpu", "cuda"] = detect_device() if device == "auto" else device
        self.moe_routing_replay = moe_routing_replay
        self.log_path = log_path or Path(log_dir) / f"engine-{self.port}.log"
        self.startup_timeout_s = startup_timeout_s
        self.cpu_threads = cpu_threads
        self.mem_fraction_static = mem_fraction_static
        self.max_total_tokens = max_total_tokens
        self.max_running_requests = max_running_requests
        self.speculative_steps = speculative_steps  # 0: no speculative decoding
        self.extra_args = list(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def from_config(cls, cfg: EngineConfig, **overrides: object) -> EngineServer:
        """Build from the [engine] config section; keyword overrides win (e.g. from CLI flags)."""
        kwargs: dict[str, object] = dict(
            model=cfg.model,
            venv=cfg.venv,
            host=cfg.host,
            port=cfg.port,
            device=cfg.device,
            moe_routing_replay=cfg.moe_routing_replay,
            startup_timeout_s=cfg.startup_timeout_s,
            cpu_threads=cfg.cpu_threads,
            mem_fraction_static=cfg.mem_fraction_static,
            max_total_tokens=cfg.max_total_tokens,
            max_running_requests=cfg.max_running_requests,
            speculative_steps=cfg.speculative_steps if cfg.speculative else 0,
            extra_args=cfg.extra_args,
            log_dir=cfg.log_dir,
        )
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        if kwargs["model"] is None:
            raise EngineError("no model to serve: pass --model DIR or set engine.model")
        return cls(**kwargs)  # type: ignore[arg-type]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        """None while running (or not started); the exit status once the process has ended."""
        return self._proc.poll() if self._proc else None

    def command(self, python: Path | str) -> list[str]:
        cmd = [
            str(python), "-m", "sglang.launch_server",
            "--model-path", str(self.model),
            "--host", self.host,
            "--port", str(self.port),
            "--log-level", "info",
        ]  # fmt: skip
        mem, total = self.mem_fraction_static, self.max_total_tokens
        if self.device == "cpu":
            cmd += CPU_ARGS
            mem = mem or CPU_MEM_FRACTION
            total = total or CPU_MAX_TOTAL_TOKENS
        if mem is not None:
            cmd += ["--mem-fraction-static", str(mem)]
        if total is not None:
            cmd += ["--max-total-tokens", str(total)]
        if self.max_running_requests is not None:
            cmd += ["--max-running-requests", str(self.max_running_requests)]
        if self.moe_routing_replay:
            cmd.append("--enable-return-routed-experts")
        cmd += speculative_args(self.model, self.device, self.speculative_steps)
        return cmd + self.extra_args

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> EngineServer:
        """Launch and block until healthy (or raise EngineError, leaving nothing running)."""
        self.launch()
        try:
            self.wait_until_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    async def astart(self) -> EngineServer:
        """`start()` for an event loop: the health wait sleeps instead of blocking."""
        self.launch()
        try:
            await self.wait_until_healthy_async()
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self) -> EngineServer:
        """Check, then spawn the server and return at once (it becomes healthy later)."""
        if self._proc is not None and self._proc.poll() is None:
            raise EngineError(f"engine at {self.url} is already running (pid {self._proc.pid})")
        self._preflight()
        python = engine_python(self.venv)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            shown = " ".join(redact_args(self.command(python)))  # extra_args may hold a key
            log.write(f"--- agent-rl: {shown}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.command(python),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=engine_env(self.device, self.cpu_threads),
                start_new_session=True,  # its own process group: stop() reaches every child
                # SIGKILLed if this process dies (killed test runner, crashed `serve`): no orphan
                # engine keeps its port and 2 GB; SGLang ties its own children to it.
                preexec_fn=die_with_parent() if _in_main_thread() else None,
            )
        # Its session is a scheduling group of its own: niced as this process is (an
        # evaluation's engine takes only the CPU training leaves; agent_rl/kernel/priority.py).
        pass_priority_on(self._proc.pid)
        return self

    def _preflight(self) -> None:
        if not (self.model / "config.json").is_file():
            raise EngineError(
                f"{self.model} is not a model directory (no config.json): "
                f"make one with `agent-rl model init {self.model}`"
            )
        speculative_args(self.model, self.device, self.speculative_steps)  # refuses on CPU
        if _port_in_use(self.host, self.port):
            raise EngineError(
                f"port {self.port} on {self.host} is already in use: "
                "choose another with --port (engine.port), or stop what listens there"
            )

    def wait_until_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=10.0) as http:
            while not self._probe_healthy(http, deadline):
                time.sleep(HEALTH_POLL_S)

    async def wait_until_healthy_async(self) -> None:
        import anyio

        deadline = time.monotonic() + self.startup_timeout_s
        async with httpx.AsyncClient(timeout=10.0) as http:
            while True:
                self._raise_if_failed_start(deadline)
                try:
                    if (await http.get(self.url + "/health_generate")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # not listening yet
                await anyio.sleep(HEALTH_POLL_S)

    def _probe_healthy(self, http: httpx.Client, deadline: float) -> bool:
        self._raise_if_failed_start(deadline)
        try:
            return http.get(self.url + "/health_generate").status_code == 200
        except httpx.HTTPError:
            return False  # not listening yet

    def _raise_if_failed_start(self, deadline: float) -> None:
        if self.returncode is not None:
            raise EngineError(
                f"the engine exited with code {self.returncode} while starting: "
                f"{self.last_error()} (log: {self.log_path})"
            )
        if time.monotonic() > deadline:
            raise EngineError(
                f"the engine did not become healthy within {self.startup_timeout_s:.0f} s: "
                f"raise engine.startup_timeout_s or read its log {self.log_path}"
            )

    def check(self) -> None:
        """Raise EngineError if the engine process has exited (crashed or was killed)."""
        if self._proc is None:
            raise EngineError("the engine was never started")
        code = self._proc.poll()
        if code is not None:
            raise EngineError(
                f"the engine at {self.url} exited with code {code}: {self.last_error()} "
                f"(log: {self.log_path})"
            )

    async def watch(self, poll_s: float = 1.0) -> NoReturn:
        """Return only by raising EngineError when the engine dies; run it in a task group."""
        import anyio

        while True:
            self.check()
            await anyio.sleep(poll_s)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Stop the process group; return the exit code (None if it was never started)."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                proc.wait(10)
        # Children that outlived the main process (e.g. after a crash) go with the group; wait
        # until they are gone so their port and memory are free when stop() returns.
        self._signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        return proc.returncode

    async def astop(self, timeout_s: float = 30.0) -> int | None:
        """`stop()` for an event loop: SGLang takes seconds to shut down, so wait in a thread."""
        import anyio

        return await anyio.to_thread.run_sync(self.stop, timeout_s)

    def running(self) -> bool:
        """Whether any process of the engine's group is still alive."""
        return self._proc is not None and self._group_alive()

    def _group_alive(self) -> bool:
        assert self._proc is not None
        try:
            os.killpg(self._proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def _signal(self, sig: signal.Signals) -> None:
        assert self._proc is not None
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass

    def last_error(self) -> str:
        """The most telling line of the log: the last exception line, else the last line."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 64_000))
                lines = [
                    ln.strip()
                    for ln in f.read().decode(errors="replace").splitlines()
                    if ln.strip()
                ]
        except OSError:
            return "no log"
        for line in reversed(lines):
            if "Error" in line or "Exception" in line:
                return line[:300]
        return lines[-1][:300] if lines else "no output"

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
