"""The built-in tools, in a real bubblewrap sandbox: schemas, observations, model mistakes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from agent_rl.kernel.errors import ToolError
from tools_sandbox.base import Sandbox, SandboxSpec
from tools_sandbox.tools import PythonTool, call_tool, default_tools, tool_schemas

from .conftest import backend_or_skip, small_limits

pytestmark = pytest.mark.anyio


@pytest.fixture
async def sandbox() -> AsyncIterator[Sandbox]:
    backend = backend_or_skip("bwrap")
    try:
        async with await backend.create(SandboxSpec(limits=small_limits(wall_s=3))) as sb:
            yield sb
    finally:
        await backend.aclose()


def test_schemas_are_openai_functions() -> None:
    schemas = tool_schemas(default_tools())
    names = [s["function"]["name"] for s in schemas]
    assert names == ["python", "shell", "read_file", "write_file"]
    for s in schemas:
        assert s["type"] == "function"
        params = s["function"]["parameters"]
        assert params["type"] == "object" and params["additionalProperties"] is False
        assert all("description" in p for p in params["properties"].values())
        json.dumps(s)
    python = schemas[0]["function"]["parameters"]
    assert python["required"] == ["code"]


async def test_python_shell_and_files(sandbox: Sandbox) -> None:
    tools = default_tools()
    out = await call_tool(sandbox, tools, "write_file", {"path": "a.txt", "content": "héllo"})
    assert out.ok and "6 bytes" in out.text
    out = await call_tool(sandbox, tools, "shell", json.dumps({"command": "wc -c < a.txt"}))
    assert out.ok and out.text.strip() == "6"
    out = await call_tool(sandbox, tools, "python", {"code": "print(open('a.txt').read())\n2 + 3"})
    assert out.ok and out.text == "héllo\n[result]\n5"
    out = await call_tool(sandbox, tools, "read_file", {"path": "/work/a.txt"})
    assert out.ok and out.text == "héllo"
    out = await call_tool(sandbox, tools, "read_file", {"path": "nope.txt"})
    assert not out.ok and out.text.startswith("[error]")


async def test_failures_are_described(sandbox: Sandbox) -> None:
    tools = default_tools()
    out = await call_tool(sandbox, tools, "python", {"code": "1/0"})
    assert not out.ok and "ZeroDivisionError" in out.text
    out = await call_tool(sandbox, tools, "shell", {"command": "sleep 10", "timeout": 0.5})
    assert not out.ok and "timed out" in out.text
    out = await call_tool(sandbox, tools, "shell", {"command": "exit 4"})
    assert not out.ok and "exit code 4" in out.text
    out = await call_tool(sandbox, tools, "shell", {"command": "yes"})
    assert "output truncated" in out.text


async def test_persistent_python_tool(sandbox: Sandbox) -> None:
    repl = PythonTool(persistent=True)
    assert "persist" in repl.schema()["function"]["description"]
    await repl.run(sandbox, {"code": "n = 10"})
    out = await repl.run(sandbox, {"code": "n * 2"})
    assert out.text == "[result]\n20"


async def test_model_mistakes_raise_tool_error(sandbox: Sandbox) -> None:
    tools = default_tools()
    with pytest.raises(ToolError, match="unknown tool"):
        await call_tool(sandbox, tools, "browser", {})
    with pytest.raises(ToolError, match="bad arguments"):
        await call_tool(sandbox, tools, "python", "{not json")
    with pytest.raises(ToolError, match="bad arguments"):
        await call_tool(sandbox, tools, "shell", {"cmd": "ls"})
    out = await call_tool(sandbox, tools, "write_file", {"path": "../../etc/x", "content": ""})
    assert not out.ok and "leaves /work" in out.text
