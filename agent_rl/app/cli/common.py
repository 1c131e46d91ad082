"""State and helpers shared by the CLI command modules.

`console` and `err_console` (rich consoles for stdout and stderr) are made on first use: the
commands that print plain text (`agent-rl episodes list`) should not wait for rich to load.
Into a file or a pipe they print a line as one line. The config is imported on first use too,
after `main()` has turned the collector off for a command's imports (agent_rl/kernel/heap.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from agent_rl.config import Config

    console: Console
    err_console: Console


def __getattr__(name: str) -> Any:
    if name in ("console", "err_console"):
        from rich.console import Console

        made = globals()[name] = Console(stderr=name == "err_console")
        # Into a file or a pipe rich would break every line at 80 columns: a log line stays one
        # line there (tables still lay out at that width).
        made.soft_wrap = not made.is_terminal
        return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class CliState:
    """What the root callback parsed; the config is loaded on first use."""

    config_path: Path | None = None
    _config: Config | None = field(default=None, repr=False)

    def config(self) -> Config:
        if self._config is None:
            from agent_rl.config import load_config

            self._config = load_config(self.config_path)
        return self._config


def state(ctx: typer.Context) -> CliState:
    """The CliState of this invocation (works from nested command groups)."""
    return ctx.find_root().obj


def plain_table(header: list[str], rows: list[list[str]], right: set[str] = frozenset()) -> str:
    """An aligned text table, one line per row (columns named in `right` right-aligned): what
    long listings print, since laying out a rich table of 10,000 rows took seconds."""
    widths = [max(map(len, column)) for column in zip(header, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        padded = (c.rjust(w) if h in right else c.ljust(w)
                  for c, w, h in zip(cells, widths, header, strict=True))
        return "  ".join(padded).rstrip() + "\n"

    return line(header) + line(["-" * w for w in widths]) + "".join(map(line, rows))
