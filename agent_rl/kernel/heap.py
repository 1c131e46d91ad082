"""The garbage collector's settings for a long-running serving process.

A `serve` (or router) process imports a large, long-lived heap (SQLAlchemy, transformers,
pydantic, numpy, aiohttp, the models' tokenizers) and then allocates short-lived containers on
every turn: request dicts, message lists, token lists, ORM rows. With CPython's default
thresholds (a young collection every 700 net allocations) the collector runs thousands of times
a minute, and every tenth of those that reach the oldest generation walks the whole imported
heap: measured in `bench/serve_ceiling.py`, about a tenth of serve's CPU per turn. The objects a
turn makes are nearly all freed by reference counting as the turn ends; what the collector is
for, cycles, is rare.

`long_lived_heap()` collects once, moves everything alive into the permanent generation
(`gc.freeze()`: never scanned again) and raises the young generation's threshold, for as long
as the process serves; on exit the previous settings come back (serve also runs inside tests
and the quickstart's process). SGLang's scheduler freezes its heap after warm-up the same way.

A short-lived command pays for the collector at start-up instead: importing its libraries
(SQLAlchemy, pydantic, Typer) makes a large heap of long-lived containers and hardly any
garbage, yet sets off ~150 collections (measured on `agent-rl episodes list`), and at exit the
interpreter walks that heap once more. The CLI brackets a command's imports with
`imports_begin()` / `imports_end()`: no collection while they run, and what they made frozen
afterwards.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_THRESHOLD = 20_000
"""Net allocations of tracked containers between young collections (CPython's default: 700).
A turn's garbage is freed by reference counts; cycles wait a little longer to be found."""

_depth = 0
_importing = False


def imports_begin() -> None:
    """No collections until `imports_end()`: a command's imports make long-lived objects."""
    global _importing
    if gc.isenabled():
        gc.disable()
        _importing = True


def imports_end() -> None:
    """Freeze what the imports made out of later scans (the exit's included) and collect as
    usual again; a no-op unless `imports_begin()` disabled the collector."""
    global _importing
    if _importing:
        _importing = False
        gc.freeze()
        gc.enable()


@contextmanager
def long_lived_heap(young: int = YOUNG_THRESHOLD) -> Iterator[None]:
    """Freeze what is alive now out of the collector's scans and collect the young generation
    less often, until the block ends. Nested uses keep the outermost's settings."""
    global _depth
    if _depth:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(young, *before[1:])
    _depth = 1
    try:
        yield
    finally:
        _depth = 0
        gc.set_threshold(*before)
        gc.unfreeze()
