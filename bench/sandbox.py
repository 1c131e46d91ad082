"""Sandbox overhead against the same work done without isolation, side by side in one run.

- warm: one Python tool call (`print(1)`) in a started sandbox, vs the same persistent worker
  (tools_sandbox/worker.py, same protocol, same host-side channel) run as a bare subprocess with
  no isolation at all. Target: <= 1.5x.
- cold: create a sandbox + one call + close it, vs a bare `python3 -c 'print(1)'` subprocess.
  Target: <= 15x.
- the same two ratios for the Docker backend (reported; skipped, as null, without an engine).
Calls alternate between the two sides so that load from other processes hits both alike; the
ratios are of medians.
Last line: RESULT {"warm_ratio", "cold_ratio", "docker_warm_ratio", "docker_cold_ratio"}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl.config import SandboxConfig, SandboxLimits  # noqa: E402
from agent_rl.kernel.errors import SandboxError  # noqa: E402
from agent_rl.sdk.sandbox import SandboxBackend, SandboxSpec  # noqa: E402
from tools_sandbox.factory import make_backend  # noqa: E402
from tools_sandbox.session import Channel, worker_config  # noqa: E402

CODE = "print(1)"
SPEC = SandboxSpec(limits=SandboxLimits(wall_s=30))
PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "python3"
WORKER = Path(__file__).resolve().parents[1] / "tools_sandbox" / "worker.py"


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    t = time.perf_counter()
    await fn()
    return time.perf_counter() - t


async def side_by_side(a: Callable[[], Awaitable[object]], b: Callable[[], Awaitable[object]],
                       n: int) -> tuple[float, float]:
    """Medians of `a` and `b`, alternating, after one warm-up each."""
    await a()
    await b()
    ta, tb = [], []
    for _ in range(n):
        ta.append(await timed(a))
        tb.append(await timed(b))
    return statistics.median(ta), statistics.median(tb)


async def bare_worker() -> tuple[Channel, anyio.abc.Process]:
    conf = worker_config(SPEC, "/tmp", sweep=False)
    proc = await anyio.open_process([PYTHON, "-I", str(WORKER), json.dumps(conf)])
    assert proc.stdin is not None and proc.stdout is not None
    return Channel(proc.stdin, proc.stdout), proc


async def measure(backend: SandboxBackend, n_warm: int, n_cold: int) -> tuple[float, float]:
    chan, proc = await bare_worker()
    async with await backend.create(SPEC) as sb:
        async def sandboxed() -> None:
            r = await sb.run_python(CODE)
            assert r.stdout == "1\n", r

        async def bare() -> None:
            r = await chan.request({"op": "py", "code": CODE, "timeout": 30}, 1 << 22)
            assert r["exit_code"] == 0, r

        warm_sb, warm_bare = await side_by_side(sandboxed, bare, n_warm)
    proc.kill()
    await proc.wait()
    await proc.aclose()

    async def cold() -> None:
        async with await backend.create(SPEC) as sb:
            r = await sb.run_python(CODE)
            assert r.stdout == "1\n", r

    async def bare_process() -> None:
        r = await anyio.run_process([PYTHON, "-c", CODE])
        assert r.stdout == b"1\n"

    cold_sb, cold_bare = await side_by_side(cold, bare_process, n_cold)
    print(f"{backend.name:6s} warm call   {warm_sb * 1e3:7.2f} ms  vs bare worker      "
          f"{warm_bare * 1e3:7.2f} ms  ratio {warm_sb / warm_bare:5.2f}")
    print(f"{backend.name:6s} cold c+c+d  {cold_sb * 1e3:7.2f} ms  vs bare subprocess  "
          f"{cold_bare * 1e3:7.2f} ms  ratio {cold_sb / cold_bare:5.2f}")
    return warm_sb / warm_bare, cold_sb / cold_bare


async def main(args: argparse.Namespace) -> None:
    config = SandboxConfig(state_dir=Path("/tmp/agent-rl-bench-sandboxes"),
                           cgroup_parent="agent-rl-bench")
    result: dict[str, float | None] = {}
    for name, n_warm, n_cold in (("bwrap", args.warm, args.cold),
                                 ("docker", args.warm, args.docker_cold)):
        try:
            backend = make_backend(config.model_copy(update={"backend": name}))
        except SandboxError as e:
            print(f"{name}: skipped ({e})")
            warm = cold = None
        else:
            await backend.reap()
            warm, cold = await measure(backend, n_warm, n_cold)
            await backend.aclose()
        prefix = "" if name == "bwrap" else "docker_"
        result[f"{prefix}warm_ratio"] = None if warm is None else round(warm, 2)
        result[f"{prefix}cold_ratio"] = None if cold is None else round(cold, 2)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", type=int, default=200, help="warm calls per side")
    parser.add_argument("--cold", type=int, default=30, help="cold bwrap sandboxes per side")
    parser.add_argument("--docker-cold", type=int, default=10, help="cold containers per side")
    anyio.run(main, parser.parse_args())
