"""What every worker-served backend shares: its state dir, its live sandboxes, the create
sequence, and stopping a sandbox's host process.

A backend subclasses `WorkerBackend` and supplies `_new(spec)`: check the spec and return an
unstarted sandbox (nothing on the host yet). `create` then runs the one sequence every backend
needs: register the sandbox, build its host resources (`prepare`, in a worker thread), and start
its worker; if preparing fails, whatever was made is removed again and the failure is a
`SandboxError` (the infrastructure failed, not the model), so no half-made sandbox outlives it.
"""

from __future__ import annotations

import json
import os
import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Generic, TypeVar

import anyio
from anyio.abc import Process

from agent_rl.config import SandboxConfig
from agent_rl.kernel.errors import SandboxError
from agent_rl.sdk.sandbox import SandboxSpec
from tools_sandbox.ids import tool_uid
from tools_sandbox.session import WorkerSandbox

HERE = Path(__file__).resolve().parent

class PreparedSandbox(WorkerSandbox):
    """A worker sandbox with host resources made before its first start (work dir, cgroups)."""

    def __init__(self, backend: WorkerBackend[Any], sandbox_id: str, spec: SandboxSpec,
                 uid: int | None) -> None:
        super().__init__(sandbox_id, spec, backend._forget)
        self.uid = uid
        """The host uid the worker runs as (None: the backend's own, unprivileged)."""
        self.tool_uid: int = None if uid is None else tool_uid(uid)  # type: ignore[assignment]
        """The host uid (and gid) tool code runs as."""
        self.dir = backend.root / sandbox_id
        """The sandbox's state dir on the host."""

    @abstractmethod
    def prepare(self) -> None:
        """Make the host resources that outlive respawns (runs in a worker thread)."""

    def own(self, path: str) -> None:
        """`Sandbox.own`: the file belongs to tool code's uid and gid from now on."""
        os.chown(path, self.tool_uid, self.tool_uid)

    def _worker_pid(self) -> int | None:
        """The host process running worker.py under the sandbox's own uid (its real uid: only
        the worker and, on bubblewrap, the sandbox's init hold it)."""
        if self.uid is None:
            return None
        for name in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{name}/status") as f:
                    uid = next(int(x.split()[1]) for x in f if x.startswith("Uid:"))
                if uid != self.uid:
                    continue
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except (OSError, StopIteration, ValueError):
                continue
            if os.path.basename(argv[0]).startswith(b"python") and any(
                    a.endswith(b"/worker.py") for a in argv):  # (not bwrap's own processes)
                return int(name)
        return None


P = TypeVar("P", bound=PreparedSandbox)


class WorkerBackend(ABC, Generic[P]):
    """The `SandboxBackend` part every backend of worker-served sandboxes shares."""

    name: str

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.root = Path(config.state_dir) / self.name
        # sandbox uids must traverse (not list) the state dir to reach their own dirs
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o711)
        self._live: dict[str, P] = {}

    def install_worker(self) -> Path:
        """A copy of worker.py readable by every uid: the package itself may live in a private
        home dir that sandbox uids cannot read."""
        worker = self.root / "worker.py"
        shutil.copyfile(HERE / "worker.py", worker)
        worker.chmod(0o644)
        return worker

    @abstractmethod
    def _new(self, spec: SandboxSpec) -> P:
        """An unstarted sandbox for `spec`; raise SandboxError for a spec this backend refuses."""

    async def create(self, spec: SandboxSpec) -> P:
        """A started sandbox, ready for calls; raises SandboxError if it cannot start."""
        sandbox = self._new(spec)
        self._live[sandbox.id] = sandbox
        try:
            await anyio.to_thread.run_sync(sandbox.prepare)
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                await sandbox.close()
            if isinstance(e, Exception) and not isinstance(e, SandboxError):
                raise SandboxError(f"cannot prepare sandbox {sandbox.id}: {e}") from e
            raise
        await sandbox.start()
        return sandbox

    def _forget(self, sandbox_id: str) -> None:
        self._live.pop(sandbox_id, None)

    def live(self) -> int:
        """Sandboxes this backend has created and not yet closed."""
        return len(self._live)

    async def aclose(self) -> None:
        """Close every live sandbox."""
        for sandbox in list(self._live.values()):
            await sandbox.close()


async def stop_process(proc: Process | None) -> None:
    """SIGKILL a sandbox's host process if it still runs, and reap it (at most 5 s)."""
    if proc is None:
        return
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
    with anyio.move_on_after(5):
        await proc.wait()
    await proc.aclose()


def compact_json(obj: object) -> str:
    """JSON for a command-line argument (the worker's and launcher's settings)."""
    return json.dumps(obj, separators=(",", ":"))
