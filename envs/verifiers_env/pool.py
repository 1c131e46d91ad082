"""Long-lived verifiers env servers (`runner.py serve`) and the episodes serve sends them.

A server imports verifiers and loads the environment once, then runs many episodes at once,
each on a connection of its own (one JSON line each way, runner.py's `EnvServer`); an
episode's model calls still go to its own gateway endpoint, whose URL and key travel in the
request. A `Pool` is the servers that back one configuration in this process, shared by every
episode of it (an env is made per episode, its servers are not): the ones it starts (with the
verifiers environment's Python, on a unix socket in a private folder, stopped when this
process exits: they also leave when their stdin closes) and the ones it is given by address
(`unix:PATH` or `HOST:PORT`, started by someone else). Each episode goes to the least loaded
server, ties in turn.

A server that dies takes its running episodes with it: each ends with an `EnvError` naming
the server and how it ended (its exit status and the end of its log, for one of ours), and
the next episode restarts it (ours) or connects again (one given by address). An episode
cancelled here (its deadline, serve stopping) closes its connection, which cancels it there.
"""

from __future__ import annotations

import atexit
import itertools
import json
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import anyio
import anyio.abc

from agent_rl.kernel.errors import EnvError

START_TIMEOUT_S = 300.0
"""A server imports verifiers and loads the env before it listens (seconds on a busy CPU)."""
REFUSED = 2
"""runner.py's exit status for a configuration it refuses (its last line says why)."""
LOG_KEPT = 4_000
"""Characters of a dead server's log kept in its episodes' cause."""


@dataclass
class Life:
    """One run of a server: its address and, for one of ours, its process and log."""

    address: str
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def ended(self) -> str:
        """How it ended: the exit status and the end of the log of ours."""
        if self.process is None:
            return "its connection closed (it stopped or restarted)"
        try:
            status = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            status = None
        how = ("it is still running" if status is None else
               f"killed by signal {-status}" if status < 0 else f"exit status {status}")  # fmt: skip
        tail = self.log.read_text(errors="replace")[-LOG_KEPT:].strip() if self.log else ""
        return f"{how}; its log ends:\n{tail}" if tail else how


class Server:
    """One env server: started (and restarted) here, or reached at a given address."""

    def __init__(self, name: str, address: str | None = None,
                 command: Sequence[str] = (), environ: dict[str, str] | None = None) -> None:  # fmt: skip
        self.name = name
        self.command = list(command)
        self.environ = environ
        self.running = 0
        self.life: Life | None = None if self.command else Life(str(address))
        self._folders: list[Path] = []
        self._lock = threading.Lock()

    def describe(self, life: Life | None = None) -> str:
        life = life or self.life
        pid = f" (pid {life.process.pid})" if life and life.process else ""
        where = f" at {life.address}" if life and life.address else ""
        return f"verifiers env server {self.name}{pid}{where}"

    def ensure(self) -> Life:
        """A live run: ours is (re)started if it is not running (blocking: call it in a
        worker thread)."""
        with self._lock:
            life = self.life
            if life is not None and (life.process is None or life.process.poll() is None):
                return life
            self.life = self._start()
            return self.life

    def _start(self) -> Life:
        folder = Path(tempfile.mkdtemp(prefix="agent-rl-verifiers-"))  # private: mode 0700
        self._folders.append(folder)
        log = folder / "server.log"
        with log.open("wb") as out:
            # A session of its own: a SIGTERM or Ctrl-C to serve's process group (a supervisor
            # stopping it) must not end the server before serve's running episodes finish; it
            # leaves with serve (its stdin closes) or when the pool is closed.
            process = subprocess.Popen([*self.command, f"unix:{folder / 'server.sock'}"],
                                       env=self.environ, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=out,
                                       start_new_session=True)  # fmt: skip
        assert process.stdout is not None
        life = Life("", process, log)
        try:
            life.address = json.loads(_readline(process.stdout, START_TIMEOUT_S))["listening"]
        except (ValueError, KeyError, TypeError):
            _stop(process)
            refusal = log.read_text(errors="replace").strip().splitlines()[-1:]
            if process.returncode == REFUSED and refusal and refusal[0].startswith("refused:"):
                raise EnvError(f"{self.describe(life)}: {refusal[0]}") from None
            raise EnvError(f"{self.describe(life)} did not start: {life.ended()}") from None
        return life

    def stop(self) -> None:
        with self._lock:
            if self.life is not None and self.life.process is not None:
                _stop(self.life.process)
                self.life = None
            for folder in self._folders:
                shutil.rmtree(folder, ignore_errors=True)
            self._folders.clear()

    def request(self, request: dict[str, Any], timeout: float = START_TIMEOUT_S) -> dict[str, Any]:
        """One request answered (blocking; for listing tasks and health, not for episodes)."""
        life = self.ensure()
        try:
            with _connect_blocking(life.address, timeout) as sock:
                sock.sendall(json.dumps(request).encode() + b"\n")
                line = sock.makefile("rb").readline()
        except OSError as e:
            raise EnvError(f"{self.describe(life)}: {e}") from e
        if not line:
            raise EnvError(f"{self.describe(life)} closed the connection: {life.ended()}")
        return json.loads(line)

    async def episode(self, request: dict[str, Any]) -> dict[str, Any]:
        """The answer to one episode's request. Cancelled, it closes the connection, which
        cancels the episode in the server."""
        life = self.life  # a running one is used as is, without a worker thread's hop
        if life is None or (life.process is not None and life.process.poll() is not None):
            life = await anyio.to_thread.run_sync(self.ensure)
        self.running += 1
        try:
            try:
                stream = await _connect(life.address)
            except OSError as e:
                raise EnvError(f"{self.describe(life)} cannot be reached: {e}") from e
            async with stream:
                await stream.send(json.dumps(request).encode() + b"\n")
                line = await _receive_line(stream)
        except (anyio.BrokenResourceError, OSError) as e:
            raise EnvError(f"{self.describe(life)} failed during the episode: {e}") from e
        finally:
            self.running -= 1
        if not line:
            why = await anyio.to_thread.run_sync(life.ended)
            raise EnvError(f"{self.describe(life)} died during the episode: {why}")
        return json.loads(line)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Pool:
    """The servers backing one configuration (see the module docstring)."""

    def __init__(self, servers: list[Server]) -> None:
        self.servers = servers
        self._turn = itertools.count()

    def pick(self) -> Server:
        """The least loaded server; among equals, the next in turn."""
        start = next(self._turn) % len(self.servers)
        ordered = self.servers[start:] + self.servers[:start]
        return min(ordered, key=lambda s: s.running)

    def close(self) -> None:
        for server in self.servers:
            server.stop()


_pools: dict[tuple[Any, ...], Pool] = {}
_pools_lock = threading.Lock()


def pool(key: tuple[Any, ...], command: Sequence[str], environ: dict[str, str], count: int,
         addresses: Sequence[str]) -> Pool:  # fmt: skip
    """This process's pool for `key`: `count` servers started with `command` (the address is
    appended) and one per address in `addresses`."""
    with _pools_lock:
        found = _pools.get(key)
        if found is None:
            servers = [Server(f"{i + 1}/{count}", command=command, environ=environ)
                       for i in range(count)]  # fmt: skip
            for address in addresses:
                if not address.startswith("unix:"):
                    _split(address)
                servers.append(Server(address, address=address))
            found = _pools[key] = Pool(servers)
        return found


def close_pools() -> None:
    """Stop every server this process started."""
    with _pools_lock:
        for p in _pools.values():
            p.close()
        _pools.clear()


atexit.register(close_pools)


def _readline(stream: IO[bytes], timeout: float) -> bytes:
    """A line of a child's stdout, or b"" if it closes or `timeout` passes first."""
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return out[0] if out else b""


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise EnvError(f"verifiers env server address {address!r}: write unix:PATH or HOST:PORT")
    return host, int(port)


def _connect_blocking(address: str, timeout: float) -> socket.socket:
    if address.startswith("unix:"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(address[5:])
        return sock
    return socket.create_connection(_split(address), timeout=timeout)


async def _connect(address: str) -> anyio.abc.SocketStream:
    if address.startswith("unix:"):
        return await anyio.connect_unix(address[5:])
    host, port = _split(address)
    return await anyio.connect_tcp(host, port)


async def _receive_line(stream: anyio.abc.SocketStream) -> bytes:
    chunks = []
    while True:
        try:
            chunk = await stream.receive()
        except anyio.EndOfStream:
            return b"".join(chunks)
        chunks.append(chunk)
        if chunk.endswith(b"\n"):
            return b"".join(chunks)
