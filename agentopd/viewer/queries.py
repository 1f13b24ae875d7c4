"""Episode queries on a read-only `episodes` table: filters, keyset pages, one row, neighbours.

    q = EpisodeQuery(env="sql_db", success=False, min_turns=3)       # every field optional
    page = list_episodes(conn, q)                                     # EpisodePage: items + cursors
    page = list_episodes(conn, q.model_copy(update={"after": page.next_cursor}))
    row = episode_row(conn, "000003-0007")                           # full row dict, or None
    prev_id, next_id = neighbours(conn, "000003-0007")               # in (step, id) order

Pages are keyset pages over (step, id) in either order: a cursor is "<step>:<id>" of the
last (`after`) or first (`before`) row shown; `last=true` jumps to the end. Every page is
found in two steps: the page's ids by an index walk (LIMIT, never OFFSET, never the whole
table), then their list columns by primary key. The Store indexes `step` and `(split,
step)`; a covering index `(step, id, split, env, success, reward, num_turns, stop_reason)`
makes any filter an index-only walk (see benchmarks/results/viewer.md).
The match count is bounded (`COUNT_CAP`) so it never costs more than one capped walk.
"""

from __future__ import annotations

import sqlite3
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticUseDefault

from agentopd.types import StopReason

LIST_COLUMNS = (
    "id", "step", "split", "env", "task_id", "reward", "success", "num_turns", "stop_reason",
    "num_tokens", "llm_tokens", "tool_errors", "parse_errors", "kl_mean", "teacher", "created_at",
)  # fmt: skip
COUNT_CAP = 10_000


class Order(StrEnum):
    ASC = "asc"
    DESC = "desc"


class EpisodeQuery(BaseModel):
    """Filters and position of one episode-list page (query parameters of the list routes)."""

    model_config = ConfigDict(extra="ignore")

    step_min: int | None = Field(None, description="first step (inclusive)")
    step_max: int | None = Field(None, description="last step (inclusive)")
    env: str | None = Field(None, description="environment name")
    split: str | None = Field(None, description="'train' or 'eval'")
    success: bool | None = Field(None, description="only successful (true) or failed (false) episodes")
    reward_min: float | None = None
    reward_max: float | None = None
    stop_reason: StopReason | None = None
    min_turns: int | None = Field(None, ge=0, description="at least this many assistant turns")
    order: Order = Field(Order.DESC, description="by (step, id); desc = newest first")
    after: str | None = Field(None, description="cursor '<step>:<id>': the page after this row")
    before: str | None = Field(None, description="cursor '<step>:<id>': the page before this row")
    last: bool = Field(False, description="the last page in this order")
    limit: int = Field(50, ge=1, le=500)

    @field_validator("*", mode="before")
    @classmethod
    def _blank_is_unset(cls, v: Any) -> Any:
        """HTML forms send empty fields as ''; they mean 'no filter'."""
        if isinstance(v, str) and v.strip() == "":
            raise PydanticUseDefault()
        return v

    @field_validator("after", "before")
    @classmethod
    def _cursor_form(cls, v: str | None) -> str | None:
        if v is not None:
            parse_cursor(v)
        return v

    def filters(self) -> dict[str, Any]:
        """The set filters only (what links to other pages keep)."""
        keep = ("step_min", "step_max", "env", "split", "success", "reward_min", "reward_max", "stop_reason", "min_turns")
        out: dict[str, Any] = {}
        for k in keep:
            v = getattr(self, k)
            if v is not None:
                out[k] = ("true" if v else "false") if isinstance(v, bool) else str(v) if isinstance(v, StrEnum) else v
        if self.order is not Order.DESC:
            out["order"] = str(self.order)
        if self.limit != 50:
            out["limit"] = self.limit
        return out


class EpisodeSummary(BaseModel):
    """One row of the episode list (the light columns; token arrays stay in the database)."""

    id: str
    step: int
    split: str | None = None
    env: str | None = None
    task_id: str | None = None
    reward: float | None = None
    success: bool | None = None
    num_turns: int | None = None
    stop_reason: str | None = None
    num_tokens: int | None = None
    llm_tokens: int | None = None
    tool_errors: int | None = None
    parse_errors: int | None = None
    kl_mean: float | None = None
    teacher: str | None = None
    created_at: float | None = None


class EpisodePage(BaseModel):
    items: list[EpisodeSummary]
    next_cursor: str | None = Field(None, description="pass as `after` for the next page")
    prev_cursor: str | None = Field(None, description="pass as `before` for the previous page")
    matches: int = Field(description=f"episodes matching the filters, counted up to {COUNT_CAP}")
    matches_capped: bool = Field(description="true when there are more than `matches`")


def parse_cursor(cursor: str) -> tuple[int, str]:
    step, sep, eid = cursor.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(step), eid
    except ValueError:
        raise ValueError(f"cursor must be '<step>:<id>', got {cursor!r}") from None


def cursor_of(item: EpisodeSummary) -> str:
    return f"{item.step}:{item.id}"


def table_columns(conn: sqlite3.Connection) -> set[str]:
    return {r["name"] for r in conn.execute("PRAGMA table_info(episodes)")}


_FILTERS: dict[str, tuple[str, str]] = {  # field -> (column, SQL)
    "step_min": ("step", "step >= ?"),
    "step_max": ("step", "step <= ?"),
    "env": ("env", "env = ?"),
    "split": ("split", "split = ?"),
    "success": ("success", "success = ?"),
    "reward_min": ("reward", "reward >= ?"),
    "reward_max": ("reward", "reward <= ?"),
    "stop_reason": ("stop_reason", "stop_reason = ?"),
    "min_turns": ("num_turns", "num_turns >= ?"),
}


def _where(q: EpisodeQuery, columns: set[str]) -> tuple[list[str], list[Any]]:
    clauses, params = [], []
    for name, (column, sql) in _FILTERS.items():
        value = getattr(q, name)
        if value is None:
            continue
        if column not in columns:
            raise ValueError(f"{name}: this run's episodes table has no column {column!r}")
        clauses.append(sql)
        params.append(int(value) if isinstance(value, bool) else str(value) if isinstance(value, StrEnum) else value)
    return clauses, params


def _keyset(cursor: str, forward: bool) -> tuple[str, list[Any]]:
    """Rows strictly after (forward) or before the cursor in ascending (step, id) order; written
    so the step index bounds the walk."""
    step, eid = parse_cursor(cursor)
    if forward:
        return "step >= ? AND (step > ? OR id > ?)", [step, step, eid]
    return "step <= ? AND (step < ? OR id < ?)", [step, step, eid]


def list_episodes(conn: sqlite3.Connection, q: EpisodeQuery) -> EpisodePage:
    columns = table_columns(conn)
    clauses, params = _where(q, columns)
    asc = q.order is Order.ASC
    if q.after is not None:
        walk_asc, cursor_sql = asc, _keyset(q.after, forward=asc)
    elif q.before is not None:
        walk_asc, cursor_sql = not asc, _keyset(q.before, forward=not asc)
    else:
        walk_asc, cursor_sql = (not asc) if q.last else asc, None
    where = list(clauses)
    where_params = list(params)
    if cursor_sql is not None:
        where.append(cursor_sql[0])
        where_params += cursor_sql[1]
    direction = "ASC" if walk_asc else "DESC"
    sql = f"SELECT step, id FROM episodes {_sql_where(where)} ORDER BY step {direction}, id {direction} LIMIT ?"
    keys = conn.execute(sql, [*where_params, q.limit + 1]).fetchall()
    more = len(keys) > q.limit
    keys = keys[: q.limit]
    reversed_walk = walk_asc != asc
    if reversed_walk:
        keys.reverse()
    items = _summaries(conn, [k["id"] for k in keys], columns)
    first, last = (cursor_of(items[0]), cursor_of(items[-1])) if items else (None, None)
    if q.after is not None:
        has_prev, has_next = True, more
    elif q.before is not None:
        has_prev, has_next = more, True
    elif q.last:
        has_prev, has_next = more, False
    else:
        has_prev, has_next = False, more
    count_sql = f"SELECT count(*) FROM (SELECT 1 FROM episodes {_sql_where(clauses)} LIMIT ?)"
    matches = conn.execute(count_sql, [*params, COUNT_CAP + 1]).fetchone()[0]
    return EpisodePage(
        items=items,
        next_cursor=last if has_next else None,
        prev_cursor=first if has_prev else None,
        matches=min(matches, COUNT_CAP),
        matches_capped=matches > COUNT_CAP,
    )


def _sql_where(clauses: list[str]) -> str:
    return f"WHERE {' AND '.join(clauses)}" if clauses else ""


def _summaries(conn: sqlite3.Connection, ids: list[str], columns: set[str]) -> list[EpisodeSummary]:
    if not ids:
        return []
    cols = [c for c in LIST_COLUMNS if c in columns]
    marks = ",".join("?" * len(ids))
    rows = {r["id"]: dict(r) for r in conn.execute(f"SELECT {', '.join(cols)} FROM episodes WHERE id IN ({marks})", ids)}
    return [EpisodeSummary.model_validate(rows[i]) for i in ids if i in rows]


def episode_row(conn: sqlite3.Connection, episode_id: str) -> dict[str, Any] | None:
    row = conn.execute("SELECT * FROM episodes WHERE id = ?", [episode_id]).fetchone()
    return dict(row) if row is not None else None


def neighbours(conn: sqlite3.Connection, step: int, episode_id: str) -> tuple[str | None, str | None]:
    """Ids of the episodes just before and after this one in ascending (step, id) order."""
    out = []
    for forward in (False, True):
        sql, params = _keyset(f"{step}:{episode_id}", forward)
        d = "ASC" if forward else "DESC"
        row = conn.execute(f"SELECT id FROM episodes WHERE {sql} ORDER BY step {d}, id {d} LIMIT 1", params).fetchone()
        out.append(row["id"] if row else None)
    return out[0], out[1]


class RunStats(BaseModel):
    episodes: int
    last_step: int | None
    splits: dict[str, int]
    envs: list[str] = Field(description="environments of the last step's episodes")
    started_at: float | None = Field(None, description="created_at of the first episode")


def run_stats(conn: sqlite3.Connection) -> RunStats:
    columns = table_columns(conn)
    last_step = conn.execute("SELECT max(step) FROM episodes").fetchone()[0]
    if "split" in columns:
        splits = {str(r[0]): r[1] for r in conn.execute("SELECT split, count(*) FROM episodes GROUP BY split")}
    else:
        splits = {"all": conn.execute("SELECT count(*) FROM episodes").fetchone()[0]}
    envs = [r[0] for r in conn.execute("SELECT DISTINCT env FROM episodes WHERE step = ?", [last_step])]
    started = None
    if "created_at" in columns:
        first = conn.execute("SELECT created_at FROM episodes ORDER BY step LIMIT 1").fetchone()
        started = first[0] if first else None
    return RunStats(
        episodes=sum(splits.values()), last_step=last_step, splits=splits, envs=[str(e) for e in envs], started_at=started
    )
