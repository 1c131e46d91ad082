"""What the CLI prints reads as meant: `agent-rl --help` lists every command with its one-line
summary, no command offers shell-completion options the others lack, and into a file or a pipe
the consoles do not break lines at 80 columns."""

from __future__ import annotations

import io

import click
import typer
from typer.testing import CliRunner

from agent_rl.app.cli import COMMANDS, app, common


def commands() -> dict[str, click.Command]:
    root = typer.main.get_command(app)
    ctx = click.Context(root)
    found = {name: root.get_command(ctx, name) for name in COMMANDS}  # type: ignore[attr-defined]
    assert all(found.values())
    return found  # type: ignore[return-value]


def test_every_command_summary_is_one_flowing_line() -> None:
    for name, command in commands().items():
        first = " ".join((command.help or "").split("\n\n")[0].split())
        assert command.short_help == first, name
    # Rendered wide, a summary whose docstring spans lines is not broken at the docstring's breaks.
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    summary = " ".join(commands()["audit"].help.split("\n\n")[0].split())  # type: ignore[union-attr]
    assert summary in result.output


def test_no_command_offers_completion_install() -> None:
    # The root turns completion off; single commands are wrapped in Typer apps of their own.
    for name, command in commands().items():
        options = {opt for p in command.params for opt in getattr(p, "opts", [])}
        assert "--install-completion" not in options, name
        assert "--show-completion" not in options, name


def test_console_into_a_file_keeps_lines_whole(monkeypatch) -> None:
    monkeypatch.delitem(common.__dict__, "console", raising=False)  # made afresh on first use
    console = common.console
    console.file = out = io.StringIO()  # not a terminal (pytest captures stdout anyway)
    line = "[RL  153s] v80/80 | " + "episodes: 5120 trained, 2592 filtered, 0 failed | " * 4
    console.print(line, highlight=False)
    assert out.getvalue() == line + "\n"
