"""sql_db's explore family: schema looked up with 2-4 tool calls, informative errors, held-out
entities, the classic families untouched, and the env checker's verdict."""

from __future__ import annotations

import collections

import pytest

from agentopd.checker import Status, check_env
from agentopd.tool import ToolError
from envs.sql_db import SqlDbEnv
from envs.sql_db import tasks as sql_tasks
from envs.sql_db.database import default_db_path
from tools.sql import SqlDatabase


@pytest.fixture(scope="module")
def home(private_home):
    return private_home


@pytest.fixture(scope="module")
def explore(home):
    env = SqlDbEnv(split="all", difficulty=["explore"])
    yield env
    env.close()


def play(env: SqlDbEnv, task, actions) -> tuple[float, int, list[str]]:
    env.reset(options={"task_id": task.id})
    errors, names = 0, []
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        errors += info["tool_errors"]
        names += [c["name"] for c in action["tool_calls"]]
    assert terminated and not truncated
    return reward, errors, names


def test_every_explore_task_is_solved_by_its_oracle_in_two_to_four_calls(explore):
    calls = collections.Counter()
    for task in explore.tasks:
        reward, errors, names = play(explore, task, explore.oracle(task))
        assert reward == 1.0 and errors == 0, task.id
        assert 2 <= len(names) <= 4 and names[-1] == "sql_query", (task.id, names)
        assert "describe_table" in names  # the schema is never given: the oracle reads it
        calls[len(names)] += 1
    assert set(calls) == {2, 3, 4} and min(calls.values()) > 300
    assert len({t.data["template"] for t in explore.tasks}) >= 12


def test_explore_prompt_hides_the_schema_and_offers_every_tool(explore):
    messages, info = explore.reset(seed=0)
    assert [t["function"]["name"] for t in info["tools"]] == ["sql_query", "list_tables", "describe_table"]
    text = " ".join(m["content"] for m in messages)
    assert "signup_year" not in text and "order_items" not in text
    assert explore.max_turns == 6  # the env's default; the preset gives 8
    from agentopd.config import load_config

    cfg = load_config("sql_db_explore")
    assert cfg.env.kwargs["difficulty"] == ["explore"] and cfg.env.kwargs["max_turns"] == 8 and cfg.env.kwargs["tools"] is None


def test_with_sql_query_only_the_oracle_looks_up_in_sql(home):
    env = SqlDbEnv(split="train", difficulty="explore", tools=["sql_query"])
    try:
        for task in env.tasks[:200]:
            reward, errors, names = play(env, task, env.oracle(task))
            assert reward == 1.0 and errors == 0 and set(names) == {"sql_query"}
    finally:
        env.close()


def test_held_out_entities_never_reach_training_questions(home):
    train, evals = SqlDbEnv(split="train", difficulty="explore"), SqlDbEnv(split="eval", difficulty="explore")
    try:
        assert len(train.tasks) > 2000 and 200 <= len(evals.tasks) <= 800
        assert not {t.id for t in train.tasks} & {t.id for t in evals.tasks}
        train_text = " ".join(t.question for t in train.tasks)
        held = {t.id.split(":", 1)[1] for t in evals.tasks if t.data["template"] in ("x_email", "x_earns")}
        assert held and not any(f"of {name}?" in train_text or f"does {name} " in train_text for name in held)
    finally:
        train.close(), evals.close()


def test_errors_name_what_exists_only_where_hints_are_on(explore, home):
    db = explore.db
    assert db.hints
    with pytest.raises(ToolError, match=r"^no such column: signup; columns: customers\(id, name, email, city, signup_year\)$"):
        db.query("SELECT COUNT(*) FROM customers WHERE signup = 2020")
    with pytest.raises(ToolError, match=r"no such column: s\.nam; columns: employees\(.*salary\); stores\(id, name, city, opened_year\)"):
        db.query("SELECT s.nam FROM employees e JOIN stores s ON s.id = e.store_id")
    with pytest.raises(ToolError, match=r"^no such table: customer; tables: customers, employees, order_items, orders, products, stores$"):
        db.query("SELECT * FROM customer")
    classic = SqlDbEnv(difficulty=["count", "join"])
    try:  # the classic families' errors are what they were
        assert not classic.db.hints
        with pytest.raises(ToolError, match=r"^no such column: signup$"):
            classic.db.query("SELECT COUNT(*) FROM customers WHERE signup = 2020")
        assert SqlDbEnv(difficulty=["count"], error_hints=True).db.hints
    finally:
        classic.close()


def test_classic_families_are_unchanged_by_the_explore_family(home, monkeypatch):
    db = SqlDatabase(default_db_path())
    try:
        everything = sql_tasks.generate_tasks(db)
        classic_only = sql_tasks.generate_tasks(db, explore=False)  # what a classic env generates
        monkeypatch.setattr(sql_tasks, "EXPLORE_TEMPLATES", ())
        before = sql_tasks.generate_tasks(db)  # as if the explore family had never been added
    finally:
        db.close()
    classic = [t for t in everything if t.data["difficulty"] != "explore"]
    assert classic == before == classic_only and everything[: len(before)] == before
    env = SqlDbEnv(split="all")  # difficulty=None: the classic five only
    try:
        assert {t.data["difficulty"] for t in env.tasks} == set(sql_tasks.CLASSIC)
    finally:
        env.close()


def test_explore_passes_the_env_checker(home):
    report = check_env("sql_db", difficulty=["explore"], fuzz_steps=200, oracle_tasks=20)
    failed = [(c.name, c.detail) for c in report.checks if c.status == Status.FAIL]
    assert not failed
