"""What the quickstart prints into a log (no terminal): the status line, a plain line every
PLAIN_EVERY_S and a closing line only when it says something new; and its closing hint."""

from __future__ import annotations

import io

from rich.console import Console

from agent_rl.quickstart import progress
from agent_rl.quickstart.progress import Progress


def lines(out: io.StringIO) -> list[str]:
    return [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]


def test_closing_line_does_not_repeat_the_last(monkeypatch) -> None:
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.0)  # every update is printed
    out = io.StringIO()
    with Progress(Console(file=out), "RL") as p:
        p.update("v79/80")
        p.update("v80/80")
    assert lines(out) == ["v79/80", "v80/80"]


def test_closing_line_shows_what_was_not_printed(monkeypatch) -> None:
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 3600.0)  # only the first update is printed
    out = io.StringIO()
    with Progress(Console(file=out), "SFT") as p:
        p.update("step 1/400")
        p.update("step 400/400")
    assert lines(out) == ["step 1/400", "step 400/400"]


def test_the_closing_hint_names_a_command_the_shell_finds(monkeypatch) -> None:
    import shutil
    import sys
    from pathlib import Path

    from agent_rl.quickstart import command_name

    script = Path(sys.executable).parent / "agent-rl"  # the test environment's install
    assert script.exists()
    monkeypatch.setenv("PATH", str(script.parent))
    assert command_name() == "agent-rl"
    monkeypatch.setenv("PATH", "/nonexistent")
    assert shutil.which("agent-rl") is None
    assert command_name() == str(script)
