"""The built-in sandbox tools (`agent_rl.sdk.sandbox_tools`) as an env holds them, in a real
sandbox."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from agent_rl.sdk.messages import ToolCall
from agent_rl.sdk.sandbox import Sandbox, SandboxSpec
from agent_rl.sdk.sandbox_tools import default_tools
from agent_rl.sdk.tools import ToolErrorKind, run_tool_call

pytestmark = pytest.mark.anyio
Create = Callable[[SandboxSpec | None], Awaitable[Sandbox]]


async def test_all_four_tools_run_in_the_episode_sandbox(sandbox_backend: Create) -> None:
    tools = {t.name: t for t in default_tools(persistent_python=True)}
    assert sorted(tools) == ["python", "read_file", "shell", "write_file"]
    assert all(t.needs_sandbox for t in tools.values())
    schema = tools["write_file"].schema()["function"]["parameters"]
    assert schema["required"] == ["path", "content"] and "title" not in str(schema)
    sandbox = await sandbox_backend(None)

    async def call(name: str, **arguments: object) -> str:
        call = ToolCall(id="c", name=name, arguments=arguments)
        return (await run_tool_call(tools, call, sandbox=sandbox)).output

    assert "wrote 5 bytes" in await call("write_file", path="notes.txt", content="hello")
    assert await call("read_file", path="notes.txt") == "hello"
    assert await call("shell", command="wc -c < notes.txt") == "5"
    assert await call("python", code="open('notes.txt').read().upper()") == "[result]\n'HELLO'"
    assert "outside /work" in await call("read_file", path="/etc/passwd")
    assert await call("shell") == "error: invalid arguments for shell: command: Field required"
    no_sandbox = await run_tool_call(
        tools, ToolCall(id="c", name="shell", arguments={"command": "ls"})
    )
    assert no_sandbox.error == "tool_error" and "needs a sandbox" in no_sandbox.output
    assert no_sandbox.error is ToolErrorKind.TOOL_ERROR
