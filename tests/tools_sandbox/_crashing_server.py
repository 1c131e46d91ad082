"""A stand-in server for test_reaper: starts sandboxes with calls in flight, then waits to be
killed. Prints one JSON line: the sandbox ids and host uids, once everything runs."""

from __future__ import annotations

import json
import sys

import anyio

from agent_rl.sdk.sandbox import SandboxSpec
from tools_sandbox.factory import make_backend

from .conftest import sandbox_config, small_limits


async def main(name: str) -> None:
    backend = make_backend(sandbox_config(name))
    spec = SandboxSpec(limits=small_limits(wall_s=600))
    sandboxes = [await backend.create(spec) for _ in range(3)]
    async with anyio.create_task_group() as tg:
        for sb in sandboxes:
            await sb.write_file("data.txt", "x" * 1000)
            tg.start_soon(sb.run_python, "import os, time\nif os.fork() == 0: os.setsid()\n"
                          "while True: time.sleep(1)")
        await anyio.sleep(1)  # the calls are running now
        print(json.dumps({"ids": [sb.id for sb in sandboxes],
                          "uids": [getattr(sb, "uid", None) for sb in sandboxes]}), flush=True)
        await anyio.sleep(3600)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
