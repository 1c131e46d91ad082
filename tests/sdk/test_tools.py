"""`@tool`: schemas from signatures and docstrings, validation messages, execution outcomes."""

from __future__ import annotations

import time
from typing import Annotated, Literal

import pytest
from pydantic import AfterValidator

from agent_rl.kernel.errors import SandboxError, ToolArgumentsError, ToolError
from agent_rl.sdk.messages import ToolCall
from agent_rl.sdk.tools import (
    Tool,
    ToolErrorKind,
    ToolResult,
    parse_docstring,
    run_tool_call,
    tool,
)

pytestmark = pytest.mark.anyio


@tool
def add(a: int, b: int = 2, mode: Literal["plain", "words"] = "plain") -> str:
    """Add two integers.

    Longer explanation that
    spans lines.

    Args:
        a: The first
            addend.
        b (int): The second addend.
        mode: How to write the sum.

    Returns:
        The sum as text.
    """
    return str(a + b) if mode == "plain" else f"the sum is {a + b}"


def test_schema_comes_from_signature_and_docstring() -> None:
    fn = add.schema()["function"]
    assert fn["name"] == "add"
    assert fn["description"] == "Add two integers.\n\nLonger explanation that spans lines."
    params = fn["parameters"]
    assert params["type"] == "object" and params["additionalProperties"] is False
    assert params["required"] == ["a"]
    assert params["properties"]["a"] == {"type": "integer", "description": "The first addend."}
    assert params["properties"]["b"]["default"] == 2
    assert params["properties"]["mode"]["enum"] == ["plain", "words"]
    assert "title" not in str(params)


def test_parameter_named_title_survives_schema_cleaning() -> None:
    @tool
    def note(title: str) -> str:
        """Write a note.

        Args:
            title: Its title.
        """
        return title

    assert note.parameters["properties"]["title"] == {"type": "string", "description": "Its title."}


def test_definition_errors_are_raised_at_decoration() -> None:
    with pytest.raises(TypeError, match="type annotation"):

        @tool
        def untyped(x) -> str:  # type: ignore[no-untyped-def]
            """Doc.

            Args:
                x: An x.
            """
            return ""

    with pytest.raises(TypeError, match="document parameter 'y'"):

        @tool
        def undocumented(y: int) -> str:
            """Doc without args."""
            return ""

    with pytest.raises(TypeError, match="docstring"):
        tool(lambda: "")


def test_validation_error_is_a_message_the_model_can_act_on() -> None:
    with pytest.raises(ToolError) as e:
        add.validate({"b": "x", "extra": 1})
    msg = str(e.value)
    assert msg.startswith("invalid arguments for add: ")
    assert (
        "a: Field required" in msg
        and "b: " in msg
        and "extra: Extra inputs are not permitted" in msg
    )
    assert add.validate({"a": "3"}) == {"a": 3, "b": 2, "mode": "plain"}  # lax coercion of "3"


async def test_run_tool_call_outcomes() -> None:
    @tool
    def boom(x: int) -> str:
        """Raise.

        Args:
            x: Ignored.
        """
        raise ValueError("kaput")

    @tool
    def refuse(x: int) -> str:
        """Refuse politely.

        Args:
            x: Ignored.
        """
        raise ToolError("x must be even")

    @tool(timeout_s=0.05)
    async def slow(x: int) -> str:
        """Sleep.

        Args:
            x: Ignored.
        """
        import anyio

        await anyio.sleep(5)
        return "late"

    tools = {t.name: t for t in (add, boom, refuse, slow)}
    ok = await run_tool_call(tools, ToolCall(id="c0", name="add", arguments={"a": 1, "b": 2}))
    assert (ok.output, ok.error, ok.call_id) == ("3", None, "c0") and ok.duration_s >= 0

    unknown = await run_tool_call(tools, ToolCall(id="c1", name="mul", arguments={}))
    assert (
        unknown.error == "unknown_tool" and "available: add, boom, refuse, slow" in unknown.output
    )

    bad = await run_tool_call(tools, ToolCall(id="c2", name="add", arguments={}))
    assert bad.error == "invalid_arguments" and bad.output.startswith(
        "error: invalid arguments for add"
    )

    raised = await run_tool_call(tools, ToolCall(id="c3", name="boom", arguments={"x": 1}))
    assert raised.error == "exception" and raised.output == "error: boom failed: ValueError: kaput"
    assert raised.traceback is not None and "kaput" in raised.traceback

    refused = await run_tool_call(tools, ToolCall(id="c4", name="refuse", arguments={"x": 1}))
    assert (refused.error, refused.output) == ("tool_error", "error: x must be even")

    t0 = time.perf_counter()
    late = await run_tool_call(tools, ToolCall(id="c5", name="slow", arguments={"x": 1}))
    assert late.error == "timeout" and time.perf_counter() - t0 < 2


VALIDATED: list[int] = []


def counted(n: int) -> int:
    """A validator that records each run (module level: the annotation names it as text)."""
    VALIDATED.append(n)
    return n


async def test_arguments_are_validated_once_with_one_clear_error() -> None:
    """One validation per call (a validator that counts its runs), and a bad argument gives one
    one-line error observation, not a second wording of the same mistake."""
    runs = VALIDATED
    runs.clear()

    @tool
    async def double(n: Annotated[int, AfterValidator(counted)], sandbox: object) -> int:
        """Double a number in the sandbox.

        Args:
            n: The number.
        """
        return 2 * n

    tools = {"double": double}
    ok = await run_tool_call(
        tools, ToolCall(id="c", name="double", arguments={"n": 4}), sandbox="s"
    )
    assert (ok.output, runs) == ("8", [4])
    bad = await run_tool_call(
        tools, ToolCall(id="c", name="double", arguments={"n": "four"}), sandbox="s"
    )
    assert bad.error is ToolErrorKind.INVALID_ARGUMENTS and runs == [4]
    assert bad.output == (
        "error: invalid arguments for double: n: Input should be a valid integer, unable to "
        "parse string as an integer"
    )
    with pytest.raises(ToolArgumentsError) as e:
        double.validate({})
    assert isinstance(e.value, ToolError) and str(e.value).count("invalid arguments") == 1


async def test_error_kinds_are_typed_by_what_happened_not_by_the_message() -> None:
    """A tool's own ToolError whose text looks like an argument error is still `tool_error`,
    and every kind is a `ToolErrorKind` (equal to the string the store records)."""

    @tool
    def mimic(x: int) -> str:
        """Fail with a misleading message.

        Args:
            x: Ignored.
        """
        raise ToolError("invalid arguments, said the tool itself")

    @tool
    def picky(x: int) -> str:
        """Refuse its arguments in its own words, as a typed argument error.

        Args:
            x: Must be even.
        """
        raise ToolArgumentsError(f"x must be even, not {x}")

    tools = {t.name: t for t in (mimic, picky)}
    mimicked = await run_tool_call(tools, ToolCall(id="c", name="mimic", arguments={"x": 1}))
    assert mimicked.error is ToolErrorKind.TOOL_ERROR and mimicked.error == "tool_error"
    refused = await run_tool_call(tools, ToolCall(id="c", name="picky", arguments={"x": 1}))
    assert refused.error is ToolErrorKind.INVALID_ARGUMENTS
    assert refused.output == "error: x must be even, not 1"
    unknown = await run_tool_call(tools, ToolCall(id="c", name="nope", arguments={}))
    assert unknown.error is ToolErrorKind.UNKNOWN_TOOL
    stored = ToolResult.model_validate_json(mimicked.model_dump_json())
    assert stored.error is ToolErrorKind.TOOL_ERROR


async def test_sandbox_tools_get_the_episode_sandbox_and_sandbox_errors_propagate() -> None:
    @tool
    async def whoami(sandbox: object, loud: bool = False) -> str:
        """Name the sandbox.

        Args:
            loud: Shout.
        """
        if sandbox == "broken":
            raise SandboxError("sandbox died")
        return str(sandbox).upper() if loud else str(sandbox)

    assert whoami.needs_sandbox and "sandbox" not in whoami.parameters["properties"]
    tools = {"whoami": whoami}
    res = await run_tool_call(
        tools, ToolCall(id="c", name="whoami", arguments={"loud": True}), sandbox="sb-1"
    )
    assert res.output == "SB-1"
    missing = await run_tool_call(tools, ToolCall(id="c", name="whoami", arguments={}))
    assert missing.error == "tool_error" and "needs a sandbox" in missing.output
    with pytest.raises(SandboxError):
        await run_tool_call(tools, ToolCall(id="c", name="whoami", arguments={}), sandbox="broken")


async def test_method_tools_bind_self_and_outputs_are_capped() -> None:
    class Box:
        def __init__(self, size: int) -> None:
            self.size = size

        @tool(max_output_chars=10)
        def fill(self, char: str) -> str:
            """Fill the box.

            Args:
                char: What to fill it with.
            """
            return char * self.size

    assert isinstance(Box.fill, Tool) and "self" not in Box.fill.parameters["properties"]
    small, big = Box(3).fill, Box(50).fill
    assert (
        await run_tool_call({"fill": small}, ToolCall(id="c", name="fill", arguments={"char": "x"}))
    ).output == "xxx"
    out = (
        await run_tool_call({"fill": big}, ToolCall(id="c", name="fill", arguments={"char": "y"}))
    ).output
    assert out.startswith("y" * 10) and out.endswith("[truncated 40 characters]")


def test_parse_docstring_without_sections() -> None:
    assert parse_docstring("Just a summary.") == ("Just a summary.", {})
