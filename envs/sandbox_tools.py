"""Sandbox tools shared by the built-in sandbox environments (python-math, code-tests).

`python` runs code in the episode's sandbox (`tools_sandbox.base.Sandbox.run_python`) in its
persistent interpreter, so variables survive from one call to the next like a notebook
(ReTool-style code interpreter). What the model sees: stdout, then stderr, then a line for
each way the call went wrong (timeout, output cap, memory, a restart that lost the variables);
the value of a trailing expression when nothing was printed; `(no output)` otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent_rl.tools import tool

if TYPE_CHECKING:
    from tools_sandbox.base import ExecResult, Sandbox


def describe_run(res: ExecResult) -> str:
    """An ExecResult as the observation text a model reads."""
    parts = [p.rstrip("\n") for p in (res.stdout, res.stderr) if p.strip()]
    if not parts and res.value is not None and res.value != "None":
        parts.append(res.value)
    if res.timed_out:
        parts.append("error: timed out")
    if res.truncated:
        parts.append("error: too much output; the call was stopped")
    if res.oom_killed:
        parts.append("error: out of memory")
    if res.restarted:
        parts.append("note: the interpreter was restarted; earlier variables are gone")
    return "\n".join(parts) or "(no output)"


@tool
async def python(code: str, sandbox: Sandbox) -> str:
    """Run Python code in a sandboxed interpreter that keeps variables between calls.

    Args:
        code: Python source; print what you want to see.
    """
    return describe_run(await sandbox.run_python(code, persistent=True))
