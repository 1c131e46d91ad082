"""The persistent worker that runs inside every sandbox (stdlib only, any Python >= 3.9).

One worker per sandbox serves calls over a byte stream (its stdin/stdout, or a unix socket it
connects to), so a call pays a fork, not a sandbox and interpreter start-up. Framing: a 4-byte
big-endian length, then JSON; bytes travel base64-encoded. Requests:

  {"op": "ping"}
  {"op": "exec", "argv": [...], "stdin": b64, "timeout": s}
  {"op": "py", "code": str, "stdin": b64, "timeout": s, "persistent": bool}
  {"op": "read", "path": rel, "max": n}      {"op": "write", "path": rel, "data": b64}

Each call runs in a forked child in its own process group with per-call rlimits, its output is
read up to `cap` bytes, and past the deadline or the cap the group is killed. When a call ends,
every other process of the sandbox's uid (double forks, setsid daemons) is killed too, so a call
leaves nothing running. `persistent` Python runs in a long-lived REPL child whose globals
survive across calls until one of them has to be killed.

This process sits inside the sandbox's trust boundary: tool code can kill or impersonate it. The
host therefore bounds every answer and respawns the sandbox when the worker misbehaves.
"""

from __future__ import annotations

import ast
import base64
import json
import linecache
import os
import resource
import select
import signal
import socket
import struct
import sys
import time
import traceback

DRAIN_S = 0.05  # how long output is still read after a call's main process has exited
CONF: dict = {}  # set from argv: cap, work, cpu_s, nofile, fsize, as_bytes, nproc, env, sweep
PRIVATE_FDS: list[int] = []  # the protocol stream and REPL socket: closed in every call's child


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


def recv_frame(sock: socket.socket, first: bytes) -> bytes:
    """The rest of a length-prefixed frame whose first bytes were already received."""
    buf = bytearray(first)
    while len(buf) < 4 or len(buf) < 4 + struct.unpack(">I", bytes(buf[:4]))[0]:
        chunk = sock.recv(65536)
        if not chunk:
            raise EOFError("REPL socket closed")
        buf += chunk
    return bytes(buf[4:])


def child_setup() -> None:
    """Per-call limits, applied in the forked child only, so the worker itself is never capped.
    Also closes the worker's own channels, so tool code cannot forge answers through them."""
    for fd in PRIVATE_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    os.setpgid(0, 0)
    try:  # be the first victim of the OOM killer, so the worker survives a memory hog
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
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


def kill_strays(keep: set[int]) -> None:
    """Kill every process of our uid except `keep`, until none is left (fork bombs refill)."""
    uid, me = os.getuid(), os.getpid()
    if uid == 0 or not CONF.get("sweep", True):  # never sweep the server's own uid or root's
        return
    keep = keep | {1, me, os.getppid()}
    for _ in range(300):
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in keep:
                continue
            try:
                if os.stat("/proc/" + name).st_uid != uid or _zombie(name):
                    continue
                os.kill(int(name), signal.SIGKILL)
                found = True
            except OSError:
                continue
        reap()
        if not found:
            return
        time.sleep(0.005)


def _zombie(pid: str) -> bool:
    """Dead, waiting for its parent to reap it: nothing left to kill."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


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


def run_code(code: str, ns: dict) -> str | None:
    """Exec `code` in `ns`; if it ends with an expression, return the repr of its value."""
    linecache.cache["<tool>"] = (len(code), None, code.splitlines(True), "<tool>")
    tree = ast.parse(code, "<tool>")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<tool>", "exec"), ns)
    if last is None:
        return None
    value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), ns)
    return None if value is None else repr(value)[:CONF["cap"]]


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


def spawn(target) -> tuple[int, int, list[int], int]:
    """Fork a call's child: pid, its stdin writer, [stdout, stderr] readers, status reader."""
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
            child_setup()
            target(s_w)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    for fd in (i_r, o_w, e_w, s_w):
        os.close(fd)
    return pid, i_w, [o_r, e_r], s_r


def collect(fds: list[int], deadline: float, done, wake: int) -> dict:
    """Read `fds` until EOF on all and done() is true, the deadline passes, or the cap is hit.

    `wake` (a pidfd or a socket) becomes readable when done() may have turned true. Once it is
    true, a process the call left behind may still hold the pipes open: reading stops after
    DRAIN_S then, and the caller kills the stragglers."""
    out = {fd: bytearray() for fd in fds}
    open_fds, cap = list(fds), CONF["cap"]
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
                continue
            out[fd] += chunk
        if sum(map(len, out.values())) > cap:
            truncated = True
            break
    return {"out": out, "timed_out": timed_out, "truncated": truncated}


class Repl:
    """A long-lived forked child holding Python globals; gets each call's stdio by SCM_RIGHTS."""

    def __init__(self) -> None:
        self.sock, child = socket.socketpair()
        PRIVATE_FDS.append(self.sock.fileno())
        self.pid = os.fork()
        if self.pid == 0:
            try:
                child_setup()
                self.serve(child)
            finally:
                os._exit(0)
        child.close()

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

    def call(self, code: str, stdin: bytes, deadline: float) -> dict:
        i_r, i_w = os.pipe()
        o_r, o_w = os.pipe()
        e_r, e_w = os.pipe()
        socket.send_fds(self.sock, [frame(code.encode())], [i_r, o_w, e_w])
        for fd in (i_r, o_w, e_w):
            os.close(fd)
        feed(i_w, stdin)
        answer: dict = {}

        def done() -> bool:
            if not answer and select.select([self.sock], [], [], 0)[0]:
                try:
                    answer.update(json.loads(recv_frame(self.sock, b"")))
                except (OSError, ValueError, EOFError):
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
        PRIVATE_FDS.remove(self.sock.fileno())
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        self.sock.close()
        self.pid = 0


REPL: list[Repl] = []


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
        if not REPL or not REPL[0].pid:
            REPL[:] = [Repl()]
        r = REPL[0].call(req["code"], stdin, deadline)
        kill_strays({REPL[0].pid} if REPL[0].pid else set())
        return decode_result(r, list(r["out"]), r["exit_code"], r["value"],
                             oom_count() > oom_before or r["exit_code"] == 137)

    if req["op"] == "exec":
        argv, env = req["argv"], CONF["env"]

        def target(status_fd: int) -> None:
            os.close(status_fd)
            os.execvpe(argv[0], argv, env)
    else:
        def target(status_fd: int) -> None:
            status, value = python_main(req["code"], {"__name__": "__main__"})
            os.write(status_fd, json.dumps({"value": value}).encode()[: CONF["cap"] + 64])
            os._exit(status)

    pid, stdin_w, fds, status_r = spawn(target)
    feed(stdin_w, stdin)
    status: list[int] = []

    def done() -> bool:
        if not status:
            wpid, st = os.waitpid(pid, os.WNOHANG)
            if wpid:
                status.append(os.waitstatus_to_exitcode(st))
        return bool(status)

    pidfd = os.pidfd_open(pid)
    got = collect(fds, deadline, done, pidfd)
    os.close(pidfd)
    kill_group(pid, status)
    keep = {REPL[0].pid} if REPL and REPL[0].pid else set()
    kill_strays(keep)  # daemons the call detached (setsid, double fork)
    os.set_blocking(status_r, False)
    try:
        value = json.loads(os.read(status_r, CONF["cap"] + 64) or b"{}").get("value")
    except (OSError, ValueError):
        value = None
    for fd in (*fds, status_r):
        os.close(fd)
    oom = oom_count() > oom_before or (bool(CONF.get("as_bytes")) and status[0] == 137)
    return decode_result(got, fds, status[0], value, oom)


def file_op(req: dict) -> dict:
    path = os.path.realpath(os.path.join(CONF["work"], req["path"]))
    if not path.startswith(os.path.realpath(CONF["work"]) + os.sep):
        return {"error": "outside", "message": "path resolves outside the work dir"}
    try:
        if req["op"] == "read":
            with open(path, "rb") as f:
                data = f.read(int(req["max"]) + 1)
            return {"data": base64.b64encode(data).decode()}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(req["data"]))
        return {"ok": True}
    except OSError as e:
        return {"error": type(e).__name__, "message": str(e)}


def serve(fin, fout) -> None:
    while True:
        req = read_msg(fin)
        if req is None:
            return
        op = req.get("op")
        if op == "ping":
            resp = {"ok": True, "pid": os.getpid()}
        elif op in ("exec", "py"):
            resp = run_call(req)
        elif op in ("read", "write"):
            resp = file_op(req)
        else:
            resp = {"error": "protocol", "message": f"unknown op {op!r}"}
        write_msg(fout, resp)


def main() -> None:
    CONF.update(json.loads(sys.argv[1]))
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.umask(0o022)
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
