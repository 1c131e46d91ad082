"""The Docker backend's default image, built locally from this host's Python: no pulls.

A minimal root filesystem is assembled from the host: the system `python3`, its standard
library (without tests, IDLE, tkinter and the like), `/bin/sh` and a few coreutils for the
shell tool, and the shared libraries all of them load (found with `ldd`), laid out as on the
host (merged-/usr symlinks included). It is `docker import`ed as `agent-rl-sandbox:py-<hash>`,
where the hash covers the file list, the host's files and this builder's source, so it is built
once per host and rebuilt when either changes. About 20 MB; it takes a few seconds.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from agent_rl.kernel.errors import SandboxError

REPOSITORY = "agent-rl-sandbox"
BUILD_VERSION = "1"
"""Bump when the image's contents change for reasons the hash cannot see."""

TOOLS = ("sh", "ls", "cat", "echo", "wc", "head", "tail", "sleep", "mkdir", "rm", "cp", "mv",
         "env", "df", "grep", "sed", "sort", "uniq", "id", "touch", "true", "false", "tr", "cut",
         "find", "xargs", "date", "dirname", "basename", "chmod", "ln", "pwd", "du", "test",
         "timeout", "tee", "diff")
STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
               "config-3.11-x86_64-linux-gnu", "site-packages", "dist-packages"}


def host_python() -> Path:
    """The system interpreter the image is made from (the venv's may live in a home dir)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate):
            return Path(os.path.realpath(candidate))
    raise SandboxError("no system python3 in /usr/bin or /usr/local/bin to build the image from")


def _libraries(binaries: list[Path]) -> set[Path]:
    libs: set[Path] = set()
    for chunk in range(0, len(binaries), 64):
        out = subprocess.run(["ldd", *map(str, binaries[chunk:chunk + 64])], capture_output=True,
                             text=True).stdout
        libs |= {Path(m) for m in re.findall(r"(/\S+\.so[.\d]*)", out)}
    return {lib for lib in libs if lib.exists()}


def root_files() -> tuple[Path, list[Path]]:
    """The interpreter and every host file the image holds."""
    python = host_python()
    stdlib = Path(subprocess.run([str(python), "-I", "-c", "import sysconfig; print("
                                  "sysconfig.get_paths()['stdlib'])"], capture_output=True,
                                 text=True, check=True).stdout.strip())
    files: list[Path] = [python]
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = [d for d in dirs if d not in STDLIB_SKIP]
        files += [Path(root) / n for n in names]
    tools = [Path(p) for t in TOOLS if (p := shutil.which(t, path="/usr/bin:/bin"))]
    extensions = [f for f in files if f.suffix == ".so"]
    files += tools
    files += _libraries([python, *tools, *extensions])
    return python, sorted(set(files))


def image_tag(files: list[Path]) -> str:
    h = hashlib.sha256(BUILD_VERSION.encode() + Path(__file__).read_bytes())
    for f in files:
        st = f.stat()
        h.update(f"{f}:{st.st_size}:{int(st.st_mtime)}\n".encode())
    return f"{REPOSITORY}:py-{h.hexdigest()[:12]}"


def _add(tar: tarfile.TarFile, path: Path, added: set[str]) -> None:
    """Add `path` as the host has it: the symlinks on the way to it (merged /usr), then the file."""

    def where(p: Path) -> str:  # p's location once the symlinks among its parents are followed
        return (Path(os.path.realpath(p.parent)) / p.name).as_posix().lstrip("/")

    def link(p: Path) -> None:
        if where(p) not in added:
            added.add(where(p))
            info = tarfile.TarInfo(where(p))
            info.type, info.linkname = tarfile.SYMTYPE, os.readlink(p)
            tar.addfile(info)

    for parent in reversed(path.parents):
        if parent.is_symlink():
            link(parent)
    if path.is_symlink():
        link(path)
        _add(tar, Path(os.path.realpath(path)), added)
    elif where(path) not in added:
        added.add(where(path))
        tar.add(path, arcname=where(path), recursive=False)


def build_rootfs(out: Path) -> None:
    python, files = root_files()
    added: set[str] = set()
    with tarfile.open(out, "w") as tar:
        for d in ("tmp", "work", "sbx", "etc", "proc", "dev", "sys"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        for top in ("/bin", "/sbin", "/lib", "/lib64"):  # merged /usr: /bin/sh must resolve
            if os.path.islink(top):
                _add(tar, Path(top), added)
        for f in files:
            _add(tar, f, added)
        for name in ("/usr/bin/python3", "/usr/bin/python"):
            if name.lstrip("/") not in added:
                info = tarfile.TarInfo(name.lstrip("/"))
                info.type, info.linkname = tarfile.SYMTYPE, str(python)
                tar.addfile(info)
        passwd = b"root:x:0:0::/root:/bin/sh\nnobody:x:65534:65534::/work:/bin/sh\n"
        info = tarfile.TarInfo("etc/passwd")
        info.size, info.mode = len(passwd), 0o644
        tar.addfile(info, io.BytesIO(passwd))


def ensure_image(client: Any) -> str:
    """The default image's tag, importing it first if this engine does not have it."""
    import docker.errors

    _, files = root_files()
    tag = image_tag(files)
    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    with tempfile.TemporaryDirectory(prefix="agent-rl-image-") as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        build_rootfs(rootfs)
        repo, version = tag.split(":")
        try:
            client.api.import_image_from_file(str(rootfs), repository=repo, tag=version)
            client.images.get(tag)
        except docker.errors.DockerException as e:
            raise SandboxError(f"cannot import the sandbox image {tag}: {e}") from e
    return tag


if __name__ == "__main__":  # python -m tools_sandbox.image: build into the DOCKER_HOST engine
    import docker

    print(ensure_image(docker.from_env()), file=sys.stdout)
