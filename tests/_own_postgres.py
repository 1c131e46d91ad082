"""A PostgreSQL server of a test's own, to restart (or cut off) while the store uses it.

`own_postgres()` runs the machine's PostgreSQL binaries (`pg_config --bindir`, else the newest
`/usr/lib/postgresql/*/bin`): initdb in a temporary directory, then a server on a free loopback
port with trust authentication. initdb refuses to run as root, so under root the server runs as
the `postgres` user (the temporary directory is handed to it). Without the binaries the tests
that need it skip locally and fail in CI (CI=true), like the other PostgreSQL tests.

`CommitCutter` is a TCP proxy in front of it that can forward a client's COMMIT to the server
and then drop the connection before the answer comes back: the one fault a real server does not
produce on demand (a connection lost after the commit happened, before the client knew).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent_rl.engine.launcher import free_port  # outside the ephemeral range: restarts rebind it


def _bindir() -> Path:
    try:
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True)
        if (Path(out.stdout.strip()) / "initdb").exists():
            return Path(out.stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    if not found:
        message = "no PostgreSQL server binaries (initdb, pg_ctl) on this machine"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return Path(found[-1]).parent


@dataclass
class OwnPostgres:
    bindir: Path
    data: Path
    port: int
    user: str | None
    """The OS user the server runs as (None: this process's)."""

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/agent_rl"

    def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        options = (f"-p {self.port} -k {self.data.parent} -c listen_addresses=127.0.0.1 "
                   "-c fsync=off -c max_connections=100")
        return subprocess.run(
            [str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.data.parent / "log"),
             "-o", options, "-w", "-t", "60", *args],
            user=self.user, capture_output=True, text=True, check=check,
        )

    def stop(self, mode: str = "fast") -> None:
        self.ctl("stop", "-m", mode)

    def start(self) -> None:
        self.ctl("start")

    def restart(self, mode: str = "fast", down_s: float = 0.0) -> None:
        """Stop the server (`fast`: every connection is terminated; `immediate`: as a crash),
        stay down `down_s` seconds, start it again."""
        self.stop(mode)
        time.sleep(down_s)
        self.start()


@contextmanager
def own_postgres() -> Iterator[OwnPostgres]:
    """A fresh server with an empty database `agent_rl`, removed afterwards."""
    bindir = _bindir()
    user = "postgres" if os.geteuid() == 0 else None
    root = Path(tempfile.mkdtemp(prefix="agent-rl-pg-"))
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    server = OwnPostgres(bindir, root / "data", free_port(), user)
    try:
        subprocess.run(
            [str(bindir / "initdb"), "-D", str(server.data), "-U", "postgres", "--auth=trust",
             "--encoding=UTF8", "--no-locale", "--no-sync"],
            user=user, capture_output=True, text=True, check=True,
        )
        server.start()
        subprocess.run(
            [str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(server.port), "-U", "postgres",
             "agent_rl"], user=user, capture_output=True, text=True, check=True,
        )
        yield server
    finally:
        server.ctl("stop", "-m", "immediate", check=False)
        shutil.rmtree(root, ignore_errors=True)


class CommitCutter:
    """A loopback TCP proxy to `port`. While `armed`, the first client message that is a
    COMMIT is forwarded (or, with `forward=False`, swallowed), and `hold_s` later (the server
    has committed, or still waits) both sides of that connection are closed without an answer;
    then it disarms."""

    def __init__(self, port: int, hold_s: float = 0.3) -> None:
        self.target, self.hold_s = port, hold_s
        self.forward = True
        self.armed = False
        self.cut = 0
        """Connections cut after a forwarded COMMIT."""
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, database: str = "agent_rl") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            cutting = threading.Event()  # this connection's COMMIT was forwarded: relay nothing
            for args in ((client, server, True, cutting), (server, client, False, cutting)):
                threading.Thread(target=self._pipe, args=args, daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, from_client: bool,
              cutting: threading.Event) -> None:
        try:
            while data := src.recv(65536):
                # A simple-protocol Query message ('Q', length, text) saying COMMIT.
                commit = from_client and self.armed and data[:1] == b"Q" and b"COMMIT" in data
                if commit:
                    self.armed = False
                    self.cut += 1
                    cutting.set()
                if cutting.is_set() and not from_client:
                    return  # the server's answer to the COMMIT never reaches the client
                if not commit or self.forward:
                    dst.sendall(data)
                if commit:
                    time.sleep(self.hold_s)
                    return
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
