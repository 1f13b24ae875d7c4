"""sql_db: answer questions about a SQLite database with read-only SQL tools.

    env = agentopd.make_env("sql_db")                        # built-in shop database, train split
    env = agentopd.make_env("sql_db", split="eval")          # held-out customers, products, orders...
    env = agentopd.make_env("sql_db", db_path="my.db", tasks="my_tasks.jsonl")
    messages, info = env.reset(seed=0)
    for action in env.oracle(env.task):                      # reference solution: reward 1
        obs, reward, terminated, truncated, info = env.step(action)

Tools (from `tools.sql.SqlDatabase`, the file opened read-only): `sql_query(query)`,
`list_tables()`, `describe_table(name)`. The model answers with only the final value(s);
reward is 1 when `answers_match(task.answer, answer, ordered=task.data["ordered"])` (the rule is
in `envs.sql_db.tasks`: strip, case-fold, collapse whitespace, numbers compared numerically
with a 1e-6 relative tolerance and whole floats as ints, comma-separated lists compared in
order for top-k / ordered SQL, else as multisets), else 0.

Kwargs:
    db_path          any SQLite file (opened read-only, never modified); default: the generated
                     database at $AGENTOPD_HOME/envs/sql_db/default.db, built on first use
    tasks            a JSONL task file (format in `envs.sql_db.tasks`); required with db_path
    split            "train" | "eval" | "all" (default "train"). Generated tasks: eval holds the
                     held-out entities. User tasks: a line's optional "split" key, else 20% of the
                     lines held out by a hash of their ids (`agentopd.splits.split_user_tasks`)
    max_turns        default 6
    query_timeout_s  default 1.0: a query running longer is stopped and reported
    max_rows         default 50 rows shown per result, then "... N more rows"
    max_output_chars default 2000 characters per tool result
    schema_in_prompt default False: the short SYSTEM_PROMPT (the embedded default is trained on this database);
                     True: every table's columns in the system prompt and a prompt that says the answer must be
                     queried (SCHEMA_PROMPT: what a model that has never seen the database needs; not meant for the
                     explore family, whose schema is looked up)
    difficulty       default None (the five classic families): keep only these task families of
                     the generated set, e.g. [count, join] or one name; user task lines (no family)
                     are always kept. `explore` is chosen only by name: its questions need the
                     schema looked up, so it is meant with schema_in_prompt=False and all three
                     tools (configs/sql_db_explore.yaml: max_turns 8)
    error_hints      default None = on exactly when the explore family is chosen: "no such table"
                     errors list the tables, "no such column" the columns of the tables queried
    tools            default None (all three): offer only these tools, e.g. [sql_query] or one
                     name (each tool's schema costs prompt tokens; calling one not offered is a
                     tool error)
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from agentopd.env import Action, Privileged, Split, Task, ToolEnv, actions_text
from agentopd.splits import split_user_tasks
from agentopd.tool import Tool, tool_name
from envs.sql_db.database import default_db_path
from envs.sql_db.tasks import CLASSIC, Difficulty, answers_match, first_cell, generate_tasks, load_tasks_jsonl
from tools.sql import SqlDatabase

__all__ = ["SCHEMA_PROMPT", "SYSTEM_PROMPT", "SqlDbEnv", "Split", "answers_match"]

SYSTEM_PROMPT = (
    "You answer questions about a SQLite database. Use the tools to query it. "
    "When you know the answer, reply with only the final value(s), comma-separated, nothing else."
)
# with the schema shown (schema_in_prompt=True, what real checkpoints need): a model that has never seen this database
# is told that it must query it. Off by default: as the preset's default it changed the text a fresh home's embedded
# tokenizer is trained on, and the calculator's embedded teacher fell from 89% to 14% (2026-11-29).
# Qwen2.5-Coder-1.5B-Instruct, 16 held-out tasks, greedy (2026-11-29): 0/16 with the prompt above and no schema;
# 3/16 with this one and the tables (its answers from memory -- '1', '2023-04-15' -- otherwise)
SCHEMA_PROMPT = (
    "You answer questions about a SQLite database. You cannot see its rows: always run a SQL query with the "
    "sql_query tool first, then reply with only the final value(s) from its result, comma-separated, nothing else."
)


# an explore lookup when its tool is not offered
_LOOKUP_SQL = {
    "list_tables": "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name",
    "describe_table": "SELECT name, type FROM pragma_table_info('{name}')",
}


@cache
def _default_tasks(db_path: str, mtime_ns: int, explore: bool) -> tuple[Task, ...]:
    """Generated tasks, computed once per process (and per version of the database file)."""
    db = SqlDatabase(db_path, query_timeout_s=10.0)
    try:
        return tuple(generate_tasks(db, explore=explore))
    finally:
        db.close()


def _select(tasks: Sequence[Task], split: Split, difficulty: tuple[str, ...] | None) -> list[Task]:
    """The tasks of `split` (tasks without a split are in every split) and of the given difficulties,
    None = the classic five (tasks without one, i.e. users' tasks, are kept)."""
    chosen = [t for t in tasks if split == Split.ALL or t.data.get("split") in (None, split)]
    families = CLASSIC if difficulty is None else difficulty
    return [t for t in chosen if "difficulty" not in t.data or t.data["difficulty"] in families]


@cache
def _default_selection(db_path: str, mtime_ns: int, split: Split, difficulty: tuple[str, ...] | None) -> tuple[Task, ...]:
    """`_select` over the generated tasks, once per process: a rollout makes an env per episode."""
    explore = difficulty is not None and Difficulty.EXPLORE in difficulty  # the explore family only when chosen (~0.6 s)
    return tuple(_select(_default_tasks(db_path, mtime_ns, explore), split, difficulty))


def _number(name: str, value: Any, kind: type) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"sql_db: {name} must be a number, got {value!r}") from None


class SqlDbEnv(ToolEnv):
    """Text-to-SQL question answering over a read-only SQLite file (see the module docstring)."""

    name = "sql_db"

    def __init__(
        self,
        db_path: str | Path | None = None,
        tasks: str | Path | None = None,
        split: str = "train",
        max_turns: int = 6,
        query_timeout_s: float = 1.0,
        max_rows: int = 50,
        max_output_chars: int = 2000,
        schema_in_prompt: bool = False,
        difficulty: list[str] | None = None,
        tools: list[str] | None = None,
        error_hints: bool | None = None,
    ):
        self.split = Split.parse(split, "sql_db")
        if db_path is not None and tasks is None:
            raise ValueError("sql_db: db_path needs tasks=... (a JSONL file): generated tasks only fit the built-in database")
        path = Path(db_path) if db_path is not None else default_db_path()
        self.db = SqlDatabase(
            path,
            query_timeout_s=_number("query_timeout_s", query_timeout_s, float),
            max_rows=_number("max_rows", max_rows, int),
            max_output_chars=_number("max_output_chars", max_output_chars, int),
        )
        self.max_tool_output_chars = self.db.max_output_chars + 200  # our own cap already applied
        if isinstance(difficulty, str):  # make_env("sql_db", difficulty="count"): one family
            difficulty = [difficulty]
        if difficulty is not None:
            known = {d.value for d in Difficulty}
            unknown = sorted(set(difficulty) - known)
            if unknown:
                raise ValueError(f"sql_db: unknown difficulty {unknown}; choose from {sorted(known)}")
            difficulty = tuple(sorted(set(difficulty)))
        explore = Difficulty.EXPLORE in (difficulty or ())
        self.db.hints = bool(explore if error_hints is None else error_hints)
        if tasks is None:
            chosen = list(_default_selection(str(path.resolve()), path.stat().st_mtime_ns, self.split, difficulty))
        else:
            builtin = "the built-in database (tasks about your own need env.db_path=...)" if db_path is None else None
            chosen = _select(split_user_tasks(load_tasks_jsonl(tasks, self.db, builtin), self.split, tasks), Split.ALL, difficulty)
        if not chosen:
            raise ValueError(f"sql_db: no tasks in split {self.split.value!r} of {tasks or 'the generated set'}")
        self.schema_in_prompt = bool(schema_in_prompt)
        self._tool_list: list[Tool] = [self.db.sql_query, self.db.list_tables, self.db.describe_table]
        if isinstance(tools, str):  # make_env("sql_db", tools="sql_query"): one tool
            tools = [tools]
        if tools is not None:
            offered = {tool_name(t): t for t in self._tool_list}
            if not tools or any(not isinstance(n, str) or n not in offered for n in tools):
                raise ValueError(f"sql_db: tools must be a non-empty list of {sorted(offered)}, got {tools!r}")
            self._tool_list = [offered[name] for name in dict.fromkeys(tools)]
        self._prompt = f"{SCHEMA_PROMPT}\n{self._tables()}" if self.schema_in_prompt else SYSTEM_PROMPT
        super().__init__(chosen, max_turns=_number("max_turns", max_turns, int))

    def tools(self) -> list[Tool]:
        return self._tool_list

    def _tables(self) -> str:
        return "Tables: " + "; ".join(f"{t}({', '.join(c.name for c in cols)})" for t, cols in self.db.schema.items())

    def privileged_context(self, task: Task, kind: Privileged) -> str | None:
        """SOLUTION: the oracle's calls (the gold SQL, an explore task's lookups first) and the answer; SCHEMA: every
        table's columns, as `schema_in_prompt` would show them (what the explore family hides)."""
        if kind == Privileged.SCHEMA:
            return self._tables()
        return actions_text(self.oracle(task))

    def system_prompt(self) -> str:
        return self._prompt

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        messages, info = super().reset(seed=seed, options=options)
        info["difficulty"] = self.task.data.get("difficulty", "user")
        return messages, info

    def step(self, action: Action):
        with self.db.turn_budget():  # every tool call of this turn shares query_timeout_s
            return super().step(action)

    def grade(self, task: Task, answer: str) -> float:
        assert task.answer is not None, task.id
        return 1.0 if answers_match(task.answer, answer, ordered=bool(task.data.get("ordered", False))) else 0.0

    def oracle(self, task: Task) -> list[Action]:
        """The lookups of an explore task (list_tables, describe_table: one call a turn; the same in
        SQL when those tools are not offered), one
        `sql_query` call per gold query (a two-step task's second query is built from the first
        one's real output), then the expected answer."""
        sql = task.data.get("sql")
        queries = [] if sql is None else [sql] if isinstance(sql, str) else list(sql)
        next_sql = task.data.get("next_sql")
        offered = {tool_name(t) for t in self._tool_list}
        actions: list[Action] = []
        for name, arguments in task.data.get("lookups", ()):
            if name not in offered:  # tools=[sql_query]: the same lookup in SQL
                name, arguments = "sql_query", {"query": _LOOKUP_SQL[name].format(**arguments)}
            actions.append({"role": "assistant", "content": "", "tool_calls": [{"name": name, "arguments": dict(arguments)}]})
        output = ""
        for i, query in enumerate(queries):
            if i == 1 and next_sql is not None:
                query = next_sql.replace("{value}", first_cell(output))
            output = self.db.sql_query(query)
            actions.append(
                {"role": "assistant", "content": "", "tool_calls": [{"name": "sql_query", "arguments": {"query": query}}]}
            )
        actions.append({"role": "assistant", "content": task.answer or "", "tool_calls": []})
        return actions

    def close(self) -> None:
        super().close()
        if getattr(self, "db", None) is not None:
            self.db.close()
            self.db = None
