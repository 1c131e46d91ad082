"""The sandbox contract: what every backend (bubblewrap, Docker, rlimit) promises.

A `SandboxBackend` creates one `Sandbox` per episode from a `SandboxSpec`. The sandbox side of
the contract (`Sandbox`, `SandboxSpec`, `Mount`, `ExecResult`, `Limits`, `WORK_DIR`) is defined
by the SDK that programs against it (`agent_rl.sdk.sandbox`, read its docstring for the guarantees)
and re-exported here, so a backend finds its whole contract in this module.

Everything is async (anyio). Backends are safe to use from many tasks at once; one sandbox
serves one call at a time (calls on the same sandbox are serialized).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Protocol, runtime_checkable

from agent_rl.kernel.errors import ToolError
from agent_rl.sdk.sandbox import WORK_DIR, ExecResult, Limits, Mount, Sandbox, SandboxSpec

__all__ = [
    "WORK_DIR", "ExecResult", "Limits", "Mount", "Sandbox", "SandboxBackend", "SandboxSpec",
    "work_path",
]  # fmt: skip


@runtime_checkable
class SandboxBackend(Protocol):
    """A kind of isolation. Create it once per process; it owns every sandbox it creates."""

    name: str
    """'bwrap', 'docker' or 'rlimit'."""

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
