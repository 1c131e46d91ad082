"""Sandbox overhead against the same work done without isolation, side by side in one run.

- warm: one Python tool call (`print(1)`) in a started sandbox, vs the same persistent worker
  (tools_sandbox/worker.py, same protocol, same host-side channel) run as a bare subprocess with
  no isolation at all. Target: <= 1.5x.
- cold: create a sandbox + one call + close it, vs a bare `python3 -c 'print(1)'` subprocess.
  Target: <= 15x.
- the same two ratios for the Docker backend (reported; skipped, as null, without an engine).
- verification: one `verify_in_sandbox` (write a file, run a verifier that prints a Reward) in
  a sandbox a tool call has used, as it is now (`verify_ms_after`: the sandbox restarted first,
  so nothing of the model's runs) and as it was before (`verify_ms_before`: the file written and
  the verifier run in the sandbox as the calls left it), on both backends.
Calls alternate between the two sides so that load from other processes hits both alike; the
ratios are of medians.
Last line: RESULT {"warm_ratio", "cold_ratio", "docker_warm_ratio", "docker_cold_ratio",
"verify_ms_before", "verify_ms_after", "docker_verify_ms_before", "docker_verify_ms_after"}.
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
from agent_rl.sdk.rewards import Reward, verify_in_sandbox  # noqa: E402
from agent_rl.sdk.sandbox import SandboxBackend, SandboxSpec  # noqa: E402
from tools_sandbox.factory import make_backend  # noqa: E402
from tools_sandbox.session import Channel, worker_config  # noqa: E402

CODE = "print(1)"
VERIFIER = "import json\nprint(json.dumps({'value': float(open('expected.txt').read() == '1')}))"
FILES = {"expected.txt": "1"}
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


async def measure_verify(backend: SandboxBackend, n: int) -> tuple[float, float]:
    """Median ms of one verification as it is now (restart first) and as it was before (no
    restart), alternating, each after a model's call (not timed) in the same sandbox."""
    async with await backend.create(SPEC) as sb:

        async def now() -> None:
            reward = await verify_in_sandbox(sb, VERIFIER, files=FILES)
            assert reward.value == 1.0, reward

        async def before() -> None:  # verify_in_sandbox before the restart was added
            for path, text in FILES.items():
                await sb.write_file(path, text)
            r = await sb.run_python(VERIFIER)
            assert Reward.model_validate_json(r.stdout.splitlines()[-1]).value == 1.0, r

        times: dict[str, list[float]] = {"now": [], "before": []}
        for i in range(n + 1):  # the first round warms up
            for name, verify in (("now", now), ("before", before)):
                assert (await sb.run_python(CODE, persistent=True)).ok  # the model's call
                t = await timed(verify)
                if i:
                    times[name].append(t * 1e3)
    after_ms, before_ms = statistics.median(times["now"]), statistics.median(times["before"])
    print(f"{backend.name:6s} verification {after_ms:7.2f} ms (sandbox restarted first) vs "
          f"{before_ms:7.2f} ms before")
    return before_ms, after_ms


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
            before, after = await measure_verify(backend, args.verify)
            await backend.aclose()
        prefix = "" if name == "bwrap" else "docker_"
        result[f"{prefix}warm_ratio"] = None if warm is None else round(warm, 2)
        result[f"{prefix}cold_ratio"] = None if cold is None else round(cold, 2)
        result[f"{prefix}verify_ms_before"] = None if warm is None else round(before, 1)
        result[f"{prefix}verify_ms_after"] = None if warm is None else round(after, 1)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", type=int, default=200, help="warm calls per side")
    parser.add_argument("--cold", type=int, default=30, help="cold bwrap sandboxes per side")
    parser.add_argument("--docker-cold", type=int, default=10, help="cold containers per side")
    parser.add_argument("--verify", type=int, default=20, help="verifications per side")
    anyio.run(main, parser.parse_args())
