"""The hot path's statements, run on the database driver's own cursor.

Each turn is four statements (the episode's counters, the turn's token arrays, its messages, its
tool calls). Through SQLAlchemy's `Connection.execute`, the per-execute work around them
(the compiled-cache lookup, building and processing the parameters, events, the result object)
cost more CPU than the database itself: measured on SQLite, 0.52 ms per turn through
`execute`, 0.37 through `exec_driver_sql`, 0.24 on the driver's cursor. At a GPU engine's turn
rate that difference is what limits a serve process.

A `DriverStatement` is still a SQLAlchemy statement: it is compiled once per dialect by
SQLAlchemy (with the same SQL, bind casts and type processors `execute` would use), and only
the execution goes around SQLAlchemy. What that gives up, and how it is kept:
- type processing: the statement's own bind processors (JSON serialization, floats) are
  applied to every value, as `execute` does;
- literal values and defaults: the compiled statement's values are the base of every call's
  parameters; a statement needing Python-side defaults or expanded parameters is refused when
  it is compiled (run it through `execute`);
- errors: a driver error is raised as SQLAlchemy's `DBAPIError` subclass, and a lost
  connection invalidates the `Connection`, so the store's fault handling (`is_transient`,
  retries, in-doubt commits) sees what it sees from `execute`;
- events: SQLAlchemy's `before_cursor_execute` does not fire for these statements (count them
  with the driver's own hooks, e.g. sqlite3's trace callback).

A statement compiles at its first use for a dialect, 1-2 ms each; `compile_all(dialect)` compiles
every one made so far at once (a serving process's start, `Store.warm`), so that its first
episodes do not pay for them one by one.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import ClauseElement


@dataclass(frozen=True)
class _Compiled:
    sql: str
    base: dict[str, Any]
    """The compiled statement's own values (literals in the statement) under their bind names."""
    processors: tuple[tuple[str, Callable[[Any], Any]], ...]
    positions: tuple[str, ...] | None
    """Bind names in order, for a positional paramstyle (SQLite's qmark); None for named."""

    def parameters(self, given: Mapping[str, Any]) -> dict[str, Any] | tuple[Any, ...]:
        values = {**self.base, **given}
        for name, process in self.processors:
            values[name] = process(values[name])
        if self.positions is None:
            return values
        return tuple([values[name] for name in self.positions])


class DriverStatement:
    """A SQLAlchemy statement compiled once per dialect and run on the driver's cursor.

    `column_keys` names the columns an INSERT or UPDATE sets (the keys its parameters carry);
    without it, the statement's own `.values()` decide. Call it inside a transaction the
    `Connection` has begun."""

    def __init__(self, statement: ClauseElement, column_keys: Sequence[str] | None = None) -> None:
        self.statement = statement
        self.column_keys = list(column_keys) if column_keys is not None else None
        self._compiled: weakref.WeakKeyDictionary[Dialect, _Compiled] = weakref.WeakKeyDictionary()
        _MADE.add(self)

    def compiled_for(self, dialect: Dialect) -> bool:
        """Whether it is compiled for `dialect` already."""
        return dialect in self._compiled

    def one_or_none(self, conn: Connection, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """Run it with `params`; the first row it returns (a RETURNING statement), or None."""
        c = self._for(conn.dialect)
        return _run(conn, c.sql, params,
                    lambda cur: cur.execute(c.sql, c.parameters(params)).fetchone())

    def scalar(self, conn: Connection, params: Mapping[str, Any]) -> Any:
        """Run it with `params`; the first column of the first row it returns, or None (as
        `Connection.scalar` does)."""
        row = self.one_or_none(conn, params)
        return row[0] if row is not None else None

    def all(self, conn: Connection, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """Run it with `params`; every row it returns, as the driver gives them (for columns
        whose values need no SQLAlchemy result processing: numbers, strings)."""
        c = self._for(conn.dialect)
        return _run(conn, c.sql, params,
                    lambda cur: cur.execute(c.sql, c.parameters(params)).fetchall())

    def rowcount(self, conn: Connection, params: Mapping[str, Any]) -> int:
        """Run it with `params`; the number of rows it matched."""
        c = self._for(conn.dialect)

        def run(cur: Any) -> int:
            cur.execute(c.sql, c.parameters(params))
            if cur.description is not None:  # RETURNING: SQLite counts only the rows fetched
                return len(cur.fetchall())
            return int(cur.rowcount)

        return _run(conn, c.sql, params, run)

    def many(self, conn: Connection, rows: Iterable[Mapping[str, Any]]) -> None:
        """Run it once per row of parameters (the driver's `executemany`)."""
        c = self._for(conn.dialect)
        values = [c.parameters(row) for row in rows]
        if values:
            _run(conn, c.sql, values, lambda cur: cur.executemany(c.sql, values))

    def _for(self, dialect: Dialect) -> _Compiled:
        compiled = self._compiled.get(dialect)
        if compiled is None:
            compiled = self._compiled[dialect] = self._compile(dialect)
        return compiled

    def _compile(self, dialect: Dialect) -> _Compiled:
        # for_executemany: no implicit RETURNING of the new row's id (PostgreSQL adds it to a
        # single-row INSERT), which `many` could not return and `execute` would not fetch.
        c = self.statement.compile(dialect=dialect, column_keys=self.column_keys,
                                   for_executemany=True)
        if getattr(c, "insert_prefetch", None) or getattr(c, "update_prefetch", None) \
                or c.literal_execute_params or c.post_compile_params:  # fmt: skip
            raise TypeError(f"{self.statement} needs SQLAlchemy's execution (Python-side defaults "
                            "or expanded parameters): run it with Connection.execute")
        # The statement's own values (its literals); the caller supplies the required binds.
        base = {name: value for name, value in c.params.items() if not c.binds[name].required}
        processors = []
        for name, bind in c.binds.items():
            process = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if process is not None:
                processors.append((name, process))
        positions = tuple(c.positiontup) if c.positiontup is not None else None
        return _Compiled(c.string, base, tuple(processors), positions)


_MADE: weakref.WeakSet[DriverStatement] = weakref.WeakSet()
"""Every statement made (the store's are module-level: made once, at import)."""


def compile_all(dialect: Dialect) -> None:
    """Compile every statement made so far for `dialect` (those compiled already are kept). One
    that cannot be (refused for `execute`, or not for this database) is left to raise at its own
    use, as it would have."""
    for statement in list(_MADE):
        with contextlib.suppress(Exception):
            statement._for(dialect)


def run_sql(conn: Connection, sql: str) -> None:
    """Run `sql` (no parameters, no rows) on the driver's cursor, its errors raised as
    `execute` raises them (the SQLite store's BEGIN and pragmas, sent on every transaction)."""
    _run(conn, sql, None, lambda cur: cur.execute(sql))


def _run(conn: Connection, sql: str, params: Any, fn: Callable[[Any], Any]) -> Any:
    dialect = conn.dialect
    dbapi_conn = conn.connection.dbapi_connection
    cursor = dbapi_conn.cursor()  # type: ignore[union-attr]
    try:
        return fn(cursor)
    except dialect.loaded_dbapi.Error as e:
        lost = dialect.is_disconnect(e, dbapi_conn, cursor)  # type: ignore[arg-type]
        if lost:
            conn.invalidate(e)
        raise DBAPIError.instance(sql, params, e, dialect.loaded_dbapi.Error,
                                  connection_invalidated=lost, dialect=dialect) from e
    finally:
        if not conn.invalidated:
            cursor.close()
