"""The abuse suite, part two: attacks on the integrity of results, against every backend.

A policy whose reward is computed in its sandbox will look for ways to write that reward itself.
These attacks try: copying the worker's descriptors to answer calls the host has not made yet
(a verifier's among them), a thread of the persistent session that keeps running after its
call, stopping the worker, input that kills the worker (losing the session and failing the
episode as if the infrastructure had), a value too large to answer. Each must be contained, and
once the sandbox is closed nothing of it may be left. Where an attack needs a way into the
worker's channel that tool code no longer has, the test itself plays the attacker from the host
(root may copy any process's descriptors): that stands for any way in not yet found.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import struct
import textwrap

import anyio
import pytest

from agent_rl.kernel.errors import SandboxError, ToolError
from agent_rl.sdk.rewards import verify_in_sandbox
from agent_rl.sdk.sandbox import SandboxBackend, SandboxSpec

from .conftest import small_limits
from .helpers import leftovers, real_uid, worker_pid

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
SPEC = SandboxSpec(limits=small_limits(wall_s=3.0, cpu_s=3))
HONEST_VERIFIER = "import json\nprint(json.dumps({'value': 0.0}))"
CHANNEL_FD = 3
"""The worker's answer channel (a pipe or its socket): the first descriptor it opens."""


def forged_answer(stdout: str) -> bytes:
    """A frame that passes for any answer of the old worker's, a call's or a file operation's."""
    answer = {"ok": True, "exit_code": 0, "stdout": base64.b64encode(stdout.encode()).decode(),
              "stderr": "", "value": None, "timed_out": False, "truncated": False, "oom": False}
    data = json.dumps(answer).encode()
    return struct.pack(">I", len(data)) + data


FORGE = textwrap.dedent("""
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    frames = bytes.fromhex({frames!r})
    pidfd = libc.syscall(434, os.getppid(), 0)  # pidfd_open(the worker)
    for fd in range(64):
        copy = libc.syscall(438, pidfd, fd, 0)  # pidfd_getfd: a copy of the worker's fd
        if copy >= 0:
            try:
                os.write(copy, frames)
                print('FORGED through fd', fd)
            except OSError:
                pass
    print('tried')
""")


def forge_code(where: str) -> str:
    """Tool code that answers the host's next calls itself with `{"value": 1.0}`: from a call,
    from the session, or from a thread the session leaves running after its call."""
    code = FORGE.format(frames=(forged_answer('{"value": 1.0}\n') * 8).hex())
    if where == "session_thread":
        code = ("import threading, time\n\ndef later():\n    time.sleep(0.2)\n"
                + textwrap.indent(code, "    ")
                + "\nthreading.Thread(target=later, daemon=True).start()\n")
    return code


def host_copy_of_fd(pid: int, fd: int) -> int:
    """pidfd_getfd as root on the host: what tool code could do if it had the means."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        copy = libc.syscall(438, pidfd, fd, 0)
        if copy < 0:
            raise OSError(ctypes.get_errno(), f"pidfd_getfd({pid}, {fd})")
        return copy
    finally:
        os.close(pidfd)


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


def tool_processes(sb: object) -> dict[int, str]:
    """Host pid -> state of every process running as the sandbox's tool code."""
    uid = getattr(sb, "tool_uid", getattr(sb, "uid", None))
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and real_uid(name) == uid:
            try:
                with open(f"/proc/{name}/stat") as f:
                    found[int(name)] = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
    return found


REACH = textwrap.dedent("""
    import ctypes, os, signal
    libc = ctypes.CDLL(None, use_errno=True)
    worker = os.getppid()
    pidfd = libc.syscall(434, worker, 0)
    if any(libc.syscall(438, pidfd, fd, 0) >= 0 for fd in range(16)):
        print('REACHED its descriptors (pidfd_getfd)')
    for what in ('fd', 'mem', 'environ'):
        path = f'/proc/{worker}/{what}'
        try:
            os.listdir(path) if what == 'fd' else open(path, 'rb')
            print('REACHED /proc/<worker>/' + what)
        except OSError:
            pass
    if libc.ptrace(0x4206, worker, None, None) == 0:  # PTRACE_SEIZE
        print('REACHED it by ptrace')
    buf = ctypes.create_string_buffer(8)
    iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)
    if libc.process_vm_readv(worker, iov, 1, iov, 1, 0) >= 0:
        print('REACHED its memory (process_vm_readv)')
    for sig in (signal.SIGSTOP, signal.SIGCONT):
        try:
            os.kill(worker, sig)
            print('REACHED it with signal', sig)
        except OSError:
            pass
    print('tried')
""")


@pytest.mark.parametrize("persistent", [False, True])
async def test_tool_code_cannot_reach_the_worker(backend: SandboxBackend, persistent: bool) -> None:
    """Its descriptors, its memory and its process are out of tool code's reach: seccomp, the
    worker not dumpable, tool code under another uid."""
    async with await backend.create(SPEC) as sb:
        r = await sb.run_python(REACH, persistent=persistent)
        assert r.ok and r.stdout == "tried\n", r
    assert leftovers(backend) == []


@pytest.mark.parametrize("where", ["call", "session", "session_thread"])
async def test_tool_code_cannot_forge_a_verifiers_reward(backend: SandboxBackend,
                                                         where: str) -> None:
    async with await backend.create(SPEC) as sb:
        r = await sb.run_python(forge_code(where), persistent=where != "call")
        assert r.ok and "FORGED" not in r.stdout, r
        await anyio.sleep(0.5)  # the thread's moment, had it one
        reward = await verify_in_sandbox(sb, HONEST_VERIFIER, files={"tests.txt": "hidden"})
        assert reward.value == 0.0, reward
        r = await sb.run_python("print('next')", persistent=where != "call")
        assert "next\n" in r.stdout and "FORGED" not in r.stdout, r  # (the thread may print)
    assert leftovers(backend) == []


async def test_an_answer_without_its_nonce_is_a_protocol_violation(
    backend: SandboxBackend,
) -> None:
    """A forged answer waiting in the channel fails the call as SandboxError (never passes for
    the call's result) and kills the sandbox; the next call gets a fresh one."""
    async with await backend.create(SPEC) as sb:
        assert (await sb.run_python("print('warm')")).ok
        pid = worker_pid(sb)
        channel = host_copy_of_fd(pid, CHANNEL_FD)
        assert os.readlink(f"/proc/self/fd/{channel}").startswith(("pipe:", "socket:"))
        os.write(channel, forged_answer("FORGED\n"))
        os.close(channel)
        with pytest.raises(SandboxError, match="protocol"):
            await sb.run_python("print('honest')")
        with anyio.fail_after(5):
            while not gone(pid):
                await anyio.sleep(0.05)
        r = await sb.run_python("print('next')")
        assert r.stdout == "next\n" and worker_pid(sb) != pid, r
    assert leftovers(backend) == []


async def test_a_session_thread_runs_only_inside_persistent_calls(backend: SandboxBackend) -> None:
    """Threads live on with the session, but the session is stopped between its calls: a thread
    cannot write files, start processes or stop the worker while the host reads or writes files
    or runs any other call (a verifier, say)."""
    code = textwrap.dedent("""
        import os, signal, subprocess, threading, time
        def busy():
            while True:
                with open('ticks', 'a') as f:
                    f.write('.')
                try:
                    os.kill(os.getppid(), signal.SIGSTOP)
                except OSError:
                    pass
                subprocess.Popen(['sleep', '100'])
                time.sleep(0.02)
        threading.Thread(target=busy, daemon=True).start()
        time.sleep(0.1)""")
    async with await backend.create(SPEC) as sb:
        r = await sb.run_python(code, persistent=True)
        assert r.ok and not r.restarted, r
        ticks = len(await sb.read_file("ticks"))
        count = "import time\ntime.sleep(0.2)\nprint(len(open('ticks').read()))"
        for _ in range(3):
            await anyio.sleep(0.2)
            assert len(await sb.read_file("ticks")) == ticks  # not between calls
            r = await sb.run_python(count)
            assert r.ok and not r.restarted and int(r.stdout) == ticks, r  # nor during others
        procs = tool_processes(sb)  # the stopped session, and nothing else (but the zombies
        assert [s for s in procs.values() if s != "Z"] == ["T"], procs  # it reaps when it runs)
        r = await sb.run_python("import time; time.sleep(0.2)", persistent=True)
        assert r.ok and not r.restarted and r.duration_s < 1.5, r  # the worker never stopped
        assert len(await sb.read_file("ticks")) > ticks  # the thread runs in the session's calls
    assert leftovers(backend) == []


async def test_unencodable_input_is_the_callers_mistake(backend: SandboxBackend) -> None:
    """A NUL byte or a lone surrogate in a path, an argument, code or content: ToolError, on
    the host, before the sandbox sees it; the session survives."""
    async with await backend.create(SPEC) as sb:
        assert (await sb.run_python("x = 42", persistent=True)).ok
        for path in ("a\0b", "\ud800", "dir/\udcff.txt"):
            with pytest.raises(ToolError):
                await sb.read_file(path)
            with pytest.raises(ToolError):
                await sb.write_file(path, "x")
        with pytest.raises(ToolError, match="surrogate"):
            await sb.write_file("ok.txt", "\ud800")
        for argv in (["echo", "a\0b"], ["echo", "\ud800"]):
            with pytest.raises(ToolError):
                await sb.exec(argv)
        with pytest.raises(ToolError):
            await sb.run_python("'\ud800'", persistent=True)
        with pytest.raises(ToolError):
            await sb.run_python("print(1)", stdin="\ud800")
        r = await sb.run_python("x", persistent=True)
        assert r.value == "42" and not r.restarted, r
    assert leftovers(backend) == []


async def test_the_worker_never_dies_of_input(backend: SandboxBackend) -> None:
    """What the host's checks stop, sent to the worker anyway (white-box: the sandbox's own
    request path, past the checks): an error for each, the worker and the session kept."""
    async with await backend.create(SPEC) as sb:
        assert (await sb.run_python("x = 42", persistent=True)).ok
        pid = worker_pid(sb)
        file_op = sb._file_op  # type: ignore[attr-defined]
        for path in ("a\0b", "\ud800"):
            with pytest.raises(ToolError):
                await file_op({"op": "read", "path": path, "max": 10}, 4096)
            with pytest.raises(ToolError):
                await file_op({"op": "write", "path": path, "data": ""}, 4096)
        for req in ({"op": "py", "code": "'\ud800'", "persistent": True},
                    {"op": "py", "code": 7, "persistent": True}, {"op": "exec"},
                    {"op": "exec", "argv": ["ls"], "stdin": "not base64!"}, {"op": "nonsense"}):
            with pytest.raises(SandboxError, match="could not serve"):
                await sb._call(req, 1.0)  # type: ignore[attr-defined]
        r = await sb.run_python("x", persistent=True)
        assert r.value == "42" and not r.restarted and worker_pid(sb) == pid, r
        await sb.run_python("os = __import__('os'); os.mkfifo('fifo')", persistent=True)
        with anyio.fail_after(2):  # a FIFO in the path neither blocks a file operation ...
            with pytest.raises(ToolError, match="regular file"):
                await sb.read_file("fifo")
            with pytest.raises(ToolError):
                await sb.write_file("fifo", "x")
        r = await sb.run_python("x", persistent=True)  # ... nor costs the session
        assert r.value == "42" and not r.restarted, r
    assert leftovers(backend) == []


@pytest.mark.parametrize("persistent", [True, False])
async def test_a_huge_value_is_cut_to_fit_the_answer(backend: SandboxBackend,
                                                      persistent: bool) -> None:
    """600,000 non-ASCII characters escape to 3.6 MB of JSON: the value is cut to its longest
    prefix whose JSON fits in the output cap, the call answers at once, the session lives on."""
    async with await backend.create(SPEC) as sb:
        assert (await sb.run_python("x = 42", persistent=True)).ok
        cap = SPEC.limits.output_bytes
        for value, escaped in (("'é' * 600_000", 6), ("'😀' * 600_000", 12),
                               ("type('V', (), {'__repr__': lambda v: '\\ud800' * 600_000})()", 6)):
            r = await sb.run_python(value, persistent=persistent)
            assert r.ok and not r.restarted and not r.timed_out and r.value, r
            assert cap // escaped - 2 <= len(r.value) <= cap // escaped + 1, len(r.value)
            r.value.encode()  # valid Unicode on the host, even from a lone surrogate's repr
        r = await sb.run_python("x", persistent=True)
        assert r.value == "42" and not r.restarted, r
    assert leftovers(backend) == []
