"""One live status line per stage: a rich spinner on a terminal, a plain line every 15 s in a log."""

from __future__ import annotations

import time
from types import TracebackType

from rich.console import Console
from rich.live import Live
from rich.spinner import Spinner

PLAIN_EVERY_S = 15.0


class Progress:
    def __init__(self, console: Console, stage: str) -> None:
        self.console, self.stage = console, stage
        self.started = time.monotonic()
        self.live = Live(console=console, refresh_per_second=4, transient=True) if console.is_terminal else None
        self._last_plain = float("-inf")  # the first update prints, whatever the clock reads
        self._text = ""
        self._printed = ""  # the last plain line's text: the closing line does not repeat it

    def __enter__(self) -> Progress:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        if self.live is not None:
            self.live.__exit__(exc_type, exc, tb)
        if self._text and self._text != self._printed:
            self.console.print(self._line(), highlight=False)

    def _line(self) -> str:
        return f"[{self.stage} {time.monotonic() - self.started:4.0f}s] {self._text}"

    def update(self, text: str) -> None:
        self._text = text
        if self.live is not None:
            self.live.update(Spinner("dots", text=self._line()))
        elif time.monotonic() - self._last_plain >= PLAIN_EVERY_S:
            self._last_plain = time.monotonic()
            self._printed = text
            self.console.print(self._line(), highlight=False)
