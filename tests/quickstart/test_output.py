"""What the quickstart prints into a log (no terminal): the status line, a plain line every
PLAIN_EVERY_S and a closing line only when it says something new; and its closing hint."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from agent_rl.app.quickstart import progress
from agent_rl.app.quickstart.progress import Progress


def lines(out: io.StringIO) -> list[str]:
    return [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]


@pytest.mark.parametrize(("every_s", "printed"), [
    (0.0, ["v79/80", "v80/80"]),  # every update printed: the closing line does not repeat
    (3600.0, ["v79/80", "v80/80"]),  # only the first: the closing line shows the last
])
def test_closing_line_says_only_what_is_new(monkeypatch, every_s: float,
                                            printed: list[str]) -> None:
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", every_s)
    out = io.StringIO()
    with Progress(Console(file=out), "RL") as p:
        p.update("v79/80")
        p.update("v80/80")
    assert lines(out) == printed


def test_the_closing_hint_names_a_command_the_shell_finds(monkeypatch) -> None:
    import shutil
    import sys
    from pathlib import Path

    from agent_rl.app.quickstart import command_name

    script = Path(sys.executable).parent / "agent-rl"  # the test environment's install
    assert script.exists()
    monkeypatch.setenv("PATH", str(script.parent))
    assert command_name() == "agent-rl"
    monkeypatch.setenv("PATH", "/nonexistent")
    assert shutil.which("agent-rl") is None
    assert command_name() == str(script)
