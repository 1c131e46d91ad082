"""`@tool`: a typed, documented Python function becomes a tool the model can call.

    @tool
    def calc(expression: str) -> str:
        '''Evaluate integer arithmetic.

        Args:
            expression: The expression, e.g. "37*48+12".
        '''

The signature's annotations give the JSON schema (through a pydantic model, which also
validates the model's arguments); the docstring gives the description and, from its Google-style
`Args:` section, one description per parameter. A parameter with no annotation or no
description is a definition error raised at import time, not a surprise at rollout time.

Two kinds of tool share the class, and it is the only tool system:
- host tools run in this process (sync functions in a worker thread, so a slow one never
  blocks the event loop);
- sandbox tools declare a parameter named `sandbox` and receive the episode's
  `agent_rl.sdk.sandbox.Sandbox`; it is injected, never part of the schema. The built-in ones
  (`python`, `shell`, `read_file`, `write_file`) are in `agent_rl.sdk.sandbox_tools`.
`@tool` also works on methods (`self` is bound when the tool is read from an instance).

A tool's arguments are validated once, here, by the model made from its signature; a tool may
return text, any JSON-able value, or an `ExecResult` (shown as the model should read it).

`run_tool_call` executes one parsed call and never raises for anything the model or the tool
did wrong: unknown tool, invalid arguments (a pydantic message the model can act on), a
`ToolError` or any other exception from the tool, a timeout: each becomes a `ToolResult` whose
`output` is the error observation and whose `error` is a `ToolErrorKind`, decided by what
happened (the exception's class), never by reading its message. Only `SandboxError` (the
infrastructure failed, which must not be scored as the model's fault) and cancellation
propagate.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import time
import traceback
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from agent_rl.kernel.errors import SandboxError, ToolArgumentsError, ToolError
from agent_rl.sdk.messages import ToolCall
from agent_rl.sdk.sandbox import ExecResult

SANDBOX_PARAM = "sandbox"
"""Name of the parameter through which sandbox tools receive the episode's sandbox."""


class ToolErrorKind(StrEnum):
    """Why a call failed, as recorded on its `ToolResult` (a str: it compares and stores as its
    value)."""

    UNKNOWN_TOOL = "unknown_tool"
    """The model named a tool the environment does not have."""
    INVALID_ARGUMENTS = "invalid_arguments"
    """The arguments did not fit the tool's schema (`ToolArgumentsError`); the tool never ran."""
    TOOL_ERROR = "tool_error"
    """The tool raised `ToolError`: a failure it reports to the model (a missing file)."""
    EXCEPTION = "exception"
    """The tool's code raised anything else (its traceback is kept, not shown)."""
    TIMEOUT = "timeout"
    """The call ran past the tool's `timeout_s`."""


class Tool:
    """A callable tool: name, description, JSON schema, validation, and the function itself."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float | None = None,
        max_output_chars: int = 8192,
    ) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        doc_summary, arg_docs = parse_docstring(inspect.getdoc(fn) or "")
        self.description = description or doc_summary
        if not self.description:
            raise TypeError(
                f"tool {self.name!r}: give it a docstring (its description for the model)"
            )
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.needs_sandbox = False
        self._is_method = False
        self._is_async = inspect.iscoroutinefunction(fn)
        self._bound: object | None = None
        fields: dict[str, Any] = {}
        for i, (pname, p) in enumerate(inspect.signature(fn).parameters.items()):
            if i == 0 and pname == "self":
                self._is_method = True
                continue
            if pname == SANDBOX_PARAM:
                self.needs_sandbox = True
                continue
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(
                    f"tool {self.name!r}: *args/**kwargs cannot be described to a model"
                )
            if p.annotation is inspect.Parameter.empty:
                raise TypeError(f"tool {self.name!r}: parameter {pname!r} needs a type annotation")
            if pname not in arg_docs:
                raise TypeError(
                    f"tool {self.name!r}: document parameter {pname!r} in the docstring's "
                    "Args: section"
                )
            default = ... if p.default is inspect.Parameter.empty else p.default
            fields[pname] = (p.annotation, Field(default, description=arg_docs[pname]))
        self.arguments_model: type[BaseModel] = create_model(  # type: ignore[call-overload]
            f"{self.name}_arguments",
            __config__=ConfigDict(extra="forbid"),
            __module__=getattr(fn, "__module__", __name__),
            **fields,
        )
        self.parameters: dict[str, Any] = _clean_schema(self.arguments_model.model_json_schema())
        self.parameters["additionalProperties"] = False

    def __repr__(self) -> str:
        kind = "sandbox" if self.needs_sandbox else "host"
        return f"<Tool {self.name} ({kind})>"

    def __get__(self, obj: object | None, owner: type | None = None) -> Tool:
        # `@tool` on a method: reading it from an instance gives a copy bound to that instance.
        if obj is None or not self._is_method:
            return self
        bound = object.__new__(Tool)
        bound.__dict__.update(self.__dict__)
        bound._bound = obj
        return bound

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema (what chat templates receive as `tools=`)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Arguments checked and converted by the schema (the one place they are); a
        ToolArgumentsError says, in one line, what to fix."""
        try:
            model = self.arguments_model.model_validate(dict(arguments))
        except ValidationError as e:
            problems = []
            for err in e.errors():
                where = ".".join(str(p) for p in err["loc"]) or "arguments"
                problems.append(f"{where}: {err['msg']}")
            raise ToolArgumentsError(
                f"invalid arguments for {self.name}: " + "; ".join(problems)
            ) from None
        return {k: getattr(model, k) for k in type(model).model_fields}

    async def __call__(self, arguments: Mapping[str, Any], *, sandbox: object | None = None) -> Any:
        """Validate and run; raises ToolArgumentsError for bad arguments and whatever the
        function raises."""
        values = self.validate(arguments)
        if self.needs_sandbox:
            if sandbox is None:
                raise ToolError(f"tool {self.name} needs a sandbox and the episode has none")
            values[SANDBOX_PARAM] = sandbox
        fn = functools.partial(self.fn, self._bound) if self._is_method else self.fn
        if self._is_async:
            return await fn(**values)
        return await anyio.to_thread.run_sync(
            functools.partial(fn, **values), abandon_on_cancel=True
        )


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
    max_output_chars: int = 8192,
) -> Any:
    """Make a `Tool` from a function; usable bare (`@tool`) or with options (`@tool(name=...)`)."""

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(
            f,
            name=name,
            description=description,
            timeout_s=timeout_s,
            max_output_chars=max_output_chars,
        )

    return wrap(fn) if fn is not None else wrap


class ToolResult(BaseModel):
    """One executed call: what the model sees (`output`) and what the store records."""

    call_id: str
    name: str
    arguments: dict[str, Any]
    raw_arguments: str | None = None
    """The arguments as the model wrote them (`ToolCall.raw_arguments`)."""
    output: str
    """The observation text given to the model (an `error: ...` line when the call failed)."""
    error: ToolErrorKind | None = None
    """Why the call failed; None when it succeeded."""
    traceback: str | None = None
    """Traceback of an exception raised by the tool's code (not shown to the model)."""
    started_at: float
    """Unix time the call started, for retroactive tracing spans."""
    duration_s: float


async def run_tool_call(
    tools: Mapping[str, Tool], call: ToolCall, *, sandbox: object | None = None
) -> ToolResult:
    """Execute one call; every failure the model or tool caused becomes the result's `output`."""
    started, t0 = time.time(), time.perf_counter()

    def done(output: str, error: ToolErrorKind | None = None, tb: str | None = None) -> ToolResult:
        return ToolResult(
            call_id=call.id, name=call.name, arguments=dict(call.arguments),
            raw_arguments=call.raw_arguments, output=output,
            error=error, traceback=tb, started_at=started, duration_s=time.perf_counter() - t0,
        )  # fmt: skip

    t = tools.get(call.name)
    if t is None:
        known = ", ".join(sorted(tools)) or "none"
        return done(
            f"error: unknown tool {call.name!r} (available: {known})", ToolErrorKind.UNKNOWN_TOOL
        )
    try:
        with anyio.fail_after(t.timeout_s):
            value = await t(call.arguments, sandbox=sandbox)
    except TimeoutError:
        return done(f"error: {t.name} timed out after {t.timeout_s:g}s", ToolErrorKind.TIMEOUT)
    except ToolArgumentsError as e:
        return done(f"error: {e}", ToolErrorKind.INVALID_ARGUMENTS)
    except ToolError as e:
        return done(f"error: {e}", ToolErrorKind.TOOL_ERROR)
    except SandboxError:
        raise
    except Exception as e:
        return done(
            f"error: {t.name} failed: {type(e).__name__}: {e}",
            ToolErrorKind.EXCEPTION,
            traceback.format_exc(),
        )
    if isinstance(value, ExecResult):
        return done(value.describe(max_chars=t.max_output_chars))
    return done(_truncate(_to_text(value), t.max_output_chars))


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {param: description}) from a Google-style docstring."""
    lines = doc.splitlines()
    description: list[str] = []
    args: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    arg_indent: int | None = None
    for line in lines:
        header = _SECTION.match(line)
        if header:
            section, current, arg_indent = header.group(1).lower(), None, None
            continue
        if section is None:
            description.append(line)
        elif section in ("args", "arguments", "parameters") and line.strip():
            indent = len(line) - len(line.lstrip())
            entry = _ARG.match(line.strip())
            if entry and (arg_indent is None or indent <= arg_indent):
                arg_indent, current = indent, entry.group(1)
                args[current] = entry.group(2).strip()
            elif current is not None:
                args[current] = (args[current] + " " + line.strip()).strip()
    paragraphs = re.split(r"\n\s*\n", "\n".join(description).strip())
    return "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip()), args


_SECTION = re.compile(
    r"^\s*(Args|Arguments|Parameters|Returns|Raises|Yields|Examples?|Notes?)\s*:\s*$"
)
_ARG = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _clean_schema(node: Any, *, in_properties: bool = False) -> Any:
    # pydantic adds a "title" to every schema; models only need names, types and descriptions.
    # Inside "properties" the keys are parameter names, so a parameter called "title" survives.
    if isinstance(node, dict):
        return {
            k: _clean_schema(v, in_properties=(k == "properties" and not in_properties))
            for k, v in node.items()
            if in_properties or not (k == "title" and isinstance(v, str))
        }
    if isinstance(node, list):
        return [_clean_schema(v) for v in node]
    return node


def _to_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n...[truncated {len(text) - limit} characters]"
