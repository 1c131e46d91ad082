"""The built-in sandbox tools: `python`, `python_repl`, `shell`, `read_file`, `write_file`.

Each is an ordinary `@tool` whose `sandbox` parameter receives the episode's sandbox, so its
schema, its one validation of the model's arguments and its error observations are the SDK's
(`agent_rl.sdk.tools`), like any tool an environment writes. Put them in an env's `tools`:

    from agent_rl.sdk.sandbox_tools import python_repl
    class MathEnv(Env):
        tools = (python_repl,)

What the model's code did (a crash, a timeout, a flood, running out of memory) is the tool's
observation (`ExecResult.describe()`): it costs one turn and is not an error of the call. A
file tool's path outside /work or a missing file raises `ToolError`, so the call is recorded
with the kind `tool_error`. `python` starts a fresh interpreter per call; `python_repl` (also
named "python" for the model) keeps its globals across calls.
"""

from __future__ import annotations

from pydantic import PositiveFloat

from agent_rl.sdk.sandbox import ExecResult, Sandbox
from agent_rl.sdk.tools import Tool, tool

READ_MAX_BYTES = 64 * 1024
"""Bytes of a file `read_file` shows; a longer file is cut with a note saying so."""


@tool
async def python(code: str, sandbox: Sandbox, timeout: PositiveFloat | None = None) -> ExecResult:
    """Run Python 3 code in the sandbox and return its stdout, stderr and the value of its last
    expression. Files live in /work.

    Args:
        code: Python source to run; the value of a final expression is shown.
        timeout: Seconds before the call is killed.
    """
    return await sandbox.run_python(code, timeout=timeout)


@tool(name="python")
async def python_repl(
    code: str, sandbox: Sandbox, timeout: PositiveFloat | None = None
) -> ExecResult:
    """Run Python 3 code in the sandbox and return its stdout, stderr and the value of its last
    expression. Files live in /work. Variables persist across calls.

    Args:
        code: Python source to run; the value of a final expression is shown.
        timeout: Seconds before the call is killed.
    """
    return await sandbox.run_python(code, timeout=timeout, persistent=True)


@tool
async def shell(command: str, sandbox: Sandbox, timeout: PositiveFloat | None = None) -> ExecResult:
    """Run a shell command in the sandbox (work dir /work) and return its output.

    Args:
        command: A /bin/sh command line, run in the work dir /work.
        timeout: Seconds before the call is killed.
    """
    return await sandbox.exec(["/bin/sh", "-c", command], timeout=timeout)


@tool
async def read_file(path: str, sandbox: Sandbox) -> str:
    """Read a text file from the sandbox's work dir /work.

    Args:
        path: Path of the file, relative to /work or absolute under /work.
    """
    data = await sandbox.read_file(path, max_bytes=READ_MAX_BYTES + 1)
    text = data[:READ_MAX_BYTES].decode("utf-8", "replace")
    if len(data) > READ_MAX_BYTES:
        text += f"\n[file truncated at {READ_MAX_BYTES} bytes]"
    return text or "[empty file]"


@tool
async def write_file(path: str, content: str, sandbox: Sandbox) -> str:
    """Create or overwrite a file in the sandbox's work dir /work.

    Args:
        path: Path of the file, relative to /work or absolute under /work.
        content: The whole new content of the file.
    """
    await sandbox.write_file(path, content)
    return f"wrote {len(content.encode())} bytes to {path}"


def default_tools(*, persistent_python: bool = False) -> tuple[Tool, ...]:
    """python (or python_repl), shell, read_file, write_file."""
    return (python_repl if persistent_python else python, shell, read_file, write_file)
