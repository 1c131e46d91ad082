"""The Sandbox protocol, against every backend: calls, files, REPL state, failures as data."""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from agent_rl.kernel.errors import SandboxError, ToolError
from agent_rl.sdk.sandbox import Sandbox, SandboxBackend, SandboxSpec

from .conftest import small_limits
from .helpers import leftovers, worker_pid

pytestmark = pytest.mark.anyio
SPEC = SandboxSpec(limits=small_limits(), env=(("GREETING", "hello"),))


async def test_exec_python_and_value(backend: SandboxBackend) -> None:
    async with await backend.create(SPEC) as sb:
        assert isinstance(sb, Sandbox)
        r = await sb.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
        assert (r.exit_code, r.stdout, r.stderr, r.ok) == (3, "out\n", "err\n", False)
        r = await sb.run_python("import os\nprint(os.environ['GREETING'])\n6 * 7")
        assert r.ok and r.stdout == "hello\n" and r.value == "42"
        r = await sb.run_python("print(input()[::-1])", stdin="abc\n")
        assert r.stdout == "cba\n"
        r = await sb.run_python("raise ValueError('boom')")
        assert r.exit_code == 1 and "ValueError: boom" in r.stderr and "worker" not in r.stderr
        r = await sb.exec(["no-such-command"])
        assert r.exit_code != 0
        r = await sb.run_python("import sys; sys.exit(5)")
        assert r.exit_code == 5


async def test_files_stay_in_the_work_dir(backend: SandboxBackend) -> None:
    async with await backend.create(SPEC) as sb:
        await sb.write_file("dir/a.txt", "data")
        assert await sb.read_file("/work/dir/a.txt") == b"data"
        r = await sb.exec(["cat", "dir/a.txt"])
        assert r.stdout == "data"
        await sb.run_python("import os; os.symlink('/etc/hostname', 'link')")
        with pytest.raises(ToolError):
            await sb.read_file("link")  # the worker resolves symlinks and refuses to leave /work
        for bad in ("../x", "/etc/passwd", "/work"):
            with pytest.raises(ToolError):
                await sb.read_file(bad)
        with pytest.raises(ToolError):
            await sb.read_file("missing.txt")
        await sb.write_file("big", b"x" * 5000)
        assert len(await sb.read_file("big", max_bytes=100)) == 100


async def test_repl_state_persists_until_killed(backend: SandboxBackend) -> None:
    async with await backend.create(SPEC) as sb:
        assert (await sb.run_python("x = 41", persistent=True)).ok
        r = await sb.run_python("x += 1\nx", persistent=True)
        assert r.value == "42"
        r = await sb.run_python("print(x)")  # a fresh interpreter does not see REPL globals
        assert r.exit_code == 1 and "NameError" in r.stderr
        r = await sb.run_python("import time; time.sleep(30)", persistent=True, timeout=1)
        assert r.timed_out
        r = await sb.run_python("print('x' in globals())", persistent=True)
        assert r.stdout == "False\n"  # the REPL was killed with the call, and started afresh


async def test_failures_are_results_and_the_next_call_works(backend: SandboxBackend) -> None:
    async with await backend.create(SPEC) as sb:
        r = await sb.run_python("while True: pass", timeout=1)
        assert r.timed_out and not r.ok and r.duration_s < 4
        r = await sb.run_python("import sys\nwhile True: sys.stdout.write('y' * 4096)")
        assert r.truncated and len(r.stdout) <= SPEC.limits.output_bytes
        r = await sb.run_python("import os, signal; os.kill(os.getppid(), signal.SIGKILL)")
        assert "PermissionError" in r.stderr and not r.restarted  # tool code is not its uid
        os.kill(worker_pid(sb), signal.SIGKILL)  # the host can kill it: then it is respawned
        r = await sb.run_python("print(1)")
        assert r.restarted and r.exit_code is None
        await sb.write_file("kept.txt", "still here")
        r = await sb.run_python("import os, signal; os.kill(-1, signal.SIGKILL)")
        r = await sb.run_python("print(open('kept.txt').read())")
        assert r.ok and r.stdout == "still here\n"  # the work dir survives a respawn


async def test_timeout_cannot_exceed_the_limit(backend: SandboxBackend) -> None:
    spec = SandboxSpec(limits=small_limits(wall_s=1.0))
    async with await backend.create(spec) as sb:
        r = await sb.run_python("import time; time.sleep(10)", timeout=100)
        assert r.timed_out and r.duration_s < 5


async def test_close_is_idempotent_and_leaves_nothing(backend: SandboxBackend) -> None:
    sb = await backend.create(SPEC)
    await sb.run_python("import subprocess; subprocess.Popen(['sleep', '100'])")
    assert backend.live() == 1
    await sb.close()
    await sb.close()
    assert backend.live() == 0
    with pytest.raises(SandboxError):
        await sb.run_python("print(1)")
    assert leftovers(backend) == []


async def test_sandboxes_are_separate(backend: SandboxBackend) -> None:
    async with await backend.create(SPEC) as a, await backend.create(SPEC) as b:
        await a.write_file("secret.txt", "only a")
        r = await b.run_python("import os; print(os.path.exists('secret.txt'))")
        assert r.stdout == "False\n"


@pytest.mark.slow
async def test_64_concurrent_sandboxes(backend: SandboxBackend) -> None:
    """64 sandboxes alive at once on 2 cores, each completing a short Python call (the default
    backend; the fallback is checked at 16, Docker at 8 through the pool test)."""
    if backend.name == "docker":
        pytest.skip("covered for Docker by the pool test at a smaller scale (container start-up)")
    n = 64 if backend.name == "bwrap" else 16
    results: list[str] = []

    async def one(i: int) -> None:
        async with await backend.create(SPEC) as sb:
            r = await sb.run_python(f"print(sum(range({i} * 1000)))")
            assert r.ok, r
            results.append(r.stdout)

    with anyio.fail_after(150):
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
    assert sorted(results) == sorted(f"{sum(range(i * 1000))}\n" for i in range(n))
    assert leftovers(backend) == []


async def test_cancelled_call_does_not_answer_the_next(backend: SandboxBackend) -> None:
    async with await backend.create(SPEC) as sb:
        with anyio.move_on_after(0.5):
            await sb.run_python("import time; time.sleep(2); print('late')")
        r = await sb.run_python("print('next')")
        assert r.stdout == "next\n", r


async def test_tool_code_inherits_no_worker_channel(backend: SandboxBackend) -> None:
    """Only stdin/stdout/stderr (and, for Python, its result pipe) reach tool code, so it cannot
    write to the worker's channel to the server."""
    count = "import os; print(len(os.listdir('/proc/self/fd')))"  # listdir holds one fd itself
    async with await backend.create(SPEC) as sb:
        assert (await sb.exec(["python3", "-c", count])).stdout == "4\n"
        assert (await sb.run_python(count)).stdout == "5\n"
        await sb.run_python("import subprocess; subprocess.Popen(['sleep', '100'])",
                            persistent=True)
        r = await sb.run_python("print('fast')", persistent=True)
        assert r.stdout == "fast\n" and r.duration_s < 1.0, r  # the killed child is no obstacle


async def test_calls_answer_as_soon_as_they_end(backend: SandboxBackend) -> None:
    """A call whose output closes just before its result arrives must not sit out its timeout.

    The worker once looked twice per round for the result; when it arrived between the looks,
    the round waited on nothing until the deadline (about 1 call in 20 took the full timeout).
    Hundreds of short calls make that race show up in every run."""
    async with await backend.create(SPEC) as sb:
        slow = []
        for i in range(200):
            r = await sb.run_python("print('fast')", persistent=True, timeout=2.0)
            assert r.stdout == "fast\n", r
            slow += [("persistent", i, r.duration_s)] if r.duration_s > 1.0 else []
        for i in range(100):
            r = await sb.exec(["true"], timeout=2.0)
            assert r.exit_code == 0, r
            slow += [("exec", i, r.duration_s)] if r.duration_s > 1.0 else []
        assert not slow, slow
