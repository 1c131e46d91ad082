"""What only the bubblewrap backend promises: its own root filesystem, host uid, cgroups,
seccomp, and no trace of the server inside."""

from __future__ import annotations

import os
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent_rl.sdk.sandbox import SandboxSpec
from tools_sandbox.backends.bwrap import BwrapBackend
from tools_sandbox.image import build_rootfs

from .conftest import backend_or_skip, small_limits
from .helpers import real_uid, worker_pid

pytestmark = pytest.mark.anyio
SPEC = SandboxSpec(limits=small_limits())


@pytest.fixture
async def bwrap() -> AsyncIterator[BwrapBackend]:
    backend = backend_or_skip("bwrap")
    assert isinstance(backend, BwrapBackend)
    yield backend
    await backend.aclose()


async def test_host_uid_cgroups_and_limits(bwrap: BwrapBackend) -> None:
    async with await bwrap.create(SPEC) as sb:
        pids = sb.cgroup.pids()  # type: ignore[attr-defined]
        assert pids, "the sandbox's processes are not in its cgroup"
        assert {real_uid(str(p)) for p in pids} == {sb.uid}  # type: ignore[attr-defined]
        with open(f"/proc/{worker_pid(sb)}/status") as f:
            uids = next(line.split()[1:4] for line in f if line.startswith("Uid:"))
        assert uids == [str(sb.uid), str(sb.tool_uid), str(sb.uid)]  # type: ignore[attr-defined]
        mem = Path(sb.cgroup.dirs[0])  # type: ignore[attr-defined]
        limit_file = "memory.max" if bwrap.layout.v2 else "memory.limit_in_bytes"
        assert int((mem / limit_file).read_text()) == SPEC.limits.memory_mb << 20
        cpu = [Path(d) for d in sb.cgroup.dirs if "cpu" in Path(d).parts]  # type: ignore[attr-defined]
        if bwrap.layout.v2:
            assert (mem / "cpu.max").read_text().split() == ["100000", "100000"]
        elif cpu:
            assert int((cpu[0] / "cpu.cfs_quota_us").read_text()) == 100_000  # limits.cpus = 1
        r = await sb.run_python(
            "import os, socket\n"
            "print(os.getresuid(), os.path.exists('/sys/class/net'))\n"
            "try:\n    print(open('/proc/1/environ').read().split('\\0'))\n"
            "except OSError as e:\n    print('environ', e.errno)\n"
            "try:\n    socket.socket(socket.AF_INET)\n"
            "except OSError as e:\n    print('inet', e.errno)\n"
            "s = socket.socket(socket.AF_UNIX); print('unix ok')")
        lines = r.stdout.splitlines()
        assert lines[0] == "(1001, 1001, 1001) False"  # tool code's uid, not the worker's; no /sys
        assert lines[1] == "environ 13"  # pid 1 (bwrap) is the worker's uid: out of reach
        assert lines[2] == "inet 97" and lines[3] == "unix ok"  # EAFNOSUPPORT from seccomp


@pytest.mark.slow
async def test_own_root_filesystem(bwrap: BwrapBackend, tmp_path: Path) -> None:
    """A spec's rootfs replaces the host's /usr: here the Docker image's minimal tree."""
    tar = tmp_path / "rootfs.tar"
    build_rootfs(tar)
    root = Path("/tmp") / f"agent-rl-test-rootfs-{os.getpid()}"
    with tarfile.open(tar) as t:
        t.extractall(root, filter="fully_trusted")
    root.chmod(0o755)
    try:
        async with await bwrap.create(SandboxSpec(limits=small_limits(), rootfs=str(root))) as sb:
            r = await sb.exec(["sh", "-c", "ls /usr/bin | wc -l; ls /"])
            assert r.ok, r
            count, *top = r.stdout.split()
            assert int(count) < len(os.listdir("/usr/bin"))  # not the host's /usr
            assert "sbx" in top  # a directory only that image has
            assert (await sb.run_python("import json; json.dumps([1])")).value == "'[1]'"
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
