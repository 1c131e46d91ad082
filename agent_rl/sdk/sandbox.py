"""The sandbox as environments see it: the contract every sandbox backend implements.

An episode's sandbox tools and verifiers run in a `Sandbox`, made by a backend from the env's
`SandboxSpec`. A sandbox runs commands and Python code with stdin and a timeout and returns an
`ExecResult` that always says what happened (exit code, captured output up to a cap, timed out,
output truncated, killed for memory, restarted). A misbehaving call is data, not an exception:
it costs one turn, and the next call in the same sandbox works, because a backend respawns its
sandbox when a call had to kill it; so is anything else the sandboxed code can cause (the pids,
memory or disk it exhausted, a worker it starved). Exceptions (`SandboxError`) are reserved for
the infrastructure failing, and for an answer that broke the protocol (the call then has no
result). `restart()` kills everything in the sandbox at once; verifiers run after it.

Files live in the sandbox's work dir (`/work` inside the sandbox), which survives a respawn;
`read_file`/`write_file` take paths relative to it (or absolute under `/work`) and refuse to
leave it. `close()` is idempotent and removes everything the sandbox owned.

A `SandboxBackend` (bubblewrap, Docker, rlimit: `tools_sandbox/`) creates one `Sandbox` per
episode from a `SandboxSpec`. Backends are safe to use from many tasks at once; one sandbox serves
one call at a time (calls on the same sandbox are serialized).

This module is the whole contract, and the only one: the SDK owns it and the backends implement
it, so environment code never depends on a backend and a backend finds everything it promises
here. `Limits` is the config's `[sandbox.limits]` class (the config, below the SDK, reads it from
TOML; it is defined there once and named `Limits` here).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from types import TracebackType
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, field_validator

from agent_rl.config import SandboxLimits
from agent_rl.kernel.errors import ToolError

WORK_DIR = "/work"
"""Where the work dir appears inside every sandbox."""


Limits = SandboxLimits
"""Resource limits of one sandbox; per-call timeouts may only lower `wall_s`. The config's
`[sandbox.limits]` class itself (one definition serves both)."""


class Mount(BaseModel):
    """A host path made visible inside the sandbox."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    source: str
    """Absolute host path."""

    target: str
    """Absolute path inside the sandbox (not under /work)."""

    read_only: bool = True
    """Mount read-only (the default; a writable mount lets the sandbox change the host)."""

    @field_validator("source", "target")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if not path.startswith("/"):
            raise ValueError(f"mount path {path!r} must be absolute")
        return path

    @field_validator("target")
    @classmethod
    def _not_in_work(cls, target: str) -> str:
        if target == WORK_DIR or target.startswith(WORK_DIR + "/"):
            raise ValueError(f"mount target {target!r} would hide or share the work dir")
        return target


class SandboxSpec(BaseModel):
    """What a sandbox looks like; sandboxes with equal specs are interchangeable (pooling key)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    limits: Limits = Limits()
    """Resource limits."""

    image: str | None = None
    """Docker image tag; None means the backend's own minimal Python image (built locally)."""

    rootfs: str | None = None
    """bubblewrap: a host directory to use, read-only, as the root filesystem (it must hold the
    `python` the worker runs); None shares the host's /usr read-only."""

    mounts: tuple[Mount, ...] = ()
    """Extra host paths to expose (bubblewrap, Docker); the system dirs are always read-only."""

    network: bool = False
    """Allow network access. Off by default; backends refuse to turn it on unless they can."""

    loopback: bool = False
    """Allow TCP/UDP sockets on the sandbox's own loopback only: its network namespace stays
    private (nothing outside it is reachable), but programs inside may listen on and connect
    to 127.0.0.1 (an agent command reaching the gateway through the relay it is given,
    `agent_rl.rollout.gateway_relay`). Implied by `network`."""

    @property
    def sockets(self) -> bool:
        """Internet socket families are allowed (`network` or `loopback`)."""
        return self.network or self.loopback

    env: tuple[tuple[str, str], ...] = ()
    """Extra environment variables (name, value) for every call; nothing leaks from the host.
    A dict is accepted too (stored sorted, so equal specs hash alike)."""

    @field_validator("env", mode="before")
    @classmethod
    def _env_from_dict(cls, env: object) -> object:
        return tuple(sorted(env.items())) if isinstance(env, dict) else env


class ExecResult(BaseModel):
    """Outcome of one call. Every failure mode is a field, never an exception."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    exit_code: int | None
    """Exit status (negative: killed by that signal); None when the call never produced one."""

    stdout: str = ""
    """Captured stdout, decoded as UTF-8 with replacement, at most `output_bytes`."""

    stderr: str = ""
    """Captured stderr, same rules."""

    timed_out: bool = False
    """The call ran past its timeout and was killed."""

    truncated: bool = False
    """The call wrote more than `output_bytes` and was killed."""

    oom_killed: bool = False
    """A process of the sandbox was killed for exceeding the memory limit during the call."""

    value: str | None = None
    """repr() of the value of the code's last expression (Python calls only), like a REPL; cut
    to the longest prefix whose JSON fits `output_bytes`."""

    restarted: bool = False
    """The sandbox had to be killed and was respawned; state outside /work was lost."""

    duration_s: float = 0.0
    """Wall time of the call as the host saw it."""

    @property
    def ok(self) -> bool:
        """The call finished by itself with exit code 0."""
        return self.exit_code == 0 and not (self.timed_out or self.truncated or self.oom_killed)

    def describe(self, max_chars: int | None = None) -> str:
        """The result as a model should read it: output first, then what went wrong (what a
        sandbox tool that returns an `ExecResult` shows as its observation). With `max_chars`,
        the output is cut to fit and what went wrong is kept."""
        parts = []
        if self.stdout:
            parts.append(self.stdout if not self.stderr else f"[stdout]\n{self.stdout}")
        if self.stderr:
            parts.append(f"[stderr]\n{self.stderr}")
        if self.value is not None:
            parts.append(f"[result]\n{self.value}")
        notes = []
        if self.timed_out:
            notes.append(f"timed out after {self.duration_s:.1f}s and was killed")
        if self.truncated:
            notes.append("wrote too much output and was killed; output truncated")
        if self.oom_killed:
            notes.append("ran out of memory and was killed")
        if self.restarted:
            notes.append(
                "the sandbox had to be restarted: files in /work are kept, the rest is lost"
            )
        if self.exit_code not in (0, None) and not notes:
            notes.append(f"exit code {self.exit_code}")
        body = "\n".join(p.rstrip("\n") for p in parts)
        tail = "[" + "; ".join(notes) + "]" if notes else ""
        if max_chars is not None and len(body) + len(tail) + 1 > max_chars:
            keep = max(0, max_chars - len(tail) - 1)
            body = body[:keep] + f"\n...[truncated {len(body) - keep} characters]"
        return "\n".join(p for p in (body, tail) if p) or "[no output]"


@runtime_checkable
class Sandbox(Protocol):
    """One isolated environment, usually one per episode."""

    @property
    def id(self) -> str:
        """Unique id, also used to name its host resources (cgroups, containers, dirs)."""
        ...

    @property
    def spec(self) -> SandboxSpec:
        """The spec it was created from."""
        ...

    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: str | bytes = b"",
        timeout: float | None = None,
    ) -> ExecResult:
        """Run a command (argv[0] looked up on the sandbox's PATH) in /work. `stdin` is fed up
        to the pipe's capacity (64 KiB); `timeout` may lower the spec's `wall_s`, never raise it."""
        ...

    async def run_python(
        self,
        code: str,
        *,
        stdin: str | bytes = b"",
        timeout: float | None = None,
        persistent: bool = False,
    ) -> ExecResult:
        """Run Python source. `persistent=True` runs it in the sandbox's REPL, whose globals
        survive across calls (until a call has to be killed); otherwise every call starts from a
        fresh, pre-imported interpreter. Threads a persistent call starts survive with the REPL
        but are stopped between its calls."""
        ...

    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """Bytes of a file in the work dir; raises ToolError if missing, outside it, not a
        regular file, or a path that cannot be encoded (NUL, lone surrogate)."""
        ...

    async def write_file(self, path: str, data: str | bytes) -> None:
        """Create or replace a file in the work dir (parents created); ToolError for a path or
        text that cannot be encoded (NUL, lone surrogate) or a path that is not a regular file."""
        ...

    def own(self, path: str) -> None:
        """Give the host file `path` (one that a mount exposes) to the uid the sandbox's code
        runs as, so that code may write to it: a socket it connects to, a file it fills."""
        ...

    async def run_verifier(
        self,
        program: str | Sequence[str],
        *,
        files: Mapping[str, str | bytes] | None = None,
        stdin: str | bytes = b"",
        timeout: float | None = None,
    ) -> ExecResult:
        """Run a verifier (Python source, or an argv) under the verifier's identity, which no
        process of tool code can signal, trace, open through /proc or renice (where the backend
        has two uids: bubblewrap, Docker, rlimit as root). `files` are written into the work dir
        first, by the verifier, readable by it alone (whatever tool code left at those paths is
        replaced). To run the policy's code, a Python verifier calls `run_as_tool(program,
        stdin=b"", timeout=10.0)` (a name in its globals), which runs it under tool code's ids
        and returns {"exit_code", "timed_out", "stdout", "stderr"}; an exec'd one finds the same
        service's socket fd in $AGENT_RL_TOOL_RUNNER (worker.py `tool_runner`). Run it after
        `restart()` (`agent_rl.sdk.rewards.run_json_program` does both), so that no process of
        tool code runs while the verifier reads its inputs."""
        ...

    async def restart(self) -> None:
        """Kill every process of tool code as a whole (atomic against forks, zombies and their
        threads included: its cgroup frozen and tool code's processes killed, keeping the worker,
        or the whole cgroup, pid namespace or container killed and started afresh) on the same
        work dir, so that nothing an earlier call started runs any more. Verifiers run after it
        (`agent_rl.sdk.rewards.run_json_program`). The REPL's globals are lost; raises
        SandboxError only when the fresh start fails."""
        ...

    async def close(self) -> None:
        """Kill everything and remove every host resource; safe to call twice."""
        ...

    async def __aenter__(self) -> Sandbox: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class SandboxBackend(Protocol):
    """A kind of isolation. Create it once per process; it owns every sandbox it creates."""

    name: str
    """Its name in `sandbox.backend` ('bwrap', 'docker', 'rlimit')."""

    async def create(self, spec: SandboxSpec) -> Sandbox:
        """A started sandbox, ready for calls; raises SandboxError if it cannot start."""
        ...

    async def reap(self) -> int:
        """Remove what sandboxes of this backend left behind (a crashed server's processes,
        cgroups, containers, dirs); returns how many sandboxes were reaped."""
        ...

    def live(self) -> int:
        """Sandboxes this backend has created and not yet closed."""
        ...

    async def aclose(self) -> None:
        """Close every live sandbox."""
        ...


def work_path(path: str) -> str:
    """`path` as a normalized path relative to /work; raises ToolError if it leaves /work.

    Only a lexical check: the worker inside the sandbox resolves symlinks again, and the sandbox
    cannot see anything outside its own filesystem anyway.
    """
    p = PurePosixPath(path)
    if p.is_absolute():
        try:
            p = p.relative_to(WORK_DIR)
        except ValueError:
            raise ToolError(f"path {path!r} is outside {WORK_DIR}: use a path inside it") from None
    parts: list[str] = []
    for part in p.parts:
        if part == "..":
            if not parts:
                raise ToolError(f"path {path!r} leaves {WORK_DIR}: remove the '..'")
            parts.pop()
        elif part not in (".", ""):
            parts.append(part)
    if not parts:
        raise ToolError(f"path {path!r} names the work dir itself, not a file")
    return "/".join(parts)
