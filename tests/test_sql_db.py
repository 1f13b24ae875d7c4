"""sql_db env and SQL tools: determinism, oracles, read-only safety under fuzzing, user data."""

from __future__ import annotations

import hashlib
import json
import random
import sqlite3
import time
from pathlib import Path

import pytest

from agentopd.tool import ToolError, tool_name
from agentopd.config import load_config
from envs.sql_db import SCHEMA_PROMPT, SYSTEM_PROMPT, SqlDbEnv, answers_match
from envs.sql_db.database import DB_VERSION, _is_current, default_db_path
from envs.sql_db.tasks import Difficulty, generate_tasks
from tools.sql import SqlDatabase


@pytest.fixture(scope="module")
def home(private_home):
    return private_home


@pytest.fixture(scope="module")
def env(home):
    e = SqlDbEnv(split="all")
    yield e
    e.close()


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def call(query: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"name": "sql_query", "arguments": {"query": query}}]}


# --- the generated database and tasks ---------------------------------------------------
def test_database_is_deterministic_cached_and_rebuilt(home, tmp_path):
    path = default_db_path()
    assert path == home / "envs" / "sql_db" / "default.db"
    first = sha256(path)
    path.unlink()
    assert sha256(default_db_path()) == first  # rebuilt when missing, byte for byte the same
    copy = tmp_path / "stale.db"
    copy.write_bytes(path.read_bytes())
    assert _is_current(copy)
    with sqlite3.connect(copy) as conn:  # another generator version: rebuilt on use
        conn.execute(f"PRAGMA user_version = {DB_VERSION + 1}")
    assert not _is_current(copy)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".default-")]  # no temp files left
    counts = {t: sqlite3.connect(path).execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("customers", "orders", "order_items")}
    assert counts["customers"] >= 300 and counts["orders"] >= 1000 and counts["order_items"] >= 2000


def test_splits_sizes_and_held_out_entities(env, home):
    train, evals = SqlDbEnv(split="train"), SqlDbEnv(split="eval")
    assert len(train.tasks) >= 3000 and 200 <= len(evals.tasks) <= 1000
    assert len(env.tasks) == len(train.tasks) + len(evals.tasks)
    assert not {t.id for t in train.tasks} & {t.id for t in evals.tasks}
    for split in (train, evals):
        assert {t.data["difficulty"] for t in split.tasks} == {d.value for d in Difficulty} - {"explore"}  # explore: by name only
    # a held-out customer is never named in a training question
    eval_customers = {t.id.split(":", 1)[1] for t in evals.tasks if t.data["template"] == "city_of"}
    train_text = " ".join(t.question for t in train.tasks)
    assert eval_customers and not any(f" {name}" in train_text for name in eval_customers)
    assert all(t.answer and "NULL" not in t.answer for t in env.tasks)  # NULL answers are left out
    two_step = [t for t in env.tasks if t.data["difficulty"] == "two_step"]
    assert all(isinstance(t.data["sql"], list) and len(t.data["sql"]) == 2 for t in two_step)
    # some answers can only be copied from the tool output: text values that are not in the question
    copied = [t for t in env.tasks if not any(ch.isdigit() for ch in t.answer) and t.answer not in t.question]
    assert len(copied) > 500
    train.close(), evals.close()


def test_same_seed_same_task_and_results(home):
    a, b = SqlDbEnv(), SqlDbEnv()
    for seed in (0, 1, 123):
        (ma, ia), (mb, ib) = a.reset(seed=seed), b.reset(seed=seed)
        assert ma == mb and ia == ib
        for action in a.oracle(a.task):
            assert a.step(action)[:4] == b.step(action)[:4]
    db = SqlDatabase(default_db_path())
    first, second = generate_tasks(db), generate_tasks(db)
    assert first == second
    db.close(), a.close(), b.close()


def run_oracle(env: SqlDbEnv, task) -> tuple[float, int]:
    env.reset(options={"task_id": task.id})
    actions = env.oracle(task)
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        assert all(not m["content"].startswith("Error:") for m in obs), obs
    assert terminated and not truncated and info["success"]
    return reward, len(actions)


def test_oracle_earns_reward_one(env):
    evals = [t for t in env.tasks if t.data["split"] == "eval"]
    train = [t for t in env.tasks if t.data["split"] == "train"]
    for task in evals + train:
        reward, n = run_oracle(env, task)
        assert reward == 1.0, task.id
        sql = task.data["sql"]
        assert n == (1 if isinstance(sql, str) else len(sql)) + 1
    task = env.tasks[0]
    env.reset(options={"task_id": task.id})
    assert env.step({"role": "assistant", "content": "not it", "tool_calls": []})[1] == 0.0


def test_answers_match_rule():
    assert answers_match("Boston", "  boston. ")
    assert answers_match("San Diego", "san   diego")
    assert answers_match("42", "42.0") and answers_match("42", "$42") and not answers_match("42", "43")
    assert answers_match("19.99", "19.990") and answers_match("1085.75", "1085.7501")
    assert not answers_match("1085.75", "1085.85") and not answers_match("100000", "100001")
    assert answers_match("Tent, Cooler, Hammock", "tent,cooler , hammock")
    assert not answers_match("Tent, Cooler", "Cooler, Tent")
    assert answers_match("Tent, Cooler", "Cooler, Tent", ordered=False)
    assert not answers_match("Tent, Cooler", "Tent") and not answers_match("27", "The answer is 27")
    assert not answers_match("27", "")


# --- the SQL tools ----------------------------------------------------------------------
def test_tool_output_format_and_caps(home):
    db = SqlDatabase(default_db_path(), max_rows=5, max_output_chars=300)
    out = db.sql_query("SELECT id, price, NULL AS note FROM products WHERE price = CAST(price AS INTEGER) ORDER BY id")
    lines = out.split("\n")
    assert lines[0] == "id | price | note" and len(lines) == 7
    assert lines[1].split(" | ")[1].isdigit() and lines[1].endswith(" | NULL")  # whole floats print as ints
    assert lines[-1].startswith("... ") and lines[-1].endswith(" more rows")
    assert db.sql_query("SELECT 2.50, 7.0, x'0102'") == "2.50 | 7.0 | x'0102'\n2.5 | 7 | <blob 2 bytes>"
    assert db.sql_query("SELECT 1 WHERE 0").endswith("(no rows)")
    long = db.sql_query("SELECT name, email FROM customers")
    assert len(long) <= 300 + 40 and long.endswith("more rows")
    endless = db.sql_query("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c")
    assert endless.endswith("... more than 10000 more rows")
    assert "customers | 400" in db.list_tables()
    desc = db.describe_table("ORDERS")
    assert "customer_id | INTEGER | -> customers.id" in desc and "id | INTEGER | primary key" in desc
    with pytest.raises(ToolError, match="no table named"):
        db.describe_table("nope")
    db.close()


@pytest.mark.parametrize(
    "query, reason",
    [
        ("DROP TABLE customers", "not allowed"),
        ("DELETE FROM orders", "DELETE is not allowed"),
        ("UPDATE products SET price = 0", "UPDATE is not allowed"),
        ("INSERT INTO stores(name) VALUES ('x')", "INSERT is not allowed"),
        ("ATTACH DATABASE ':memory:' AS other", "ATTACH is not allowed"),
        ("DETACH DATABASE main", "DETACH is not allowed"),
        ("PRAGMA writable_schema = 1", "PRAGMA writable_schema is not allowed"),
        ("PRAGMA journal_mode = delete", "PRAGMA journal_mode is not allowed"),
        ("PRAGMA query_only = 0", "PRAGMA query_only is not allowed"),
        ("SELECT * FROM pragma_journal_mode('delete')", "not allowed"),
        ("SELECT load_extension('/tmp/evil.so')", "load_extension"),
        ("CREATE TEMP TABLE t(x)", "not allowed"),
        ("VACUUM", "not allowed"),
        ("BEGIN", "TRANSACTION is not allowed"),
        ("SELECT randomblob(2000000000)", "larger than"),
        ("SELECT zeroblob(1000000000)", "larger than"),
        ("SELECT printf('%.*c', 2000000000, 'x')", "limited to"),
        ("SELECT 1; DROP TABLE customers", "one SQL statement"),
        ("SELECT 1 " + "+ 1 " * 5000, "characters long"),
        ("-- nothing", "no result table"),
        ("SELECT * FROM nope", "no such table"),
        ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c", "longer than 0.2 s"),
        ("SELECT count(*) FROM order_items a, order_items b, order_items c", "longer than 0.2 s"),
    ],
)
def test_refusals_are_readable_errors(home, query, reason):
    path = default_db_path()
    before = sha256(path)
    db = SqlDatabase(path, query_timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(ToolError, match=reason):
        db.sql_query(query)
    assert time.monotonic() - start < 1.0
    assert db.sql_query("SELECT COUNT(*) FROM customers") == "COUNT(*)\n400"  # still usable afterwards
    db.close()
    assert sha256(path) == before


def test_default_timeout_stops_a_runaway_query_in_about_one_second(home):
    db = SqlDatabase(default_db_path())
    start = time.monotonic()
    with pytest.raises(ToolError, match="longer than 1 s"):
        db.sql_query("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c")
    assert 0.9 < time.monotonic() - start < 1.6
    db.close()


# --- fuzzing the env with malformed and hostile actions ----------------------------------
HOSTILE_SQL = [
    "DROP TABLE customers", "DELETE FROM orders", "DELETE FROM orders WHERE 1", "UPDATE products SET price = 0",
    "INSERT INTO stores(name) VALUES ('x')", "REPLACE INTO stores(id, name) VALUES (1, 'x')",
    "ATTACH DATABASE '/tmp/x.db' AS x", "ATTACH ':memory:' AS m", "DETACH main", "PRAGMA writable_schema = 1",
    "PRAGMA writable_schema = ON", "PRAGMA journal_mode = delete", "PRAGMA journal_mode = WAL", "PRAGMA query_only = 0",
    "PRAGMA user_version = 5", "PRAGMA foreign_keys = OFF", "SELECT load_extension('x')", "VACUUM",
    "VACUUM INTO '/tmp/copy.db'", "CREATE TABLE t(x)", "CREATE INDEX i ON orders(status)", "CREATE VIEW v AS SELECT 1",
    "DROP INDEX idx_orders_status", "ALTER TABLE customers ADD COLUMN y", "ANALYZE", "BEGIN", "COMMIT",
    "SAVEPOINT s", "SELECT randomblob(2000000000)", "SELECT zeroblob(1000000000)", "SELECT hex(randomblob(99999))",
    "SELECT printf('%.*c', 2000000000, 'x')", "SELECT format('%.1000000000c', 'x')", "SELECT 1; SELECT 2",
    "SELECT 1; DROP TABLE customers", "SELECT * FROM customers; DELETE FROM orders", "SELECT * FROM 顧客",
    "SELECT \x00", "SELECT '\ud800'", "SELEC 1", "", "   ", ";", "-- just a comment", "SELECT * FROM nope",
    "SELECT 1 " + "+ 1 " * 4000, "SELECT " + "(" * 2000 + "1" + ")" * 2000, "x" * 50_000,
    "SELECT * FROM pragma_journal_mode('delete')",
]  # fmt: skip
RUNAWAY_SQL = [
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c",
    "SELECT count(*) FROM order_items a, order_items b, order_items c",
    "SELECT a.id FROM order_items a, order_items b, order_items c ORDER BY random() LIMIT 1",
]
VALID_ODD_SQL = [
    "SELECT 'Zoë Ødegård', '日本語', '🙂'", "SELECT COUNT(*) FROM customers WHERE name = 'Zoë Ødegård'",
    "select   count(*)   from   orders", "SELECT * FROM customers", "PRAGMA table_info(orders)",
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c",
    "SELECT a.id FROM order_items a, order_items b", "SELECT printf('%.2f', 3.14159)",
    "SELECT name FROM customers WHERE name = 'x'; --",
]  # fmt: skip
JUNK_ARGUMENTS = [None, 5, "SELECT 1", ["SELECT 1"], {"query": 5}, {"query": None}, {"query": ["SELECT 1"]},
                  {"query": {"q": 1}}, {"query": True}, {}, {"sql": "SELECT 1"}, {"query": "SELECT 1", "extra": 1},
                  '{"query": ', '{"query": 1}', "{'query': 'SELECT 1'}", "null", "[]", 3.5]  # fmt: skip


def fuzz_actions(rng: random.Random, n: int) -> list[tuple[object, bool]]:
    """(action, must_be_refused) pairs; runaway queries are kept few because each costs a timeout."""
    out: list[tuple[object, bool]] = [(call(q), True) for q in RUNAWAY_SQL * 2]
    while len(out) < n:
        kind = rng.randrange(10)
        if kind <= 2:
            out.append((call(rng.choice(HOSTILE_SQL)), True))
        elif kind == 3:
            out.append(({"role": "assistant", "content": "", "tool_calls": [{"name": "sql_query", "arguments": rng.choice(JUNK_ARGUMENTS)}]}, True))
        elif kind == 4:
            name = rng.choice(["drop_table", "", None, 7, "sql_query ", "SQL_QUERY", "eval", "é" * 300, ["sql_query"]])
            out.append(({"role": "assistant", "content": "", "tool_calls": [{"name": name, "arguments": {"query": "SELECT 1"}}]}, True))
        elif kind == 5:
            table = rng.choice(["customers'; DROP TABLE customers; --", "nope", "", "顧客", "x" * 5000, 5, None])
            args = {"name": table} if isinstance(table, str) else {"name": table, "x": 1}
            out.append(({"role": "assistant", "content": "", "tool_calls": [{"name": "describe_table", "arguments": args}]}, True))
        elif kind == 6:
            out.append((rng.choice([None, "SELECT 1", 5, [], {"role": "assistant", "tool_calls": "sql_query"},
                                    {"role": "assistant", "content": "", "tool_calls": [5]},
                                    {"role": "assistant", "content": "", "tool_calls": [None, "x"]}]), True))  # fmt: skip
        elif kind == 7:
            garbage = "".join(rng.choice("SELECT*FROM ();'\"\\%_-+é日\n\t") for _ in range(rng.randrange(1, 200)))
            out.append((call(garbage), False))
        elif kind == 8:
            out.append((call(rng.choice(VALID_ODD_SQL)), False))
        else:  # several calls in one turn, good and bad
            calls = [{"name": "sql_query", "arguments": {"query": rng.choice(HOSTILE_SQL)}},
                     {"name": "list_tables", "arguments": {}}, {"name": "describe_table", "arguments": {"name": "orders"}}]  # fmt: skip
            out.append(({"role": "assistant", "content": "", "tool_calls": calls}, False))
    rng.shuffle(out)
    return out


def fuzz(env: SqlDbEnv, actions: list[tuple[object, bool]]) -> int:
    env.reset(seed=0)
    refused = 0
    for i, (action, must_be_refused) in enumerate(actions):
        start = time.monotonic()
        obs, reward, terminated, truncated, info = env.step(action)
        assert time.monotonic() - start < 2.0, action
        errors = [m for m in obs if m["content"].startswith("Error:")]
        assert all(m["role"] == "tool" and isinstance(m["content"], str) for m in obs)
        assert info["tool_errors"] == len(errors), (action, obs)
        if must_be_refused:
            assert obs and len(errors) == len(obs), (action, obs)
        refused += len(errors)
        assert reward == 0.0
        if terminated or truncated or i % 5 == 4:
            env.reset(seed=i)
    return refused


def test_fuzz_never_raises_and_never_changes_the_database(home):
    path = default_db_path()
    before = sha256(path)
    env = SqlDbEnv(query_timeout_s=0.2)
    refused = fuzz(env, fuzz_actions(random.Random(0), 1200))
    assert refused >= 800
    env.close()
    assert sha256(path) == before
    assert not (path.parent / "default.db-wal").exists() and not (path.parent / "default.db-journal").exists()


# --- users' own database and tasks -------------------------------------------------------
@pytest.fixture
def library(tmp_path) -> Path:
    """A user database with a schema unlike the generated one (and a WAL-mode journal)."""
    path = tmp_path / "library.sqlite"
    with sqlite3.connect(path) as conn:
        conn.executescript(
            """
            PRAGMA journal_mode = WAL;
            CREATE TABLE authors (author_id INTEGER PRIMARY KEY, full_name TEXT, born INTEGER);
            CREATE TABLE books (isbn TEXT PRIMARY KEY, title TEXT, author_id INTEGER REFERENCES authors(author_id),
                                pages INTEGER, rating REAL);
            INSERT INTO authors VALUES (1, 'Ursula K. Le Guin', 1929), (2, 'Octavia Butler', 1947), (3, 'Italo Calvino', 1923);
            INSERT INTO books VALUES ('a1', 'The Dispossessed', 1, 387, 4.5), ('a2', 'A Wizard of Earthsea', 1, 183, 4.0),
                ('b1', 'Kindred', 2, 264, 4.75), ('b2', 'Parable of the Sower', 2, 345, 4.25),
                ('c1', 'Invisible Cities', 3, 165, 4.0), ('c2', 'Cosmicomics', 3, 153, NULL);
            """
        )
    conn.close()
    return path


def write_tasks(path: Path, lines: list) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    return path


def test_user_database_and_tasks(library, tmp_path):
    before = sha256(library)
    tasks = write_tasks(tmp_path / "tasks.jsonl", [
        {"id": "count", "question": "How many books are there?", "sql": "SELECT COUNT(*) FROM books"},
        {"id": "avg", "question": "Average rating of Kindred's author?", "sql": "SELECT ROUND(AVG(rating), 3) FROM books WHERE author_id = 2"},
        {"id": "top2", "question": "The two longest books?", "sql": "SELECT title FROM books ORDER BY pages DESC LIMIT 2"},
        {"id": "set", "question": "Books by Calvino?", "sql": "SELECT title FROM books WHERE author_id = 3", "split": "eval"},
        {"id": 7, "question": "Oldest author?", "answer": "Italo Calvino"},
        {"id": "both", "question": "Pages of Kindred?", "sql": "SELECT pages FROM books WHERE title = 'Kindred'", "answer": 264.0},
        "",
        {"id": "two", "question": "Who wrote Kindred, and when were they born?",
         "sql": ["SELECT author_id FROM books WHERE title = 'Kindred'", "SELECT born FROM authors WHERE author_id = 2"]},
    ])  # fmt: skip
    env = SqlDbEnv(db_path=library, tasks=tasks, split="all", query_timeout_s=0.2)
    by_id = {t.id: t for t in env.tasks}
    assert by_id["count"].answer == "6" and by_id["avg"].answer == "4.5" and by_id["both"].answer == "264"
    assert by_id["top2"].answer == "The Dispossessed, Parable of the Sower" and by_id["top2"].data["ordered"]
    assert not by_id["set"].data["ordered"] and by_id["two"].answer == "1947"
    for task in env.tasks:
        assert run_oracle(env, task)[0] == 1.0, task.id
    assert env.oracle(by_id["7"]) == [{"role": "assistant", "content": "Italo Calvino", "tool_calls": []}]
    env.reset(options={"task_id": "set"})
    assert env.step({"role": "assistant", "content": "cosmicomics, Invisible Cities", "tool_calls": []})[1] == 1.0
    env.reset(options={"task_id": "top2"})
    assert env.step({"role": "assistant", "content": "Parable of the Sower, The Dispossessed", "tool_calls": []})[1] == 0.0
    messages, info = env.reset(seed=0)
    assert {s["function"]["name"] for s in info["tools"]} == {"sql_query", "list_tables", "describe_table"}
    obs = env.step({"role": "assistant", "content": "", "tool_calls": [
        {"name": "list_tables", "arguments": {}}, {"name": "describe_table", "arguments": {"name": "books"}}]})[0]  # fmt: skip
    assert obs[0]["content"] == "table | rows\nauthors | 3\nbooks | 6"
    assert "author_id | INTEGER | -> authors.author_id" in obs[1]["content"]
    held = {t.id for t in SqlDbEnv(db_path=library, tasks=tasks, split="eval").tasks}
    train = {t.id for t in SqlDbEnv(db_path=library, tasks=tasks, split="train").tasks}
    assert len(held) == 2 and "set" in held and held | train == set(by_id) and not held & train  # 1 of 6 unmarked held out
    fuzz(env, fuzz_actions(random.Random(1), 300))
    env.close()
    assert sha256(library) == before
    assert sorted(p.name for p in library.parent.iterdir()) == ["library.sqlite", "tasks.jsonl"]  # no -wal/-shm


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"id": 1, "question": "q", "sql": "SELECT 1"', "invalid JSON"),
        ('["not", "an", "object"]', "expected a JSON object"),
        ({"id": "x", "sql": "SELECT 1"}, "missing 'question'"),
        ({"id": "x", "question": "   ", "answer": "1"}, "missing 'question'"),
        ({"id": "x", "question": "q"}, "needs 'sql' or 'answer'"),
        ({"id": "x", "question": "q", "sql": "SELECT * FROM nope"}, r"sql\[0\] failed: no such table"),
        ({"id": "x", "question": "q", "sql": "DELETE FROM books"}, "DELETE is not allowed"),
        ({"id": "x", "question": "q", "sql": ["SELECT 1", ""]}, "non-empty string or a list"),
        ({"id": "x", "question": "q", "sql": "SELECT title FROM books WHERE 0"}, "returns no rows"),
        ({"id": "x", "question": "q", "sql": "SELECT COUNT(*) FROM books", "answer": "7"}, "disagrees"),
        ({"id": "x", "question": "q", "answer": ["a"]}, "'answer' must be"),
        ({"id": "x", "question": "q", "answer": "1", "split": "test"}, "'split' must be"),
        ({"id": "ok", "question": "q", "answer": "1"}, "duplicate id 'ok'"),
    ],
)
def test_malformed_task_files_name_the_line(library, tmp_path, line, message):
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": "ok", "question": "q", "answer": "1"}, "", line])
    with pytest.raises(ValueError, match=f"tasks.jsonl:3: .*{message}"):
        SqlDbEnv(db_path=library, tasks=tasks)


def test_task_sql_checked_on_the_built_in_database_says_so(library, tmp_path, home):
    """Issue 55, item 2: a task file given without its env.db_path is checked against the built-in database; the error
    blamed the line ("the sql returns no rows") without saying which database the sql ran on."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": "a", "question": "q", "sql": "SELECT title FROM books"}])
    with pytest.raises(ValueError, match=r"tasks\.jsonl:1: sql\[0\] failed on the built-in database \(tasks about your own need env\.db_path=\.\.\.\): no such table"):
        SqlDbEnv(tasks=tasks)
    SqlDbEnv(db_path=library, tasks=write_tasks(tmp_path / "two.jsonl", [{"id": i, "question": "q", "sql": "SELECT title FROM books"} for i in "ab"]))


def test_bad_kwargs_are_value_errors(library, tmp_path, home):
    with pytest.raises(ValueError, match="split"):
        SqlDbEnv(split="test")
    with pytest.raises(ValueError, match="needs tasks"):
        SqlDbEnv(db_path=library)
    with pytest.raises(ValueError, match="no SQLite file"):
        SqlDbEnv(db_path=tmp_path / "missing.db", tasks=tmp_path / "t.jsonl")
    (tmp_path / "junk.db").write_bytes(b"not a database" * 100)
    with pytest.raises(ValueError, match="not a readable SQLite database"):
        SqlDbEnv(db_path=tmp_path / "junk.db", tasks=tmp_path / "t.jsonl")
    with pytest.raises(ValueError, match="no file"):
        SqlDbEnv(db_path=library, tasks=tmp_path / "t.jsonl")
    with pytest.raises(ValueError, match="max_turns"):
        SqlDbEnv(max_turns="many")


def test_registered_entry_points(home):
    from agentopd.registry import make_env, plugins

    env = make_env("sql_db", split="eval", max_turns=3, schema_in_prompt=True)
    assert isinstance(env, SqlDbEnv) and env.max_turns == 3
    system = env.reset(seed=0)[0][0]["content"]
    assert "only the final value" in system and "orders(id, customer_id, store_id" in system
    assert plugins("agentopd.tools")["sql"].obj is SqlDatabase
    env.close()
    env.close()  # twice is fine


def test_the_schema_prompt_is_asked_for(home):
    """schema_in_prompt=True (real checkpoints) shows the tables and says to query; the default and the presets keep the
    short prompt the embedded default is trained on (its tokenizer is trained on the envs' default text)."""
    def system(**kwargs) -> str:
        env = SqlDbEnv(split="eval", **kwargs)
        try:
            return env.reset(seed=0)[0][0]["content"]
        finally:
            env.close()

    shown = system(schema_in_prompt=True)
    assert shown.startswith(SCHEMA_PROMPT) and "customers(id, name, email, city, signup_year)" in shown
    assert system() == SYSTEM_PROMPT and system(difficulty=["explore"]) == SYSTEM_PROMPT
    assert load_config("sql_db").env.kwargs["schema_in_prompt"] is False
    assert load_config("sql_db_explore").env.kwargs["schema_in_prompt"] is False


def test_list_tables_survives_an_endless_view(tmp_path):
    path = tmp_path / "views.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE a (x INTEGER)")
        conn.execute("CREATE VIEW endless AS WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c")
    conn.close()
    db = SqlDatabase(path, query_timeout_s=0.1)
    assert db.list_tables() == "table | rows\na | 0\nendless | ?"
    assert db.describe_table("endless") == "column | type | key\nx | ANY | "
    db.close()


def test_a_turn_of_many_runaway_calls_shares_one_time_budget(home):
    env = SqlDbEnv(query_timeout_s=0.3)
    env.reset(seed=0)
    runaway = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
    calls = [{"name": "sql_query", "arguments": {"query": runaway}}] * 6
    start = time.monotonic()
    obs, _, _, _, info = env.step({"role": "assistant", "content": "", "tool_calls": calls})
    assert time.monotonic() - start < 0.6
    assert info["tool_errors"] == 6 and "longer than 0.3 s" in obs[0]["content"]
    assert all("no query time left" in m["content"] for m in obs[1:])
    obs = env.step(call("SELECT COUNT(*) FROM stores"))[0]  # the next turn has its own budget
    assert obs[0]["content"] == "COUNT(*)\n8"
    env.close()


def test_tools_subset_shortens_the_prompt_and_refuses_the_others(home):
    full, only = SqlDbEnv(), SqlDbEnv(tools=["sql_query"])
    try:
        _, info_full = full.reset(seed=0)
        _, info = only.reset(seed=0)
        assert [t["function"]["name"] for t in info_full["tools"]] == ["sql_query", "list_tables", "describe_table"]
        assert [t["function"]["name"] for t in info["tools"]] == ["sql_query"]
        obs, reward, terminated, _, info = only.step(
            {"role": "assistant", "content": "", "tool_calls": [{"name": "list_tables", "arguments": {}}]}
        )
        assert obs[0]["content"].startswith("Error:") and "list_tables" in obs[0]["content"]
        assert info["tool_errors"] == 1 and not terminated
        for action in only.oracle(only.task):  # the oracle needs sql_query only
            obs, reward, terminated, _, _ = only.step(action)
        assert reward == 1.0
    finally:
        full.close()
        only.close()
    for bad in (["sql_query", "drop_table"], [], "drop_table", [{"name": "sql_query"}]):
        with pytest.raises(ValueError, match="tools must be a non-empty list"):
            SqlDbEnv(tools=bad)
    one = SqlDbEnv(tools="sql_query")  # one name, not a list
    try:
        assert [tool_name(t) for t in one.tools()] == ["sql_query"]
    finally:
        one.close()


def test_generated_selection_is_made_once_per_process(monkeypatch):
    """A rollout builds an env per episode: the split/difficulty selection over the ~5,700 generated
    tasks is computed once per process, not per env (it was ~3 ms of every env)."""
    import envs.sql_db as sql_env

    calls = []
    real = sql_env._select
    monkeypatch.setattr(sql_env, "_select", lambda *a: calls.append(a[1:]) or real(*a))
    sql_env._default_selection.cache_clear()
    envs = [sql_env.SqlDbEnv(difficulty=["join", "count"]) for _ in range(3)]
    assert len(calls) == 1 and all(e.tasks == envs[0].tasks for e in envs)
    assert sql_env.SqlDbEnv(difficulty=["count", "join"]).tasks == envs[0].tasks and len(calls) == 1  # same set, any order
    assert {t.data["difficulty"] for t in envs[0].tasks} == {"count", "join"}


def test_difficulty_as_one_name_or_a_list():
    import envs.sql_db as sql_env

    one = sql_env.SqlDbEnv(difficulty="count")  # one name, not a list
    assert one.tasks == sql_env.SqlDbEnv(difficulty=["count"]).tasks and {t.data["difficulty"] for t in one.tasks} == {"count"}
    with pytest.raises(ValueError, match=r"unknown difficulty \['hard'\]"):
        sql_env.SqlDbEnv(difficulty="hard")
