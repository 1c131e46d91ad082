"""The persistent worker that runs inside every sandbox (stdlib and ctypes only, Python >= 3.9).

One worker per sandbox serves calls over a byte stream (its stdin/stdout, or a unix socket it
connects to), so a call pays a fork, not a sandbox and interpreter start-up. Framing: a 4-byte
big-endian length, then JSON; bytes travel base64-encoded. Every request carries a `nonce` that
its answer repeats, so the host can tell answers to its requests from anything else. Requests:

  {"op": "ping"}
  {"op": "exec", "argv": [...], "stdin": b64, "timeout": s}
  {"op": "py", "code": str, "stdin": b64, "timeout": s, "persistent": bool}
  {"op": "read", "path": rel, "max": n}      {"op": "write", "path": rel, "data": b64}
  {"op": "verify", "code": str | "argv": [...], "files": {rel: b64}, "stdin": b64, "timeout": s}

Each call runs in a forked child in its own process group with per-call rlimits, its output is
read up to `cap` bytes, and past the deadline or the cap the group is killed. When a call ends,
every other process of tool code's uid (double forks, setsid daemons, a zombie leader whose
threads run on) is killed too, so a call leaves nothing running. A call that cannot start for
want of processes, pipes or memory (tool code exhausted them) gets the error "resources", for
which the host restarts the sandbox (verifiers, too, run only after a restart, never beside
tool code). `persistent` Python runs in a long-lived session child whose globals survive across
calls until one of them has to be killed. Between its calls the session is
stopped (SIGSTOP): threads it started live on, but run only while a persistent call runs, never
during another call or a file operation.

A verifier ("verify") runs under the worker's own uid as real, effective and saved uid, so no
process of tool code's may signal, trace, /proc-open or renice it; it writes its files itself
(mode 0600), and runs the model's code through a runner under tool code's ids that it forked
before taking its own (`judge_setup`, `tool_runner`, `run_as_tool`).

Tool code must not be able to impersonate the worker. Where the backend provides two ids
(`ids`), the worker keeps its own as real and saved ids and holds tool code's as effective ids:
it may signal tool code and use its files, while tool code may neither signal nor trace it. It
holds no capabilities and is not dumpable (so nobody without CAP_SYS_PTRACE can reach its
descriptors or memory; the session and Python calls are not dumpable either), and it closes its
channels in every child. Input never kills it: a request it cannot serve gets an error answer.
Tool code, whose uid is the worker's effective one, can renice it; the host undoes that before
each request. The host still bounds every answer, checks its nonce and respawns the sandbox
when the worker misbehaves.
"""

from __future__ import annotations

import ast
import base64
import ctypes
import json
import linecache
import os
import resource
import select
import signal
import socket
import stat
import struct
import sys
import threading
import time
import traceback

DRAIN_S = 0.05  # how long output is still read after a call's main process has exited
FREEZE_S = 1.0  # how long the session may take to stop after a call before it is killed instead
CONF: dict = {}  # set from argv: cap, work, cpu_s, nofile, fsize, as_bytes, nproc, env, sweep,
#                  ids ({"worker": [uid, gid], "tool": [uid, gid]}), seccomp (a BPF file to load)
PRIVATE_FDS: list[int] = []  # the protocol stream, the session's socket and pidfd: closed in
#                              every call's child

PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 4, 22, 38, 47
PR_CAP_AMBIENT_CLEAR_ALL, SECCOMP_MODE_FILTER = 4, 2
LIBC = ctypes.CDLL(None, use_errno=True)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> None:
    args = [ctypes.c_ulong(a) for a in (arg2, arg3, 0, 0)]
    if LIBC.prctl(ctypes.c_int(option), *args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def become() -> None:
    """The worker's identity, taken before it serves: its ids, no capabilities, not dumpable,
    no new privileges, and the seccomp filter where the backend has the worker load it."""
    ids = CONF.get("ids")
    if ids:
        (wuid, wgid), (tuid, tgid) = ids["worker"], ids["tool"]
        if os.getgroups():
            os.setgroups([])
        # (exec makes the saved ids the effective ones: set them back to the worker's, or tool
        # code, with its effective uid equal to our saved one, could signal us)
        if os.getresgid() != (wgid, tgid, wgid):
            os.setresgid(wgid, tgid, wgid)
        if os.getresuid() != (wuid, tuid, wuid):
            os.setresuid(wuid, tuid, wuid)
    try:
        prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    except OSError:
        pass  # a kernel without ambient capabilities has none to clear
    if LIBC.capset(ctypes.byref(_CapHeader(0x20080522, 0)), (_CapData * 2)()) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    with open("/proc/self/status") as f:
        held = [line.split()[0] for line in f
                if line.startswith(("CapPrm", "CapEff", "CapAmb")) and int(line.split()[1], 16)]
    if held:
        raise OSError(f"capabilities survived the drop: {held}")
    prctl(PR_SET_DUMPABLE, 0)
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    if CONF.get("seccomp"):
        with open(CONF["seccomp"], "rb") as f:
            code = f.read()
        buf = ctypes.create_string_buffer(code, len(code))
        prog = _Fprog(len(code) // 8, ctypes.addressof(buf))
        prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog))


def tool_ids() -> tuple[int, int]:
    ids = CONF.get("ids")
    return tuple(ids["tool"]) if ids else (os.getuid(), os.getgid())  # type: ignore[return-value]


def read_msg(f):
    head = f.read(4)
    if len(head) < 4:
        return None
    return json.loads(f.read(struct.unpack(">I", head)[0]))


def write_msg(f, obj) -> None:
    data = json.dumps(obj).encode()
    f.write(frame(data))
    f.flush()


def frame(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def recv_frame(sock: socket.socket, first: bytes, limit: int = 1 << 31) -> bytes:
    """The rest of a length-prefixed frame whose first bytes were already received."""
    buf = bytearray(first)
    while len(buf) < 4 or len(buf) < 4 + struct.unpack(">I", bytes(buf[:4]))[0]:
        if len(buf) >= 4 and struct.unpack(">I", bytes(buf[:4]))[0] > limit:
            raise EOFError("frame larger than allowed")
        chunk = sock.recv(65536)
        if not chunk:
            raise EOFError("session socket closed")
        buf += chunk
    return bytes(buf[4:])


def child_setup() -> None:
    """A call's child (or the session) before tool code runs: the worker's channels closed, a
    process group and session of its own, tool code's ids, per-call limits (the worker itself
    is never capped), and not dumpable, so no other process of tool code can reach its memory."""
    for fd in PRIVATE_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # the worker ignores it; tool code should not
    os.setsid()  # a process group, and a session: SIGCONT is allowed within one, whatever the uid
    # Be the first victim of the OOM killer, so the worker survives a memory hog. /proc/self is
    # root's while not dumpable: it is made writable for this, and only while the real and
    # saved ids are still the worker's (tool code's uid can reach no process holding them),
    # never after the change to tool code's ids.
    prctl(PR_SET_DUMPABLE, 1)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    prctl(PR_SET_DUMPABLE, 0)
    if CONF.get("ids"):
        uid, gid = tool_ids()
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)  # (not dumpable still; exec makes a program dumpable again)
    limits = [(resource.RLIMIT_CPU, CONF["cpu_s"]), (resource.RLIMIT_NOFILE, CONF["nofile"]),
              (resource.RLIMIT_FSIZE, CONF["fsize"]), (resource.RLIMIT_CORE, 0)]
    if CONF.get("as_bytes"):  # the rlimit backend has no cgroups: per-process caps instead
        limits += [(resource.RLIMIT_AS, CONF["as_bytes"]), (resource.RLIMIT_NPROC, CONF["nproc"])]
    for res, value in limits:
        resource.setrlimit(res, (value, value))
    os.chdir(CONF["work"])


def oom_count() -> int:
    """OOM kills of this sandbox's memory cgroup, where it is visible from inside (Docker)."""
    for path, key in (("/sys/fs/cgroup/memory.events", "oom_kill"),
                      ("/sys/fs/cgroup/memory/memory.oom_control", "oom_kill")):
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith(key + " "):
                        return int(line.split()[1])
        except OSError:
            continue
    return 0


def proc_state(pid: str) -> tuple[int, str] | None:
    """Real uid and state letter of a process; None once it is gone. (The owner of /proc/<pid>
    is its effective uid: tool code's for the worker itself.)"""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return None
    state = "?"
    for line in text.splitlines():
        if line.startswith("State:"):
            state = line.split()[1]
        elif line.startswith("Uid:"):
            return int(line.split()[1]), state
    return None


def live_threads(pid: str) -> bool:
    """A process has a thread that is not a zombie (its leader may be one)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return any((proc_state(f"{pid}/task/{tid}") or (0, "Z"))[1] not in "ZX" for tid in tids)


def kill_strays(keep: set[int]) -> None:
    """Kill every process of tool code's uid except `keep`, until none is left (fork bombs
    refill)."""
    uid = tool_ids()[0]
    if uid == 0 or not CONF.get("sweep", True):  # never sweep the server's own uid or root's
        return
    keep = keep | {1, os.getpid(), os.getppid()}
    for _ in range(300):
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in keep:
                continue
            owner = proc_state(name)
            # a zombie too: a leader that left through the raw exit syscall shows as one while
            # its other threads run on, and SIGKILL to its pid takes them all
            if owner is None or owner[0] != uid or (owner[1] == "Z" and not live_threads(name)):
                continue
            try:
                os.kill(int(name), signal.SIGKILL)
                found = True
            except OSError:
                continue
        reap()
        if not found:
            return
        time.sleep(0.005)


def kill_group(pgid: int, status: list[int]) -> None:
    """SIGKILL a call's process group until it is empty, reaping its leader into `status`.

    The leader is our child; the rest are reparented to the sandbox's init, which reaps them.
    A fork bomb keeps adding members while we kill, hence the loop (bounded at ~1 s)."""
    for _ in range(400):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            break
        if not status:
            try:
                status.append(os.waitstatus_to_exitcode(os.waitpid(pgid, 0)[1]))
            except ChildProcessError:
                status.append(-9)
        time.sleep(0.0025)
    if not status:
        try:
            status.append(os.waitstatus_to_exitcode(os.waitpid(pgid, 0)[1]))
        except ChildProcessError:
            status.append(-9)


def reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def cap_value(text: object) -> str | None:
    """A value for the answer: a str whose JSON form fits in `cap` bytes (the longest prefix
    that does), None for anything else. Escaping makes one character up to 12 bytes, so a cap
    on characters alone let a non-ASCII value overflow the host's bound on the answer."""
    if not isinstance(text, str):
        return None
    limit = CONF["cap"]
    if len(text) * 12 + 2 <= limit:
        return text
    text = text[:limit]
    lo, hi = 0, len(text)
    while lo < hi:  # the longest prefix that fits; encoded size grows with the prefix
        mid = (lo + hi + 1) // 2
        if len(json.dumps(text[:mid])) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo]


def run_code(code: str, ns: dict) -> str | None:
    """Exec `code` in `ns`; if it ends with an expression, return the repr of its value."""
    linecache.cache["<tool>"] = (len(code), None, code.splitlines(True), "<tool>")
    tree = ast.parse(code, "<tool>")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<tool>", "exec"), ns)
    if last is None:
        return None
    value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), ns)
    return None if value is None else cap_value(repr(value))


def python_main(code: str, ns: dict) -> tuple[int, str | None]:
    """Run tool code as __main__ would: exit status and value, tracebacks on stderr."""
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    value, status = None, 0
    try:
        value = run_code(code, ns)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        tb = e.__traceback__  # show the tool's frames only, not the worker's
        while tb is not None and tb.tb_frame.f_code.co_filename != "<tool>":
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        status = 137 if isinstance(e, MemoryError) else 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            pass
    return status, value


def spawn(target, setup=None) -> tuple[int, int, list[int], int]:
    """Fork a call's child: pid, its stdin writer, [stdout, stderr] readers, status reader.
    `setup` (default `child_setup`) takes the child from the worker's state to the call's."""
    i_r, i_w = os.pipe()
    o_r, o_w = os.pipe()
    e_r, e_w = os.pipe()
    s_r, s_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(i_r, 0)
            os.dup2(o_w, 1)
            os.dup2(e_w, 2)
            for fd in (i_r, i_w, o_r, o_w, e_r, e_w, s_r):
                os.close(fd)
            (setup or child_setup)()
            target(s_w)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    for fd in (i_r, o_w, e_w, s_w):
        os.close(fd)
    return pid, i_w, [o_r, e_r], s_r


def collect(fds: list[int], deadline: float, done, wake: int, status_fd: int = -1) -> dict:
    """Read `fds` until EOF on all and done() is true, the deadline passes, or the cap is hit.

    `wake` (a pidfd or a socket) becomes readable when done() may have turned true. Once it is
    true, a process the call left behind may still hold the pipes open: reading stops after
    DRAIN_S then, and the caller kills the stragglers. `status_fd` (a Python call's result) is
    read alongside, so a large result cannot block its writer, and kept apart from the output."""
    out = {fd: bytearray() for fd in fds}
    status = bytearray()
    open_fds, cap = list(fds) + ([status_fd] if status_fd >= 0 else []), CONF["cap"]
    timed_out = truncated = False
    drain_until = None
    while True:
        finished = done()  # once per round: a second look could turn true after the first,
        if finished and not open_fds:  # leaving select() nothing to wait on but the deadline
            break
        now = time.monotonic()
        if finished and drain_until is None:
            drain_until = now + DRAIN_S
        left = min(deadline, drain_until or deadline) - now
        if left <= 0:
            timed_out = drain_until is None
            break
        ready, _, _ = select.select(open_fds + ([] if finished else [wake]), [], [], left)
        for fd in ready:
            if fd == wake:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.remove(fd)
            elif fd == status_fd:
                status += chunk if len(status) <= cap + 64 else b""
            else:
                out[fd] += chunk
        if sum(map(len, out.values())) > cap:
            truncated = True
            break
    return {"out": out, "timed_out": timed_out, "truncated": truncated, "status": bytes(status)}


TOOL_RUNNER: list[socket.socket] = []  # in a verifier: its channel to its tool runner


def judge_setup() -> None:
    """A verifier's process (op "verify") before its program runs: the worker's channels closed,
    a session of its own, a tool runner forked (tool code's ids: `tool_runner`), then every id
    the worker's own, real, effective and saved, so no process of tool code's uid may signal,
    trace, /proc-open or renice it. It was never dumpable (a fork of the worker, which is not,
    and an id change keeps it so); an exec'd verifier becomes dumpable to the worker's uid only.
    Per-call limits as for tool code, except that the OOM killer takes tool code first."""
    for fd in PRIVATE_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    PRIVATE_FDS.clear()  # (their numbers are reused below: the runner must not close them again)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.setsid()
    mine, theirs = socket.socketpair()
    if os.fork() == 0:
        try:
            mine.close()
            child_setup()
            tool_runner(theirs)
        finally:
            os._exit(0)
    theirs.close()
    TOOL_RUNNER[:] = [mine]
    if CONF.get("ids"):
        uid, gid = CONF["ids"]["worker"]
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    for res, value in [(resource.RLIMIT_CPU, CONF["cpu_s"]), (resource.RLIMIT_CORE, 0),
                       (resource.RLIMIT_NOFILE, CONF["nofile"]),
                       (resource.RLIMIT_FSIZE, CONF["fsize"])]:
        resource.setrlimit(res, (value, value))
    os.chdir(CONF["work"])


def tool_runner(sock: socket.socket) -> None:
    """Serve a verifier's `run_as_tool` under tool code's ids: one request at a time, a program
    (Python source, run by a fresh interpreter, or an argv) with the stdio the verifier sends
    along (SCM_RIGHTS) and a timeout, run in a process group of its own and killed past the
    timeout; the answer is its exit status. Holds none of the verifier's descriptors but this
    socket, which it closes in the programs it runs, and is not dumpable (it is a fork of the
    worker): the programs start from a fresh image, with nothing of the worker's memory."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # not the verifier's stdio, which leads to the host
        os.dup2(null, fd)
    while True:
        first, fds, _, _ = socket.recv_fds(sock, 65536, 3)
        if len(first) < 4 or len(fds) != 3:
            return
        req = json.loads(recv_frame(sock, first))
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()
                for target, fd in zip((0, 1, 2), fds):  # noqa: B905 (runs on Python 3.9)
                    os.dup2(fd, target)
                    os.close(fd)
                os.setpgid(0, 0)
                if req.get("argv"):
                    os.execvpe(req["argv"][0], req["argv"], CONF["env"])
                # Python source in a fresh interpreter, never in this fork: the worker's memory,
                # which holds the verifier's request (its files too), must not reach tool code
                code = os.memfd_create("tool-code", 0)
                write_all(os.dup(code), req["code"].encode())
                os.lseek(code, 0, os.SEEK_SET)
                os.execve(sys.executable, [sys.executable, "-I", f"/proc/self/fd/{code}"],
                          CONF["env"])
            except BaseException:
                traceback.print_exc()
                os._exit(1)
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        if not select.select([pidfd], [], [], max(0.0, float(req["timeout"])))[0]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        os.close(pidfd)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        sock.sendall(frame(json.dumps({"status": status}).encode()))


def run_as_tool(program, stdin: bytes = b"", timeout: float = 10.0) -> dict:
    """In a verifier: run `program` (Python source, or an argv) under tool code's ids, with
    `stdin`, killed after `timeout` s (its process group). Returns {"exit_code": int or None,
    "timed_out": bool, "stdout": bytes, "stderr": bytes} (each capped like a call's output).
    The program cannot reach this verifier (another uid): what it gives back is what it wrote
    to its stdout and stderr and its exit status, to be judged as such."""
    sock = TOOL_RUNNER[0]
    key = "code" if isinstance(program, str) else "argv"
    request = frame(json.dumps({key: program if key == "code" else list(program),
                                "timeout": timeout}).encode())
    i_r, i_w = os.pipe()
    o_r, o_w = os.pipe()
    e_r, e_w = os.pipe()
    answer: dict = {}
    try:
        socket.send_fds(sock, [request], [i_r, o_w, e_w], socket.MSG_NOSIGNAL)
    except OSError:  # the runner is gone (tool code killed it): nothing ran
        answer["status"] = None
    for fd in (i_r, o_w, e_w):
        os.close(fd)
    if len(stdin) <= 65536:
        feed(i_w, stdin)
    else:  # more than a pipe holds: written beside the reading, never blocking the verifier
        threading.Thread(target=write_all, args=(i_w, stdin), daemon=True).start()
    deadline = time.monotonic() + timeout + 1.0
    out = {o_r: bytearray(), e_r: bytearray()}
    open_fds, runner = [o_r, e_r], not answer
    end = deadline  # once the output is closed (or the status is in): a short wait for the rest
    timed_out = False
    while True:
        if not open_fds or "status" in answer:
            end = min(end, time.monotonic() + (DRAIN_S if "status" in answer else 0.2))
        if (not open_fds and (answer or not runner)) or time.monotonic() >= end:
            timed_out = bool(open_fds) and time.monotonic() >= deadline
            break
        wait = open_fds + ([sock] if runner and not answer else [])
        for fd in select.select(wait, [], [], max(0.0, end - time.monotonic()))[0]:
            if fd is sock:  # the runner's answer; tool code may have killed or stopped it
                try:
                    sock.settimeout(max(0.001, deadline - time.monotonic()))
                    got = json.loads(recv_frame(sock, b"", 4096))
                    answer["status"] = got["status"] if type(got.get("status")) is int else None
                except (OSError, ValueError, EOFError, AttributeError, KeyError):
                    runner = False  # gone: the output alone tells when the program is done
                finally:
                    sock.settimeout(None)
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.remove(fd)
            elif len(out[fd]) < CONF["cap"]:
                out[fd] += chunk[:CONF["cap"] - len(out[fd])]
    for fd in (o_r, e_r):
        os.close(fd)
    status = answer.get("status")
    return {"exit_code": status, "timed_out": timed_out or status == -signal.SIGKILL,
            "stdout": bytes(out[o_r]), "stderr": bytes(out[e_r])}


def write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data[:65536]):]
    except OSError:
        pass
    os.close(fd)


def write_verifier_files(files: dict) -> None:
    """In a verifier, under its ids: its files in the work dir, each replacing whatever tool
    code left at that path, created afresh (never through a link) and readable by the verifier
    only, so tool code can neither read nor rewrite them."""
    work = os.path.realpath(CONF["work"])
    for rel, data in files.items():
        path = os.path.join(work, rel)
        parent = os.path.realpath(os.path.dirname(path))
        if parent != work and not parent.startswith(work + os.sep):
            raise OSError(f"{rel!r} resolves outside the work dir")
        os.makedirs(parent, exist_ok=True)
        path = os.path.join(parent, os.path.basename(path))
        try:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            with os.fdopen(os.open(path, flags, 0o600), "wb") as f:
                f.write(base64.b64decode(data))
        except OSError as e:
            raise OSError(f"{rel!r}: {e}") from e


class Repl:
    """The persistent session: a long-lived forked child holding Python globals, which gets each
    call's stdio by SCM_RIGHTS and is stopped whenever none of its calls runs."""

    def __init__(self) -> None:
        self.sock, child = socket.socketpair()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                self.sock.close()
                child_setup()
                self.serve(child)
            finally:
                os._exit(0)
        child.close()
        self.pidfd = os.pidfd_open(self.pid)  # signals by pidfd: the pid may be reused
        PRIVATE_FDS.extend((self.sock.fileno(), self.pidfd))

    @staticmethod
    def serve(sock: socket.socket) -> None:
        ns: dict = {"__name__": "__main__"}
        null = os.open(os.devnull, os.O_RDWR)
        while True:
            # the call's stdio fds ride on the first segment of its frame (SCM_RIGHTS)
            first, fds, _, _ = socket.recv_fds(sock, 65536, 3)
            if len(first) < 4 or len(fds) != 3:
                return
            code = recv_frame(sock, first).decode()
            reap()  # children of earlier calls, killed since by the worker
            for target, fd in zip((0, 1, 2), fds):  # noqa: B905 (runs on Python 3.9)
                os.dup2(fd, target)
                os.close(fd)
            status, value = python_main(code, ns)
            for target in (0, 1, 2):
                os.dup2(null, target)
            sock.sendall(frame(json.dumps({"status": status, "value": value}).encode()))

    def alive(self) -> bool:
        return bool(self.pid) and not select.select([self.pidfd], [], [], 0)[0]

    def stopped(self) -> bool:
        """Every thread of the session is stopped (or gone)."""
        try:
            tids = os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            return True
        return all((proc_state(f"{self.pid}/task/{tid}") or (0, "X"))[1] in "TtZX" for tid in tids)

    def freeze(self) -> None:
        """Stop the session until its next call; kill it if it does not stop in FREEZE_S."""
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGSTOP)
        except OSError:
            return
        deadline = time.monotonic() + FREEZE_S
        while not self.stopped():
            if time.monotonic() > deadline:
                self.kill()
                return
            time.sleep(0.0005)

    def call(self, code: str, stdin: bytes, deadline: float) -> dict:
        request = frame(code.encode())  # before anything else: the session stays as it is
        try:  # what the session wrote while it last ran would be taken for this call's answer
            while self.sock.recv(65536, socket.MSG_DONTWAIT):
                pass
        except OSError:  # nothing more (BlockingIOError), or the session died (seen below)
            pass
        i_r, i_w = os.pipe()
        o_r, o_w = os.pipe()
        e_r, e_w = os.pipe()
        answer: dict = {}
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGCONT)
            socket.send_fds(self.sock, [request], [i_r, o_w, e_w], socket.MSG_NOSIGNAL)
        except OSError:  # the session died since the last look
            answer["status"] = None
        for fd in (i_r, o_w, e_w):
            os.close(fd)
        feed(i_w, stdin)

        def done() -> bool:
            if not answer and select.select([self.sock], [], [], 0)[0]:
                try:  # the session is tool code: take only an int status and a str value
                    # (a partial frame must not hold the worker past the call's deadline)
                    self.sock.settimeout(max(0.001, deadline - time.monotonic()))
                    try:
                        got = json.loads(recv_frame(self.sock, b"", CONF["cap"] + 65536))
                    finally:
                        self.sock.settimeout(None)
                    status = got["status"] if type(got.get("status")) is int else None
                    answer.update(status=status, value=cap_value(got.get("value")))
                except (OSError, ValueError, EOFError, AttributeError):
                    answer["status"] = None
            return bool(answer)

        got = collect([o_r, e_r], deadline, done, self.sock.fileno())
        for fd in (o_r, e_r):
            os.close(fd)
        if got["timed_out"] or got["truncated"] or answer.get("status") is None:
            self.kill()
        return {**got, "exit_code": answer.get("status"), "value": answer.get("value")}

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except OSError:
            pass
        for fd in (self.sock.fileno(), self.pidfd):
            PRIVATE_FDS.remove(fd)
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        self.sock.close()
        os.close(self.pidfd)
        self.pid = 0


REPL: list[Repl] = []


def session() -> Repl | None:
    """The persistent session if it is alive."""
    if REPL and REPL[0].pid and not REPL[0].alive():
        REPL[0].kill()
    return REPL[0] if REPL and REPL[0].pid else None


def settle() -> None:
    """After every call: the session stopped and every other process of tool code killed. A
    stray could wake the session up while it is being killed, hence the second look."""
    for _ in range(10):
        repl = session()
        if repl is not None:
            repl.freeze()
            repl = session()
        kill_strays({repl.pid} if repl else set())
        if repl is None or repl.stopped():
            return
    repl = session()
    if repl is not None:
        repl.kill()


def feed(fd: int, data: bytes) -> None:
    """Write stdin without blocking forever on a child that never reads it."""
    try:
        os.set_blocking(fd, False)
        os.write(fd, data[:65536]) if data else None
    except OSError:
        pass
    os.close(fd)


def decode_result(got: dict, fds: list[int], exit_code, value=None, oom=False) -> dict:
    cap = CONF["cap"]
    return {"exit_code": exit_code, "value": value, "oom": oom,
            "timed_out": got["timed_out"], "truncated": got["truncated"],
            "stdout": base64.b64encode(bytes(got["out"][fds[0]][:cap])).decode(),
            "stderr": base64.b64encode(bytes(got["out"][fds[1]][:cap])).decode()}


def run_call(req: dict) -> dict:
    deadline = time.monotonic() + float(req.get("timeout", 30))
    stdin = base64.b64decode(req.get("stdin", ""))
    oom_before = oom_count()
    if req["op"] == "py" and req.get("persistent"):
        repl = session()
        if repl is None:
            repl = Repl()
            REPL[:] = [repl]
        r = repl.call(req["code"], stdin, deadline)
        settle()
        return decode_result(r, list(r["out"]), r["exit_code"], r["value"],
                             oom_count() > oom_before or r["exit_code"] == 137)

    setup = None
    if req["op"] == "verify":
        setup = judge_setup
        files, argv, code = req.get("files") or {}, req.get("argv"), req.get("code")
        env = CONF["env"]

        def target(status_fd: int) -> None:
            try:
                write_verifier_files(files)
            except OSError as e:
                sys.stderr.write(f"the sandbox refused the verifier's files: {e}\n")
                os._exit(2)
            if argv:
                os.close(status_fd)
                fd = TOOL_RUNNER[0].fileno()
                os.set_inheritable(fd, True)
                os.execvpe(argv[0], argv, {**env, "AGENT_RL_TOOL_RUNNER": str(fd)})
            ns = {"__name__": "__main__", "run_as_tool": run_as_tool}
            status, value = python_main(code, ns)
            os.write(status_fd, json.dumps({"value": value}).encode())
            os._exit(status)
    elif req["op"] == "exec":
        argv, env = req["argv"], CONF["env"]

        def target(status_fd: int) -> None:
            os.close(status_fd)
            os.execvpe(argv[0], argv, env)
    else:
        def target(status_fd: int) -> None:
            status, value = python_main(req["code"], {"__name__": "__main__"})
            os.write(status_fd, json.dumps({"value": value}).encode())
            os._exit(status)

    work_mode = stat.S_IMODE(os.stat(CONF["work"]).st_mode)
    if setup is not None:  # the verifier (the worker's uid) may create its files in /work
        os.chmod(CONF["work"], 0o777)
    try:
        return finish_call(spawn(target, setup), stdin, deadline, oom_before)
    finally:
        if setup is not None:
            os.chmod(CONF["work"], work_mode)
            remove_verifier_files(req.get("files") or {})


def remove_verifier_files(files: dict) -> None:
    """After a verifier: its files (still its own) out of the work dir, which tool code owns,
    so that they neither linger nor stand in the way of tool code's files of the same name."""
    uid = CONF["ids"]["worker"][0] if CONF.get("ids") else os.getuid()
    for rel in files:
        path = os.path.join(CONF["work"], rel)
        try:
            if os.lstat(path).st_uid == uid:
                os.unlink(path)
        except OSError:
            pass


def finish_call(spawned: tuple[int, int, list[int], int], stdin: bytes, deadline: float,
                oom_before: int) -> dict:
    pid, stdin_w, fds, status_r = spawned
    feed(stdin_w, stdin)
    status: list[int] = []

    def done() -> bool:
        if not status:
            wpid, st = os.waitpid(pid, os.WNOHANG)
            if wpid:
                status.append(os.waitstatus_to_exitcode(st))
        return bool(status)

    pidfd = os.pidfd_open(pid)
    got = collect(fds, deadline, done, pidfd, status_r)
    os.close(pidfd)
    kill_group(pid, status)
    settle()  # daemons the call detached (setsid, double fork); the session, if it woke up
    try:  # the result pipe is tool code's too: take only a str value
        value = cap_value(json.loads(got["status"] or b"{}").get("value"))
    except (ValueError, AttributeError):
        value = None
    for fd in (*fds, status_r):
        os.close(fd)
    oom = oom_count() > oom_before or (bool(CONF.get("as_bytes")) and status[0] == 137)
    return decode_result(got, fds, status[0], value, oom)


def file_op(req: dict) -> dict:
    """Read or write a regular file in the work dir, with tool code's permissions (the worker's
    effective ids). Never follows the path out of the work dir, never blocks on a FIFO."""
    try:
        path = os.path.realpath(os.path.join(CONF["work"], req["path"]))
        if not path.startswith(os.path.realpath(CONF["work"]) + os.sep):
            return {"error": "outside", "message": "path resolves outside the work dir"}
        if req["op"] == "read":
            flags = os.O_RDONLY
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "rb" if req["op"] == "read" else "wb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return {"error": "not_a_file", "message": "not a regular file"}
            if req["op"] == "read":
                return {"data": base64.b64encode(f.read(int(req["max"]) + 1)).decode()}
            f.write(base64.b64decode(req["data"]))
        return {"ok": True}
    except (OSError, ValueError) as e:  # ValueError: a NUL byte or an unencodable path
        return {"error": type(e).__name__, "message": str(e)}


def handle(req: dict) -> dict:
    op = req.get("op")
    if op == "ping":
        return {"ok": True, "pid": os.getpid()}
    if op in ("exec", "py", "verify"):
        try:
            return run_call(req)
        except (OSError, MemoryError) as e:  # no process, pipe or memory left: tool code's doing
            try:  # (the host restarts the sandbox, which frees all of it)
                settle()
            except (OSError, MemoryError):
                pass
            return {"error": "resources", "message": f"{type(e).__name__}: {e}"}
    if op in ("read", "write"):
        return file_op(req)
    return {"error": "protocol", "message": f"unknown op {op!r}"}


def serve(fin, fout) -> None:
    while True:
        req = read_msg(fin)
        if req is None:
            return
        try:
            resp = handle(req)
        except Exception as e:  # the worker must outlive any request; the host decides
            resp = {"error": "worker", "message": f"{type(e).__name__}: {e}"}
        resp["nonce"] = req.get("nonce") if isinstance(req, dict) else None
        write_msg(fout, resp)


def main() -> None:
    CONF.update(json.loads(sys.argv[1]))
    os.closerange(3, 1 << 16)  # what the sandbox's setup left open (bwrap's pipes) is not ours
    os.umask(0o022)
    become()
    if CONF.get("connect"):
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(CONF["connect"])
        PRIVATE_FDS.append(sock.fileno())
        f = sock.makefile("rwb")
        serve(f, f)
    else:
        out = os.fdopen(os.dup(1), "wb")
        # tool code must not reach the protocol stream by inheriting fd 1: point it elsewhere
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 1)
        os.close(null)
        PRIVATE_FDS.append(out.fileno())
        serve(sys.stdin.buffer, out)


if __name__ == "__main__":
    main()
