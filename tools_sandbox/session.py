"""Host side of a sandbox served by the in-sandbox worker, shared by every backend.

A backend supplies four hooks: start the worker and return a byte channel to it, kill every
process of the sandbox, count its OOM kills, and remove its host resources. This class turns
them into the `Sandbox` protocol: calls are serialized per sandbox, each answer is bounded in
size and waited for at most the call's timeout plus a grace period, and when the worker dies or
hangs the whole sandbox is killed and respawned (the work dir survives), so the failing call
returns a result that says so and the next call works.

Every request carries a fresh random nonce that its answer must repeat. An answer that does
not (or is oversized, or not a JSON object of the right shape) was not written by the worker in
reply to this request: something in the sandbox forged it, or the worker is broken. That is a
protocol violation: the sandbox is killed at once and the call raises `SandboxError`, so a
forged result can never be read as the outcome of a call (a verifier's reward included).
Input that cannot reach the worker intact (a NUL byte in a path or argument, a lone surrogate
in text) is the caller's mistake, a `ToolError`, and never touches the sandbox.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import secrets
import struct
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import anyio
from anyio.abc import ByteReceiveStream, ByteSendStream, Process
from anyio.streams.buffered import BufferedByteReceiveStream

from agent_rl.kernel.errors import SandboxError, ToolError
from agent_rl.sdk.sandbox import ExecResult, SandboxSpec, work_path

log = logging.getLogger(__name__)

GRACE_S = 5.0
"""Seconds past a call's timeout the worker gets to kill the call and answer, before it is
presumed hung and the sandbox is restarted."""

START_TIMEOUT_S = 30.0
"""Time a fresh sandbox gets to answer its first ping (64 sandboxes starting on 2 cores)."""


class ProtocolViolation(SandboxError):
    """An answer the worker did not give to the request just sent (wrong nonce, oversized, not
    a JSON object of the right shape): forged by something in the sandbox, or a broken worker."""


class Channel:
    """Length-prefixed JSON frames over a pair of anyio byte streams, one answer per request,
    each matched to its request by a nonce."""

    def __init__(self, send: ByteSendStream, receive: ByteReceiveStream) -> None:
        self._send = send
        self._receive = BufferedByteReceiveStream(receive)

    async def request(self, obj: dict[str, Any], max_bytes: int) -> dict[str, Any]:
        """Send `obj`, return its answer; ProtocolViolation if the answer is not its own."""
        nonce = secrets.token_hex(16)
        data = json.dumps({**obj, "nonce": nonce}).encode()
        await self._send.send(struct.pack(">I", len(data)) + data)
        (size,) = struct.unpack(">I", await self._receive.receive_exactly(4))
        if size > max_bytes:
            raise ProtocolViolation(f"an answer of {size} bytes, more than the {max_bytes} allowed")
        try:
            answer = json.loads(await self._receive.receive_exactly(size))
        except ValueError as e:
            raise ProtocolViolation(f"an answer that is not JSON ({e})") from e
        if not isinstance(answer, dict):
            raise ProtocolViolation("an answer that is not a JSON object")
        if answer.get("nonce") != nonce:
            raise ProtocolViolation("an answer without this request's nonce (forged, or late)")
        return answer


def worker_config(spec: SandboxSpec, work: str, **extra: Any) -> dict[str, Any]:
    """The worker's startup settings (see worker.py) for a spec."""
    lim = spec.limits
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", **dict(spec.env)}
    return {"cap": lim.output_bytes, "work": work, "cpu_s": lim.cpu_s, "nofile": lim.nofile,
            "fsize": lim.disk_mb << 20, "env": env, **extra}


async def process_stderr(proc: Process | None, limit: int = 4096) -> str:
    """Up to `limit` bytes a dead sandbox process wrote to its stderr, for an error message."""
    if proc is None or proc.stderr is None:
        return ""
    out = b""
    with anyio.move_on_after(1):
        while len(out) < limit:
            try:
                out += await proc.stderr.receive(limit)
            except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                break
    return out.decode("utf-8", "replace").strip()[-2000:]


class WorkerSandbox(ABC):
    """A `Sandbox` whose calls go to worker.py; backends subclass it."""

    def __init__(self, sandbox_id: str, spec: SandboxSpec, on_close: Callable[[str], None]) -> None:
        self._id = sandbox_id
        self._spec = spec
        self._on_close = on_close
        self._lock = anyio.Lock()
        self._chan: Channel | None = None
        self._closed = False
        self._worker: tuple[int, set[int]] | None = None  # host pid and CPUs, once known

    @property
    def id(self) -> str:
        return self._id

    @property
    def spec(self) -> SandboxSpec:
        return self._spec

    # ---- backend hooks
    @abstractmethod
    async def _spawn(self) -> Channel:
        """Start the worker; return a channel to it."""

    @abstractmethod
    async def _kill(self) -> None:
        """Kill every process of the sandbox, the worker included, and wait until they are gone."""

    async def _kill_tool_code(self) -> bool:
        """Kill every process of tool code's uid in the sandbox as a whole (atomic against
        forks), keeping the worker and the work dir; False where the backend cannot, and then
        `restart` starts the sandbox afresh."""
        return False

    @abstractmethod
    def _oom_kills(self) -> int:
        """OOM kills so far, as the host sees them (0 where the worker reports them itself)."""

    @abstractmethod
    async def _destroy(self) -> None:
        """Remove every host resource (after _kill)."""

    async def _diagnostics(self) -> str:
        """What the sandbox's start-up printed, for an error message (empty if unknown)."""
        return ""

    def _worker_pid(self) -> int | None:
        """The worker's host pid, looked up once it has answered (None: unknown, and its
        scheduling is left as it is)."""
        return None

    def _found_worker(self) -> None:
        pid = self._worker_pid()
        try:
            self._worker = None if pid is None else (pid, os.sched_getaffinity(pid))
        except OSError:
            self._worker = None

    def _restore_scheduling(self) -> None:
        """The worker's priority, policy and CPUs back to what it started with, before every
        request. Tool code's uid is the worker's effective one, so a call may renice it, make it
        SCHED_IDLE or pin it to one CPU (slowing its own call: the deadlines still hold); the
        worker, with no capability, could not undo that itself, so the host does."""
        if self._worker is None:
            return
        pid, cpus = self._worker
        try:
            if os.getpriority(os.PRIO_PROCESS, pid) != 0:
                os.setpriority(os.PRIO_PROCESS, pid, 0)
            if os.sched_getscheduler(pid) != os.SCHED_OTHER:
                os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
            if os.sched_getaffinity(pid) != cpus:
                os.sched_setaffinity(pid, cpus)
        except OSError:
            pass  # the worker is gone (the request finds out) or this host does not allow it

    # ---- lifecycle
    async def start(self) -> None:
        """Spawn the worker and wait for its first answer; on failure, clean up and raise."""
        try:
            with anyio.fail_after(START_TIMEOUT_S):
                self._chan = await self._spawn()
                await self._chan.request({"op": "ping"}, 1024)
            self._found_worker()
        except (Exception, anyio.get_cancelled_exc_class()) as e:
            with anyio.CancelScope(shield=True):
                why = await self._diagnostics()
                await self.close()
            if isinstance(e, (SandboxError, anyio.get_cancelled_exc_class())):
                raise
            raise SandboxError(
                f"sandbox {self._id} did not start: {type(e).__name__}: {e}; {why or 'no output'}"
            ) from e

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            try:
                await self._kill()
            finally:
                self._chan = None
                await self._destroy()
                self._on_close(self._id)

    async def __aenter__(self) -> WorkerSandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _abandon(self) -> None:
        """The caller was cancelled mid-request: the worker's late answer would be read as the
        next call's, so the sandbox is killed now and respawned by the next call."""
        with anyio.CancelScope(shield=True):
            self._chan = None
            await self._kill()

    async def _respawn(self) -> None:
        await self._kill()
        self._chan = None
        self._worker = None
        try:
            with anyio.fail_after(START_TIMEOUT_S):
                chan = await self._spawn()
                await chan.request({"op": "ping"}, 1024)
        except Exception as e:
            raise SandboxError(f"sandbox {self._id} could not be restarted: {e}") from e
        self._chan = chan
        self._found_worker()

    # ---- calls
    async def _request(self, req: dict[str, Any], wait_s: float, max_answer: int) -> dict[str, Any]:
        """One round trip, with the lock held: the worker respawned first if it is gone, the
        sandbox killed if the caller is cancelled (a late answer must not answer the next call)
        or if the answer breaks the protocol (then ProtocolViolation, a SandboxError)."""
        if self._chan is None:
            await self._respawn()
        assert self._chan is not None
        self._restore_scheduling()
        try:
            with anyio.fail_after(wait_s):
                return await self._chan.request(req, max_answer)
        except ProtocolViolation as e:
            with anyio.CancelScope(shield=True):
                self._chan = None
                await self._kill()
            log.error("sandbox %s: protocol violation (%s); killed", self._id, e)
            raise ProtocolViolation(
                f"sandbox {self._id} broke the protocol with {e}; it was killed and the call has "
                "no result (tool code may have tried to forge one)") from e
        except anyio.get_cancelled_exc_class():
            await self._abandon()
            raise

    async def _call(self, req: dict[str, Any], timeout: float) -> ExecResult:
        if self._closed:
            raise SandboxError(f"sandbox {self._id} is closed")
        # stdout and stderr (base64) and the value (JSON) each at their cap, and the rest
        max_answer = 4 * self._spec.limits.output_bytes + 65536
        async with self._lock:
            before, t0 = self._oom_kills(), time.perf_counter()
            failure = ""
            try:
                answer = await self._request({**req, "timeout": timeout}, timeout + GRACE_S,
                                             max_answer)
            except TimeoutError:
                failure, answer = "the sandbox stopped answering and was restarted", {}
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError,
                    anyio.IncompleteRead, OSError) as e:
                failure, answer = f"the sandbox died ({type(e).__name__}) and was restarted", {}
            if answer.get("error") == "resources":
                # no process, pipe or memory left to run the call: tool code exhausted them
                failure = (f"the sandbox ran out of resources ({answer.get('message')}) and was "
                           "restarted")
                answer = {}
            oom = self._oom_kills() > before or bool(answer.get("oom"))
            if failure:
                log.warning("sandbox %s: %s", self._id, failure)
                await self._respawn()
                return ExecResult(exit_code=None, stderr=failure, restarted=True, oom_killed=oom,
                                  timed_out=time.perf_counter() - t0 >= timeout,
                                  duration_s=time.perf_counter() - t0)
            return self._result(answer, oom, time.perf_counter() - t0)

    def _result(self, answer: dict[str, Any], oom: bool, duration_s: float) -> ExecResult:
        if "error" in answer:
            raise SandboxError(f"sandbox {self._id}: the worker could not serve the call: "
                               f"{answer.get('message', answer['error'])}")
        cap = self._spec.limits.output_bytes
        try:
            return ExecResult(
                exit_code=answer["exit_code"],
                stdout=base64.b64decode(answer.get("stdout", ""))[:cap].decode("utf-8", "replace"),
                stderr=base64.b64decode(answer.get("stderr", ""))[:cap].decode("utf-8", "replace"),
                timed_out=bool(answer.get("timed_out")),
                truncated=bool(answer.get("truncated")),
                oom_killed=oom,
                value=_valid_text(answer.get("value")),
                duration_s=duration_s,
            )
        except (KeyError, TypeError, ValueError) as e:  # ValueError: pydantic's, binascii's
            raise SandboxError(f"sandbox {self._id}: bad worker answer {answer!r:.200}") from e

    def _timeout(self, timeout: float | None) -> float:
        wall = self._spec.limits.wall_s
        return wall if timeout is None else max(0.001, min(float(timeout), wall))

    async def exec(
        self, argv: Sequence[str], *, stdin: str | bytes = b"", timeout: float | None = None
    ) -> ExecResult:
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ToolError("argv must be a non-empty list of strings")
        for i, arg in enumerate(argv):
            _no_nul(arg, f"argv[{i}]")
        req = {"op": "exec", "argv": list(argv), "stdin": _b64(stdin, "stdin")}
        return await self._call(req, self._timeout(timeout))

    async def run_python(
        self,
        code: str,
        *,
        stdin: str | bytes = b"",
        timeout: float | None = None,
        persistent: bool = False,
    ) -> ExecResult:
        _encoded(code, "code")
        req = {"op": "py", "code": code, "stdin": _b64(stdin, "stdin"), "persistent": persistent}
        return await self._call(req, self._timeout(timeout))

    async def run_verifier(
        self,
        program: str | Sequence[str],
        *,
        files: Mapping[str, str | bytes] | None = None,
        stdin: str | bytes = b"",
        timeout: float | None = None,
    ) -> ExecResult:
        """`Sandbox.run_verifier`: op "verify" of worker.py (`judge_setup`)."""
        req: dict[str, Any] = {"op": "verify", "stdin": _b64(stdin, "stdin"),
                               "files": {_work_path(p): _b64(d, "content")
                                         for p, d in (files or {}).items()}}
        if isinstance(program, str):
            _encoded(program, "code")
            req["code"] = program
        else:
            if not program or not all(isinstance(a, str) for a in program):
                raise ToolError("argv must be a non-empty list of strings")
            req["argv"] = [_no_nul(a, f"argv[{i}]") for i, a in enumerate(program)]
        return await self._call(req, self._timeout(timeout))

    async def restart(self) -> None:
        """`Sandbox.restart`: every process killed (by the backend's cgroup, pid namespace or
        container, as a whole), then a fresh worker on the same work dir."""
        if self._closed:
            raise SandboxError(f"sandbox {self._id} is closed")
        async with self._lock:
            if self._chan is not None and await self._kill_tool_code():
                try:  # the worker, kept, must still answer (nothing of tool code can be left
                    with anyio.fail_after(START_TIMEOUT_S):  # to answer in its place)
                        await self._request({"op": "ping"}, START_TIMEOUT_S, 1024)
                    return
                except Exception as e:  # noqa: BLE001 (any doubt: the full restart below)
                    log.warning("sandbox %s: the worker did not answer after the kill (%s: %s); "
                                "restarting", self._id, type(e).__name__, e)
            await self._respawn()

    async def _file_op(self, req: dict[str, Any], max_answer: int) -> dict[str, Any]:
        if self._closed:
            raise SandboxError(f"sandbox {self._id} is closed")
        async with self._lock:
            try:
                answer = await self._request(req, self._spec.limits.wall_s + GRACE_S, max_answer)
            except ProtocolViolation:
                raise
            except Exception as e:
                # the worker died or hung (tool code can starve it): restarted, the operation
                # is the caller's to retry; a restart that fails is the host's, SandboxError
                log.warning("sandbox %s: %s failed (%s: %s); restarting", self._id, req["op"],
                            type(e).__name__, e)
                await self._respawn()
                raise ToolError(f"{req['op']} {req['path']!r}: the sandbox stopped answering "
                                "and was restarted (files in /work are kept); try again") from e
        if answer.get("error") == "worker":
            raise SandboxError(f"sandbox {self._id}: the worker could not serve {req['op']}: "
                               f"{answer.get('message')}")
        if "error" in answer:
            why = answer.get("message", answer["error"])
            raise ToolError(f"{req['op']} {req['path']!r}: {why}")
        return answer

    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        limit = self._spec.limits.output_bytes if max_bytes is None else max_bytes
        answer = await self._file_op({"op": "read", "path": _work_path(path), "max": limit},
                                     2 * limit + 4096)
        try:
            return base64.b64decode(answer["data"])[:limit]
        except (KeyError, TypeError, ValueError) as e:
            raise SandboxError(f"sandbox {self._id}: bad worker answer {answer!r:.200}") from e

    async def write_file(self, path: str, data: str | bytes) -> None:
        req = {"op": "write", "path": _work_path(path), "data": _b64(data, "content")}
        await self._file_op(req, 4096)


def _encoded(text: str | bytes, what: str) -> bytes:
    """The bytes the sandbox gets for `text`; ToolError for a str that is not valid Unicode
    (a lone surrogate such as '\\ud800' has no UTF-8 form)."""
    if isinstance(text, bytes):
        return text
    try:
        return text.encode()
    except UnicodeEncodeError as e:
        raise ToolError(
            f"{what} is not valid text: {e.reason} at position {e.start} "
            f"({text[e.start:e.end]!r}); pass valid Unicode (or bytes, where bytes are accepted)"
        ) from None


def _valid_text(value: object) -> object:
    """A str from the sandbox with what has no UTF-8 form (lone surrogates, which JSON can
    carry) replaced, so that no consumer on the host fails to encode it; anything else as is."""
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    return value


def _b64(data: str | bytes, what: str) -> str:
    return base64.b64encode(_encoded(data, what)).decode()


def _no_nul(text: str, what: str) -> str:
    """A path or an argument: valid Unicode without NUL bytes (no OS call can take one)."""
    _encoded(text, what)
    if "\0" in text:
        raise ToolError(f"{what} {text!r} contains a NUL byte, which no path or argument can hold")
    return text


def _work_path(path: str) -> str:
    if not isinstance(path, str):
        raise ToolError(f"path must be a string, not {type(path).__name__}")
    return work_path(_no_nul(path, "path"))
