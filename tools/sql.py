"""SqlDatabase: read-only, time-boxed SQL tools over any SQLite file.

The three tools the model sees are bound methods of one `SqlDatabase`:

    db = SqlDatabase("shop.db", query_timeout_s=1.0, max_rows=50, max_output_chars=2000)
    db.sql_query("SELECT name, price FROM products ORDER BY price DESC LIMIT 2")
    # 'name | price\\nCamping Tent | 249.99\\nOffice Chair | 189'
    db.list_tables()            # 'table | rows\\ncustomers | 400\\n...'
    db.describe_table("orders") # 'column | type | key\\nid | INTEGER | primary key\\n...'
    db.query("SELECT ...")      # QueryResult(columns, rows, more): the non-tool form, raises ToolError

Output is a compact text table: a header line, then one line per row, cells separated by
" | "; whole-number floats print as integers, NULL as `NULL`, blobs as `<blob N bytes>`;
at most `max_rows` rows, then a visible "... N more rows" line; at most `max_output_chars`.

Safety (the agent can never change the file, stall the process or blow its memory):
- opened through a `file:...?mode=ro` URI (plus `immutable=1` for a WAL-mode file with no
  `-wal` file, so no `-wal`/`-shm` files appear next to the user's database), in autocommit mode, with `PRAGMA query_only=1`;
- an authorizer that allows only reads, SELECT, functions (not `load_extension`), recursive
  CTEs and a few read-only introspection PRAGMAs (`table_info(x)` ...): ATTACH/DETACH, writes,
  DDL, transactions and every other PRAGMA are refused;
- a progress handler stops a statement after `query_timeout_s` (runaway CTEs, cartesian products);
  inside `with db.turn_budget():` all statements together get that much time (the env wraps
  each step in it, so a turn of many runaway calls still ends in about `query_timeout_s`);
- `SQLITE_LIMIT_LENGTH` bounds any one value (`randomblob(1e9)`, `zeroblob`, `printf('%.*c', ...)`),
  `SQLITE_LIMIT_SQL_LENGTH` and `MAX_QUERY_CHARS` bound the statement text;
- `printf()`/`format()` refuse widths and precisions above that limit (SQLite 3.40 loops over
  `printf('%.*c', 2e9, 'x')` for seconds inside one VM step, where no progress handler runs);
- one statement per call. Every refusal raises `ToolError`, which the env shows the model as
  a tool message starting with "Error:". With `hints=True`, "no such table" also lists the tables
  and "no such column" the columns of the tables the query names after FROM/JOIN.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentopd.tool import ToolError

MAX_QUERY_CHARS = 10_000
MAX_VALUE_BYTES = 100_000  # SQLITE_LIMIT_LENGTH: no string or blob larger (instr/trim are O(n*m))
MAX_CELL_CHARS = 200  # longer cells are cut in the text table (not in answers)
COUNT_MORE_ROWS_CAP = 10_000  # rows past max_rows are counted up to this many
PROGRESS_EVERY_OPS = 1_000

_INTROSPECTION_PRAGMAS = frozenset(
    {"table_info", "table_xinfo", "index_list", "index_info", "index_xinfo", "foreign_key_list"}
)
_DIGITS = re.compile(r"\d+")
_FROM_TABLE = re.compile(r"\b(?:from|join)\s+[\"`\[]?(\w+)", re.IGNORECASE)  # tables a query names (for hints)
_DENIED_FUNCTIONS = frozenset({"load_extension", "fts3_tokenizer"})
_WRITES = frozenset({sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_DELETE})
_SCHEMA_TABLES = frozenset({"sqlite_master", "sqlite_temp_master", "sqlite_schema", "sqlite_temp_schema"})
_ACTION_NAMES = {
    getattr(sqlite3, n): n.removeprefix("SQLITE_").replace("_", " ")
    for n in (
        "SQLITE_CREATE_INDEX SQLITE_CREATE_TABLE SQLITE_CREATE_TEMP_INDEX SQLITE_CREATE_TEMP_TABLE "
        "SQLITE_CREATE_TEMP_TRIGGER SQLITE_CREATE_TEMP_VIEW SQLITE_CREATE_TRIGGER SQLITE_CREATE_VIEW "
        "SQLITE_DELETE SQLITE_DROP_INDEX SQLITE_DROP_TABLE SQLITE_DROP_TEMP_INDEX SQLITE_DROP_TEMP_TABLE "
        "SQLITE_DROP_TEMP_TRIGGER SQLITE_DROP_TEMP_VIEW SQLITE_DROP_TRIGGER SQLITE_DROP_VIEW SQLITE_INSERT "
        "SQLITE_TRANSACTION SQLITE_UPDATE SQLITE_ATTACH SQLITE_DETACH SQLITE_ALTER_TABLE SQLITE_REINDEX "
        "SQLITE_ANALYZE SQLITE_CREATE_VTABLE SQLITE_DROP_VTABLE SQLITE_SAVEPOINT"
    ).split()
}


def _too_big(value: Any) -> bool:
    """Would SQLite read `value` as a number above MAX_VALUE_BYTES (a printf '*' width)?"""
    if isinstance(value, str | bytes):
        try:
            value = float(value[:40])
        except ValueError:
            return False
    return isinstance(value, int | float) and not abs(value) <= MAX_VALUE_BYTES


def format_value(value: Any, max_chars: int | None = MAX_CELL_CHARS) -> str:
    """One cell as text: NULL, whole-number floats as ints, blobs by size, long text cut."""
    if value is None:
        return "NULL"
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e16:
            return str(int(value))
        return f"{value:.12g}"
    if isinstance(value, bytes):
        return f"<blob {len(value)} bytes>"
    text = str(value).replace("\r", "\\r").replace("\n", "\\n")
    if max_chars is not None and len(text) > max_chars:
        text = text[:max_chars] + "..."
    return text


@dataclass(frozen=True)
class QueryResult:
    """A query's column names, its first rows, and how many rows were left out."""

    columns: list[str]
    rows: list[tuple[Any, ...]]
    more: int = 0  # rows after `rows`
    more_is_lower_bound: bool = False  # counting stopped at the cap or the time limit

    def to_text(self, max_output_chars: int) -> str:
        lines = [" | ".join(self.columns)]
        used = len(lines[0])
        hidden = 0
        for i, row in enumerate(self.rows):
            line = " | ".join(format_value(v) for v in row)
            if used + 1 + len(line) > max_output_chars:
                hidden = len(self.rows) - i
                break
            lines.append(line)
            used += 1 + len(line)
        if not self.rows:
            lines.append("(no rows)")
        more = hidden + self.more
        if more:
            lines.append(f"... {'more than ' if self.more_is_lower_bound else ''}{more} more rows")
        return "\n".join(lines)

    def values(self) -> list[str]:
        """Every cell, row by row, as answer text (no cell cut)."""
        return [format_value(v, max_chars=None) for row in self.rows for v in row]


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    primary_key: bool
    references: str | None  # "table.column" for a foreign key


class SqlDatabase:
    """SQL tools over one SQLite file, opened read-only (see the module docstring)."""

    TOOLS = ("sql_query", "list_tables", "describe_table")  # what the model may call (`query` is for the env)

    def __init__(
        self,
        path: str | Path,
        *,
        query_timeout_s: float = 1.0,
        max_rows: int = 50,
        max_output_chars: int = 2000,
        hints: bool = False,
    ):
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"db_path: no SQLite file at {str(path)!r}")
        if not query_timeout_s > 0:
            raise ValueError(f"query_timeout_s must be > 0, got {query_timeout_s!r}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows!r}")
        if max_output_chars < 80:
            raise ValueError(f"max_output_chars must be >= 80, got {max_output_chars!r}")
        self.path = path
        self.query_timeout_s = float(query_timeout_s)
        self.max_rows = int(max_rows)
        self.max_output_chars = int(max_output_chars)
        self.hints = bool(hints)  # "no such column/table" errors also list what there is
        self._deadline = float("inf")
        self._budget_end = float("inf")
        self._denied: str | None = None
        uri = path.resolve().as_uri() + "?mode=ro"
        with path.open("rb") as f:
            header = f.read(20)
        if len(header) == 20 and header[18] == 2 and not Path(f"{path}-wal").exists():
            uri += "&immutable=1"  # a cleanly closed WAL database: read it without creating -wal/-shm files
        try:
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA query_only = 1")
            self.schema = self._read_schema(conn)
        except sqlite3.Error as e:
            raise ValueError(f"db_path: {str(path)!r} is not a readable SQLite database: {e}") from e
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, MAX_QUERY_CHARS * 4)  # bytes; chars are checked first
        self._udf_error: str | None = None
        self._printf_conn = sqlite3.connect(":memory:", check_same_thread=False)  # runs the real printf
        self._printf_conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        for name in ("printf", "format"):
            conn.create_function(name, -1, self._printf, deterministic=True)
        conn.set_authorizer(self._authorize)
        conn.set_progress_handler(self._progress, PROGRESS_EVERY_OPS)
        self._conn = conn
        self._row_counts: dict[str, int | str] | None = None

    # --- safety hooks ------------------------------------------------------------------
    def _authorize(self, action: int, arg1: str | None, arg2: str | None, db: str | None, source: str | None) -> int:
        if action in (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE):
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() not in _DENIED_FUNCTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA and (arg1 or "").lower() in _INTROSPECTION_PRAGMAS:
            return sqlite3.SQLITE_OK
        if self._denied is None:  # the first refusal aborts the statement
            if action in _WRITES and (arg1 or "").lower() in _SCHEMA_TABLES:
                self._denied = "changing the schema (CREATE, DROP)"
            elif action == sqlite3.SQLITE_FUNCTION:
                self._denied = f"the function {arg2}()"
            elif action == sqlite3.SQLITE_PRAGMA:
                self._denied = f"PRAGMA {arg1}"
            else:
                self._denied = _ACTION_NAMES.get(action, f"this statement (authorizer action {action})")
        return sqlite3.SQLITE_DENY

    def _printf(self, *args: Any) -> Any:
        """printf()/format() without huge widths or precisions: SQLite 3.40 loops over
        `printf('%.*c', 2e9, 'x')` for seconds inside one VM step, out of the progress handler's reach."""
        if not args:
            return None
        fmt, args = args[0], args[1:]
        if isinstance(fmt, str):
            digits = _DIGITS.findall(fmt)
            stars = "*" in fmt and any(_too_big(a) for a in args)
            if stars or any(len(d) > 6 or int(d) > MAX_VALUE_BYTES for d in digits):
                self._udf_error = f"printf()/format() widths and precisions are limited to {MAX_VALUE_BYTES}"
                raise ValueError(self._udf_error)
        marks = ", ".join("?" * (1 + len(args)))
        return self._printf_conn.execute(f"SELECT printf({marks})", (fmt, *args)).fetchone()[0]

    def _progress(self) -> int:
        return 1 if time.monotonic() > self._deadline else 0

    @contextmanager
    def turn_budget(self) -> Iterator[None]:
        """All queries inside share one `query_timeout_s` (so a turn with many tool calls
        still ends in about that time)."""
        self._budget_end = time.monotonic() + self.query_timeout_s
        try:
            yield
        finally:
            self._budget_end = float("inf")

    # --- the non-tool API ----------------------------------------------------------------
    def query(self, sql: str, max_rows: int | None = None) -> QueryResult:
        """Run one statement under every guard; raise ToolError with a readable reason.
        Keeps the first `max_rows` rows (default: the tool's) and counts the rest."""
        max_rows = self.max_rows if max_rows is None else max_rows
        now = time.monotonic()
        if now >= self._budget_end:
            raise ToolError(f"no query time left in this turn (the turn's budget is {self.query_timeout_s:g} s)")
        if not isinstance(sql, str):
            raise ToolError(f"the query must be a string, got {type(sql).__name__}")
        if not sql.strip():
            raise ToolError("the query is empty; send one SELECT statement")
        if len(sql) > MAX_QUERY_CHARS:
            raise ToolError(f"the query is {len(sql)} characters long; the limit is {MAX_QUERY_CHARS}")
        self._denied = self._udf_error = None
        self._deadline = min(now + self.query_timeout_s, self._budget_end)
        try:
            cursor = self._conn.execute(sql)
            if cursor.description is None:
                raise ToolError("the statement returned no result table; send one SELECT statement")
            columns = [d[0] for d in cursor.description]
            rows = cursor.fetchmany(max_rows)
            more, lower_bound = self._count_rest(cursor) if len(rows) == max_rows else (0, False)
        except sqlite3.Error as e:
            raise ToolError(self._explain(e, sql)) from None
        except (ValueError, OverflowError, MemoryError) as e:  # NUL characters, lone surrogates, huge values
            raise ToolError(f"{type(e).__name__}: {e}") from None
        finally:
            self._deadline = float("inf")
        return QueryResult(columns, rows, more, lower_bound)

    def _count_rest(self, cursor: sqlite3.Cursor) -> tuple[int, bool]:
        more = 0
        try:
            for _ in cursor:
                more += 1
                if more >= COUNT_MORE_ROWS_CAP:
                    return more, True
        except sqlite3.OperationalError:  # the time limit hit while counting: show what we have
            return more, True
        return more, False

    def _explain(self, e: sqlite3.Error, sql: str = "") -> str:
        text = str(e)
        if self._denied is not None or text == "not authorized":
            return f"{self._denied or 'this statement'} is not allowed: the database is read-only; send one SELECT statement"
        if self._udf_error is not None:
            return self._udf_error
        if isinstance(e, sqlite3.OperationalError) and text == "interrupted" and time.monotonic() > self._deadline:
            limit = f"{self.query_timeout_s:g} s (the limit per query and per turn)"
            return f"the query ran longer than {limit} and was stopped; make it cheaper"
        if "one statement at a time" in text:
            return "only one SQL statement per call is allowed"
        if "too big" in text:
            return f"a value in the query grew larger than {MAX_VALUE_BYTES} bytes ({text})"
        if self.hints and text.startswith("no such table:"):
            return f"{text}; tables: {', '.join(self.schema)}"
        if self.hints and text.startswith("no such column:"):
            named = {t.lower(): t for t in self.schema}
            tables = dict.fromkeys(named[m.lower()] for m in _FROM_TABLE.findall(sql) if m.lower() in named)
            if tables:
                columns = "; ".join(f"{t}({', '.join(c.name for c in self.schema[t])})" for t in tables)
                return f"{text}; columns: {columns}"
        return text

    # --- the tools -------------------------------------------------------------------------
    def sql_query(self, query: str) -> str:
        """Run one read-only SQL SELECT statement on the database and return the result as a table.

        Args:
            query: One SQLite SELECT statement, e.g. "SELECT * FROM some_table LIMIT 5".
        """
        return self.query(query).to_text(self.max_output_chars)

    def list_tables(self) -> str:
        """List the tables of the database and how many rows each has."""
        if self._row_counts is None:
            counts: dict[str, int | str] = {}
            for table in self.schema:  # after one count runs out of time, the rest show "?"
                if "?" not in counts.values():
                    quoted = '"' + table.replace('"', '""') + '"'
                    try:
                        counts[table] = int(self.query(f"SELECT COUNT(*) FROM {quoted}").rows[0][0])
                    except ToolError:
                        counts[table] = "?"
                else:
                    counts[table] = "?"
            self._row_counts = counts
        rows = list(self._row_counts.items())
        return QueryResult(["table", "rows"], rows).to_text(self.max_output_chars)

    def describe_table(self, name: str) -> str:
        """Show the columns of one table: name, type and keys.

        Args:
            name: The table name, as listed by list_tables.
        """
        table = {t.lower(): t for t in self.schema}.get(name.strip().lower())
        if table is None:
            raise ToolError(f"no table named {name!r:.80}; tables: {', '.join(self.schema)}")
        rows = [
            (c.name, c.type or "ANY", "primary key" if c.primary_key else (f"-> {c.references}" if c.references else ""))
            for c in self.schema[table]
        ]
        return QueryResult(["column", "type", "key"], rows).to_text(self.max_output_chars)

    # --- schema ----------------------------------------------------------------------------
    @staticmethod
    def _read_schema(conn: sqlite3.Connection) -> dict[str, list[Column]]:
        names = [
            r[0]
            for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type IN ('table', 'view') AND name NOT LIKE 'sqlite_%' ORDER BY name"
            )
        ]
        schema: dict[str, list[Column]] = {}
        for table in names:
            refs = {
                r[3]: f"{r[2]}.{r[4] or 'rowid'}" for r in conn.execute("SELECT * FROM pragma_foreign_key_list(?)", (table,))
            }
            schema[table] = [
                Column(r[1], r[2], bool(r[5]), refs.get(r[1]))
                for r in conn.execute("SELECT * FROM pragma_table_info(?)", (table,))
            ]
        return schema

    def close(self) -> None:
        self._conn.close()
        self._printf_conn.close()

    def __repr__(self) -> str:
        return f"SqlDatabase({str(self.path)!r}, tables={list(self.schema)})"
