"""The built-in tools an agent calls, each run in the episode's sandbox.

`python`, `shell`, `read_file` and `write_file`, each with an OpenAI-style function schema
(`tool.schema()`, `tool_schemas(...)`) for the environment SDK to put in the prompt, and an
async `run(sandbox, arguments)` that validates the model's arguments and returns a `ToolOutput`:
the text observation the model sees, plus the raw `ExecResult` for logging. What the tool code
did wrong (a crash, a timeout, a flood, running out of memory) is reported in the text: it costs
one turn. Malformed arguments from the model raise `ToolError`, which the episode runner records
as the model's mistake.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent_rl.kernel.errors import ToolError
from tools_sandbox.base import ExecResult, Sandbox


class ToolOutput(BaseModel):
    """What a tool call produced."""

    model_config = ConfigDict(extra="forbid")

    text: str
    """The observation shown to the model."""

    ok: bool
    """The call succeeded (exit code 0, no timeout, flood or OOM; file operations: no error)."""

    result: ExecResult | None = None
    """The sandbox's result, for calls that ran code."""


TIMEOUT_HELP = "Seconds before the call is killed."


class Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PythonArgs(Args):
    code: str = Field(description="Python source to run; the value of a final expression is shown.")
    timeout: float | None = Field(default=None, gt=0, description=TIMEOUT_HELP)


class ShellArgs(Args):
    command: str = Field(description="A /bin/sh command line, run in the work dir /work.")
    timeout: float | None = Field(default=None, gt=0, description=TIMEOUT_HELP)


class ReadFileArgs(Args):
    path: str = Field(description="Path of the file, relative to /work or absolute under /work.")


class WriteFileArgs(Args):
    path: str = Field(description="Path of the file, relative to /work or absolute under /work.")
    content: str = Field(description="The whole new content of the file.")


class SandboxTool(ABC):
    """Base of the built-in tools: a name, a description and an argument model."""

    name: ClassVar[str]
    description: ClassVar[str]
    args: ClassVar[type[Args]]

    def schema(self) -> dict[str, Any]:
        """The OpenAI `tools` entry for this tool."""
        params = self.args.model_json_schema()
        params.pop("title", None)
        for prop in params.get("properties", {}).values():
            prop.pop("title", None)
        return {"type": "function",
                "function": {"name": self.name, "description": self.description,
                             "parameters": params}}

    def parse(self, arguments: str | dict[str, Any]) -> Any:
        """Validate the model's arguments (a JSON string or a dict); ToolError if malformed."""
        try:
            raw = json.loads(arguments) if isinstance(arguments, str) else arguments
            return self.args.model_validate(raw)
        except (ValueError, ValidationError) as e:
            raise ToolError(f"bad arguments for tool {self.name!r}: {e}") from e

    @abstractmethod
    async def run(self, sandbox: Sandbox, arguments: str | dict[str, Any]) -> ToolOutput:
        """Validate `arguments`, run the tool in `sandbox`, describe the outcome."""


def describe(r: ExecResult) -> str:
    """An ExecResult as the model should read it: output first, then what went wrong."""
    parts = []
    if r.stdout:
        parts.append(r.stdout if not r.stderr else f"[stdout]\n{r.stdout}")
    if r.stderr:
        parts.append(f"[stderr]\n{r.stderr}")
    if r.value is not None:
        parts.append(f"[result]\n{r.value}")
    notes = []
    if r.timed_out:
        notes.append(f"timed out after {r.duration_s:.1f}s and was killed")
    if r.truncated:
        notes.append("wrote too much output and was killed; output truncated")
    if r.oom_killed:
        notes.append("ran out of memory and was killed")
    if r.restarted:
        notes.append("the sandbox had to be restarted: files in /work are kept, the rest is lost")
    if r.exit_code not in (0, None) and not notes:
        notes.append(f"exit code {r.exit_code}")
    if notes:
        parts.append("[" + "; ".join(notes) + "]")
    return "\n".join(p.rstrip("\n") for p in parts) or "[no output]"


class PythonTool(SandboxTool):
    name = "python"
    description = ("Run Python 3 code in the sandbox and return its stdout, stderr and the value "
                   "of its last expression. Files live in /work.")
    args = PythonArgs

    def __init__(self, *, persistent: bool = False) -> None:
        self.persistent = persistent
        """Keep globals across calls (a REPL) instead of a fresh interpreter per call."""
        if persistent:
            self.description += " Variables persist across calls."

    async def run(self, sandbox: Sandbox, arguments: str | dict[str, Any]) -> ToolOutput:
        a = self.parse(arguments)
        r = await sandbox.run_python(a.code, timeout=a.timeout, persistent=self.persistent)
        return ToolOutput(text=describe(r), ok=r.ok, result=r)


class ShellTool(SandboxTool):
    name = "shell"
    description = "Run a shell command in the sandbox (work dir /work) and return its output."
    args = ShellArgs

    async def run(self, sandbox: Sandbox, arguments: str | dict[str, Any]) -> ToolOutput:
        a = self.parse(arguments)
        r = await sandbox.exec(["/bin/sh", "-c", a.command], timeout=a.timeout)
        return ToolOutput(text=describe(r), ok=r.ok, result=r)


class ReadFileTool(SandboxTool):
    name = "read_file"
    description = "Read a text file from the sandbox's work dir /work."
    args = ReadFileArgs

    def __init__(self, *, max_bytes: int = 64 * 1024) -> None:
        self.max_bytes = max_bytes

    async def run(self, sandbox: Sandbox, arguments: str | dict[str, Any]) -> ToolOutput:
        a = self.parse(arguments)
        try:
            data = await sandbox.read_file(a.path, max_bytes=self.max_bytes + 1)
        except ToolError as e:
            return ToolOutput(text=f"[error] {e}", ok=False)
        text = data[: self.max_bytes].decode("utf-8", "replace")
        if len(data) > self.max_bytes:
            text += f"\n[file truncated at {self.max_bytes} bytes]"
        return ToolOutput(text=text or "[empty file]", ok=True)


class WriteFileTool(SandboxTool):
    name = "write_file"
    description = "Create or overwrite a file in the sandbox's work dir /work."
    args = WriteFileArgs

    async def run(self, sandbox: Sandbox, arguments: str | dict[str, Any]) -> ToolOutput:
        a = self.parse(arguments)
        try:
            await sandbox.write_file(a.path, a.content)
        except ToolError as e:
            return ToolOutput(text=f"[error] {e}", ok=False)
        return ToolOutput(text=f"wrote {len(a.content.encode())} bytes to {a.path}", ok=True)


def default_tools(*, persistent_python: bool = False) -> list[SandboxTool]:
    """python, shell, read_file, write_file."""
    return [PythonTool(persistent=persistent_python), ShellTool(), ReadFileTool(), WriteFileTool()]


def tool_schemas(tools: list[SandboxTool]) -> list[dict[str, Any]]:
    """The OpenAI `tools` list for a request."""
    return [t.schema() for t in tools]


async def call_tool(
    sandbox: Sandbox, tools: list[SandboxTool], name: str, arguments: str | dict[str, Any]
) -> ToolOutput:
    """Run the tool called `name`; ToolError if there is none or its arguments are malformed."""
    for tool in tools:
        if tool.name == name:
            return await tool.run(sandbox, arguments)
    raise ToolError(f"unknown tool {name!r}: available are {[t.name for t in tools]}")
