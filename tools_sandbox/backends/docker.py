"""The production backend: one Docker container per episode, served by the persistent worker.

Each container runs worker.py as its main process (under docker-init) with no network
(`network_mode="none"`), a read-only root, a sized private /tmp (with an inode limit) and
/dev/shm, memory limit = memory+swap limit, a pids limit, a CPU quota (`limits.cpus`),
no-new-privileges and every capability dropped but CAP_SETUID/CAP_SETGID: the container starts
as root only for the worker to take its two host uids (its own, and tool code's as effective
uid) and drop those too before it serves (worker.py `become`). The worker then loads the same
seccomp filter as bubblewrap's on top of Docker's profile, and /proc/cmdline (the host's boot
arguments) is masked along with Docker's default masked paths. /work is a sized tmpfs with an
inode limit mounted on the host and bound in, so it survives the container being replaced. The
worker talks to the server over a unix socket the server listens on, in a small per-sandbox
tmpfs mounted read-only at /sbx (its own mount, so no host path shows in the container's
mountinfo; the engine must run on this host); output is capped by the worker and every answer
is bounded by the server, never read whole with `exec_run`. No image is pulled: the default
image is imported from this host's Python (tools_sandbox.image). Containers carry labels naming
the sandbox and the server process that owns it, which is how `reap` finds what a crashed
server left.
"""

from __future__ import annotations

import socket
from functools import partial
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import SocketListener

from agent_rl.config import SandboxConfig
from agent_rl.kernel.errors import SandboxError
from agent_rl.sdk.sandbox import WORK_DIR, SandboxSpec
from tools_sandbox import hostfs, seccomp
from tools_sandbox.backend import HERE, PreparedSandbox, WorkerBackend, compact_json
from tools_sandbox.cgroups import freeze_kill, process_cgroup
from tools_sandbox.ids import UidPool, new_id, owner_alive, owner_tag
from tools_sandbox.image import ensure_image
from tools_sandbox.session import Channel, worker_config

PREFIX = "dk-"
LABEL = "agent-rl.sandbox"
OWNER = "agent-rl.owner"
HOST = "agent-rl.host"


class DockerSandbox(PreparedSandbox):
    def __init__(
        self, backend: DockerBackend, sandbox_id: str, spec: SandboxSpec, uid: int
    ) -> None:
        super().__init__(backend, sandbox_id, spec, uid)
        self.backend = backend
        self.sbx = self.dir / "sbx"
        self.container: Any = None
        self.listener: SocketListener | None = None
        self.generation = 0

    def labels(self) -> dict[str, str]:
        return {LABEL: self.id, OWNER: self.backend.owner, HOST: socket.gethostname()}

    def prepare(self) -> None:
        """The socket dir and the work dir: they outlive container replacements."""
        self.dir.mkdir()
        (self.dir / "owner").write_text(self.backend.owner)
        self.dir.chmod(0o755)
        hostfs.mount_tmpfs(self.sbx, 1, 0, 0, mode=0o755)
        for name, source in (("worker.py", self.backend.worker),
                             ("seccomp.bpf", self.backend.filter_path(self.spec.sockets))):
            (self.sbx / name).write_bytes(source.read_bytes())
            (self.sbx / name).chmod(0o644)
        # a host tmpfs, bind-mounted: a tmpfs volume would be emptied with each container
        hostfs.mount_tmpfs(self.dir / "work", self.spec.limits.disk_mb, self.tool_uid,
                           self.tool_uid)

    def _run_container(self, sock_name: str) -> Any:
        import docker.types

        spec, lim = self.spec, self.spec.limits
        ids = {"worker": [self.uid, self.uid], "tool": [self.tool_uid, self.tool_uid]}
        conf = worker_config(spec, WORK_DIR, connect=f"/sbx/{sock_name}", ids=ids,
                             seccomp="/sbx/seccomp.bpf")
        mounts = [docker.types.Mount(WORK_DIR, str(self.dir / "work"), type="bind"),
                  docker.types.Mount("/sbx", str(self.sbx), type="bind", read_only=True)]
        mounts += [docker.types.Mount(m.target, m.source, type="bind", read_only=m.read_only)
                   for m in spec.mounts]
        ulimits = [docker.types.Ulimit(name="nofile", soft=lim.nofile, hard=lim.nofile),
                   docker.types.Ulimit(name="core", soft=0, hard=0)]
        api = self.backend.client.api
        host_config = api.create_host_config(
            init=True, network_mode="bridge" if spec.network else "none",
            mem_limit=lim.memory_mb << 20, memswap_limit=lim.memory_mb << 20,
            pids_limit=lim.pids, nano_cpus=int(lim.cpus * 1e9), read_only=True,
            cap_drop=["ALL"], cap_add=["SETUID", "SETGID"], security_opt=["no-new-privileges"],
            tmpfs={"/tmp": f"size={lim.tmp_mb}m,nr_inodes={hostfs.inodes(lim.tmp_mb)},mode=1777"},
            shm_size=lim.tmp_mb << 20, mounts=mounts, ulimits=ulimits,
        )
        host_config["MaskedPaths"] = self.backend.masked_paths  # the SDK has no argument for it
        created = api.create_container(
            spec.image or self.backend.image,
            [self.backend.config.python, "-I", "/sbx/worker.py", compact_json(conf)],
            name=f"{self.id}-{self.generation}", user="0:0", working_dir="/",
            environment=conf["env"], labels=self.labels(), hostname="sandbox",
            host_config=host_config,
        )
        container = self.backend.client.containers.get(created["Id"])
        try:
            container.start()
        except Exception:
            _remove_container(container)
            raise
        return container

    async def _spawn(self) -> Channel:
        self.generation += 1
        sock_name = f"w{self.generation}.sock"
        path = self.sbx / sock_name
        self.listener = await anyio.create_unix_listener(path, mode=0o666)
        self.container = await anyio.to_thread.run_sync(self._run_container, sock_name)
        stream = await self.listener.accept()
        await self.listener.aclose()  # one connection per container: nobody else may attach
        self.listener = None
        path.unlink(missing_ok=True)
        return Channel(stream, stream)

    async def _kill(self) -> None:
        if self.listener is not None:
            await self.listener.aclose()
            self.listener = None
        container, self.container = self.container, None
        if container is not None:
            await anyio.to_thread.run_sync(partial(_remove_container, container))

    def _oom_kills(self) -> int:
        return 0  # the worker reads the container's own memory cgroup and reports OOM kills

    async def _kill_tool_code(self) -> bool:
        """The container's cgroup frozen and tool code's processes killed (`freeze_kill`),
        where this host sees them and may freeze it (the engine on this host, cgroup v2 or the
        unified hierarchy, root); otherwise the container is replaced."""
        pid = self._worker[0] if self._worker else None
        if pid is None or self.uid is None:
            return False
        group = await anyio.to_thread.run_sync(process_cgroup, pid)
        if group is None:
            return False
        return await anyio.to_thread.run_sync(freeze_kill, group, self.tool_uid, self.uid)

    async def _diagnostics(self) -> str:
        container = self.container
        if container is None:
            return ""
        try:
            logs = await anyio.to_thread.run_sync(partial(container.logs, tail=20))
            return logs.decode("utf-8", "replace").strip()[-2000:]
        except Exception as e:  # the container may already be gone; the log is only a hint
            return f"(no logs: {e})"

    async def _destroy(self) -> None:
        await anyio.to_thread.run_sync(self.backend.remove_leftovers_of, self.id)
        self.backend.uids.give_back(self.uid)


def _default_masked_paths(client: Any, image: str) -> list[str]:
    """The paths this engine masks in a container by default (asked of an engine, not copied
    from one: setting MaskedPaths replaces them). Reads them off a created, never started one."""
    host_config = client.api.create_host_config(network_mode="none")
    created = client.api.create_container(image, ["true"], host_config=host_config,
                                          labels={LABEL: "masked-paths-probe"})
    try:
        return list(client.api.inspect_container(created["Id"])["HostConfig"]["MaskedPaths"] or [])
    finally:
        client.api.remove_container(created["Id"], force=True)


def _remove_container(container: Any) -> None:
    import docker.errors

    try:
        container.remove(force=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as e:
        if "already in progress" not in str(e):
            raise SandboxError(f"cannot remove container {container.name}: {e}") from e


class DockerBackend(WorkerBackend[DockerSandbox]):
    """Creates Docker sandboxes through a local engine (DOCKER_HOST or sandbox.docker_host)."""

    name = "docker"

    def __init__(self, config: SandboxConfig) -> None:
        try:
            import docker
        except ImportError as e:
            raise SandboxError("the docker backend needs the docker SDK: pip install "
                               "'agent-rl[docker]'") from e
        try:
            self.client = (docker.DockerClient(base_url=config.docker_host, timeout=60)
                           if config.docker_host else docker.from_env(timeout=60))
            self.client.ping()
        except docker.errors.DockerException as e:
            raise SandboxError(
                f"no Docker engine reachable ({e}); start one (.ci/start-dockerd.sh) and set "
                "DOCKER_HOST or sandbox.docker_host, or use sandbox.backend = 'bwrap'") from e
        self.image = config.docker_image or ensure_image(self.client)
        super().__init__(config)
        self.worker = HERE / "worker.py"
        self.owner = owner_tag()
        self.uids = UidPool(config.uid_base + 200_000)
        self.history: set[str] = set()
        self._filters = {
            net: seccomp.write_filter(self.root / f"seccomp{'-net' * net}.bpf", network=net)
            for net in (False, True)
        }
        self.masked_paths = [*_default_masked_paths(self.client, self.image), "/proc/cmdline"]

    def filter_path(self, network: bool) -> Path:
        return self._filters[network]

    def _new(self, spec: SandboxSpec) -> DockerSandbox:
        if spec.rootfs:
            raise SandboxError(
                "spec.rootfs is for the bwrap backend; Docker sandboxes use spec.image")
        sandbox = DockerSandbox(self, new_id(PREFIX), spec, self.uids.take())
        self.history.add(sandbox.id)
        return sandbox

    def remove_leftovers_of(self, sandbox_id: str) -> None:
        """Remove the containers (all generations) and the dir of one sandbox."""
        for c in self.client.containers.list(all=True, filters={"label": f"{LABEL}={sandbox_id}"}):
            _remove_container(c)
        hostfs.remove_tree(self.root / sandbox_id)

    def _orphans(self) -> set[str]:
        me = socket.gethostname()
        found: dict[str, str] = {}
        for c in self.client.containers.list(all=True, filters={"label": LABEL}):
            if c.labels.get(HOST) == me:
                found[c.labels[LABEL]] = c.labels.get(OWNER, "")
        for d in self.root.iterdir():
            if d.is_dir() and d.name.startswith(PREFIX):
                owner = d / "owner"
                found[d.name] = owner.read_text() if owner.exists() else ""
        return {i for i, owner in found.items() if i not in self._live and not owner_alive(owner)}

    async def reap(self) -> int:
        """Remove containers, mounts and dirs of sandboxes whose server (on this host) is gone."""
        def sync() -> int:
            orphans = self._orphans()
            for sandbox_id in orphans:
                self.remove_leftovers_of(sandbox_id)
            return len(orphans)

        return await anyio.to_thread.run_sync(sync)

    def leftovers(self) -> list[str]:
        """Containers of sandboxes this backend created that still exist."""
        return [f"container {c.name}" for c in self.client.containers.list(
            all=True, filters={"label": LABEL}) if c.labels.get(LABEL) in self.history]
