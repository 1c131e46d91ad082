"""State and helpers shared by the CLI command modules."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import typer
from rich.console import Console

from agent_rl.config import Config, load_config

console = Console()
err_console = Console(stderr=True)


@dataclass
class CliState:
    """What the root callback parsed; the config is loaded on first use."""

    config_path: Path | None = None
    _config: Config | None = field(default=None, repr=False)

    def config(self) -> Config:
        if self._config is None:
            self._config = load_config(self.config_path)
        return self._config


def state(ctx: typer.Context) -> CliState:
    """The CliState of this invocation (works from nested command groups)."""
    return ctx.find_root().obj
