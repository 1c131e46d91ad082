"""The gateway from inside a sandbox: an agent command run in its episode's sandbox reaches the
gateway through one unix socket it is given, and nothing else.

The sandbox keeps its private network namespace (no route to the host or anywhere), with TCP on
its own loopback allowed (`SandboxSpec.loopback`), and gets its episode's relay directory
mounted read-only at `SOCKET_DIR`. Two relays join the ends:

- `UnixRelay`, in serve, one per episode: a unix socket server whose every connection is piped
  to the gateway's TCP address (`Gateway.base_url`). The socket is the only thing in its
  directory and belongs to the sandbox's code uid (`Sandbox.own`): a user namespace may write
  (connect) only to files of a uid it maps.
- `SANDBOX_RUNNER`, inside the sandbox (stdlib Python, run by `Sandbox.run_python`): listens on
  the sandbox's own 127.0.0.1:`SANDBOX_PORT` and pipes every connection to that socket, then runs
  the agent command with `OPENAI_BASE_URL=http://127.0.0.1:SANDBOX_PORT/agents/{key}/v1`, the
  task's JSON on stdin, and exits with its status; its stdout is the agent's result.

Requests keep the gateway's rules: the episode's key is its API key and its path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

SOCKET_DIR = "/agent-rl-gateway"
"""Where the relay directory appears inside the sandbox: at the root, whose directories every
uid of the sandbox may traverse (bubblewrap makes a missing parent such as /run its worker's
alone, mode 0700)."""
SOCKET_NAME = "gateway.sock"
SANDBOX_PORT = 8399
"""The port the in-sandbox relay listens on (the sandbox's own loopback: no clash possible)."""
CHUNK = 65536


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()


class UnixRelay:
    """A unix socket in a directory of its own whose connections are piped to a TCP address."""

    def __init__(self, base_url: str) -> None:
        url = urlsplit(base_url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.dir = Path(tempfile.mkdtemp(prefix="agent-rl-gateway-"))
        self.path = self.dir / SOCKET_NAME
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> UnixRelay:
        self._server = await asyncio.start_unix_server(self._relay, path=str(self.path))
        # The sandbox's code runs as a uid of its own: it must traverse the directory; the
        # socket itself is then given to that uid (Sandbox.own).
        self.dir.chmod(0o755)
        self.path.chmod(0o600)
        return self

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        shutil.rmtree(self.dir, ignore_errors=True)


SANDBOX_RUNNER = r'''
import json, os, socket, subprocess, sys, threading

ARGS = json.loads(ARGS_JSON)

def pipe(a, b):
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    finally:
        try:
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass

def serve(listener):
    while True:
        conn, _ = listener.accept()
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.connect(ARGS["socket"])
        except OSError as e:
            print(f"agent-rl: cannot reach the gateway's socket {ARGS['socket']}: {e}", file=sys.stderr)
            conn.close()
            continue
        for a, b in ((conn, up), (up, conn)):
            threading.Thread(target=pipe, args=(a, b), daemon=True).start()

listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", ARGS["port"]))
listener.listen(64)
threading.Thread(target=serve, args=(listener,), daemon=True).start()
env = {**os.environ, **ARGS["env"]}
try:
    done = subprocess.run(ARGS["argv"], stdin=sys.stdin, env=env)
except OSError as e:
    print(f"agent-rl: cannot run the agent command {ARGS['argv']}: {e}", file=sys.stderr)
    sys.exit(127)
sys.exit(done.returncode)
'''


def sandbox_runner(argv: Sequence[str], key: str, env: Mapping[str, str]) -> str:
    """The Python source that runs `argv` inside the sandbox against the gateway (see the module
    docstring): `env` plus OPENAI_BASE_URL and OPENAI_API_KEY (and ANTHROPIC_BASE_URL and
    ANTHROPIC_API_KEY, for Anthropic's client) for the episode `key`."""
    base_url = f"http://127.0.0.1:{SANDBOX_PORT}/agents/{key}/v1"
    args = {"argv": list(argv), "port": SANDBOX_PORT, "socket": f"{SOCKET_DIR}/{SOCKET_NAME}",
            "env": {**env, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": key,
                    "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": key}}  # fmt: skip
    return f"ARGS_JSON = {json.dumps(json.dumps(args))}\n" + SANDBOX_RUNNER
