"""The built-in sandbox tools (`agent_rl.sdk.sandbox_tools`), in a real bubblewrap sandbox:
schemas, observations, model mistakes, each through the SDK's one tool path (`run_tool_call`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from agent_rl.sdk.messages import MalformedToolCall, ToolCall
from agent_rl.sdk.sandbox import Sandbox, SandboxSpec
from agent_rl.sdk.sandbox_tools import default_tools, python, python_repl
from agent_rl.sdk.tool_calls import parse_completion
from agent_rl.sdk.tools import Tool, ToolErrorKind, ToolResult, run_tool_call

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


async def call(sandbox: Sandbox, name: str, arguments: dict[str, object],
               tools: tuple[Tool, ...] | None = None) -> ToolResult:
    toolset = {t.name: t for t in tools or default_tools()}
    return await run_tool_call(toolset, ToolCall(id="c", name=name, arguments=arguments),
                               sandbox=sandbox)


def test_schemas_are_openai_functions() -> None:
    schemas = [t.schema() for t in default_tools()]
    names = [s["function"]["name"] for s in schemas]
    assert names == ["python", "shell", "read_file", "write_file"]
    for s in schemas:
        assert s["type"] == "function"
        params = s["function"]["parameters"]
        assert params["type"] == "object" and params["additionalProperties"] is False
        assert all("description" in p for p in params["properties"].values())
        json.dumps(s)
    python_params = schemas[0]["function"]["parameters"]
    assert python_params["required"] == ["code"]


async def test_python_shell_and_files(sandbox: Sandbox) -> None:
    out = await call(sandbox, "write_file", {"path": "a.txt", "content": "héllo"})
    assert out.error is None and "6 bytes" in out.output
    out = await call(sandbox, "shell", {"command": "wc -c < a.txt"})
    assert out.error is None and out.output.strip() == "6"
    out = await call(sandbox, "python", {"code": "print(open('a.txt').read())\n2 + 3"})
    assert out.error is None and out.output == "héllo\n[result]\n5"
    out = await call(sandbox, "read_file", {"path": "/work/a.txt"})
    assert out.error is None and out.output == "héllo"
    out = await call(sandbox, "read_file", {"path": "nope.txt"})
    assert out.error is ToolErrorKind.TOOL_ERROR and out.output.startswith("error:")


async def test_failures_are_described(sandbox: Sandbox) -> None:
    """What the model's code did wrong is the observation (the call itself succeeded), and the
    tool's `ExecResult` says so in its fields."""
    result = await python({"code": "1/0"}, sandbox=sandbox)
    assert not result.ok and "ZeroDivisionError" in result.describe()
    out = await call(sandbox, "python", {"code": "1/0"})
    assert out.error is None and "ZeroDivisionError" in out.output
    out = await call(sandbox, "shell", {"command": "sleep 10", "timeout": 0.5})
    assert out.error is None and "timed out" in out.output
    out = await call(sandbox, "shell", {"command": "exit 4"})
    assert out.error is None and "exit code 4" in out.output
    out = await call(sandbox, "shell", {"command": "yes"})
    assert "output truncated" in out.output


async def test_persistent_python_tool(sandbox: Sandbox) -> None:
    assert python_repl.name == "python"
    assert "persist" in python_repl.schema()["function"]["description"]
    assert "persist" not in python.schema()["function"]["description"]
    await call(sandbox, "python", {"code": "n = 10"}, (python_repl,))
    out = await call(sandbox, "python", {"code": "n * 2"}, (python_repl,))
    assert out.output == "[result]\n20"
    out = await call(sandbox, "python", {"code": "n * 2"}, (python,))
    assert "NameError" in out.output


async def test_model_mistakes_are_typed_errors(sandbox: Sandbox) -> None:
    out = await call(sandbox, "browser", {})
    assert out.error is ToolErrorKind.UNKNOWN_TOOL and "unknown tool" in out.output
    (bad_json,) = parse_completion(
        '<tool_call>{"name": "python", "arguments": "{not json"}</tool_call>'
    ).calls
    assert isinstance(bad_json, MalformedToolCall)
    out = await call(sandbox, "shell", {"cmd": "ls"})
    assert out.error is ToolErrorKind.INVALID_ARGUMENTS
    assert out.output == (
        "error: invalid arguments for shell: command: Field required; "
        "cmd: Extra inputs are not permitted"
    )
    out = await call(sandbox, "shell", {"command": "ls", "timeout": -1})
    assert out.error is ToolErrorKind.INVALID_ARGUMENTS
    assert out.output == (
        "error: invalid arguments for shell: timeout: Input should be greater than 0"
    )
    out = await call(sandbox, "write_file", {"path": "../../etc/x", "content": ""})
    assert out.error is ToolErrorKind.TOOL_ERROR and "leaves /work" in out.output
