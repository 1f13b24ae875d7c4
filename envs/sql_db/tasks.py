"""sql_db tasks: generated questions over the built-in database, and users' JSONL task files.

    from envs.sql_db.tasks import generate_tasks, load_tasks_jsonl
    tasks = generate_tasks(db)                  # every split; task.data["split"] is "train" or "eval"
    mine = load_tasks_jsonl("tasks.jsonl", db)  # ValueError naming the file and line on a bad line

Generated tasks combine short, regular question templates with parameters drawn from the
database, at five difficulties (count, join, aggregate, topk, two_step), plus the `explore`
family (questions worded without column names, for an agent that must look the schema up;
`data["lookups"]` lists the list_tables / describe_table calls its oracle makes). Every task carries
its gold SQL (`data["sql"]`: a string, or a list of two for two-step tasks, where the second
is built from the first's printed result via `data["next_sql"]` with `{value}`) and its
answer, computed by running that SQL. Money is rounded in the gold SQL; top-k questions whose
ranking has ties are left out, as are questions whose answer would be NULL.

Held-out entities: 10% of customers, products, orders and employees and 2 of the 20 cities
(chosen with a fixed seed) appear only in eval questions; templates without such an entity
hold out 15% of their parameter combinations (store x year, category x k, ...) instead.

Grading (`answers_match(expected, given, ordered=True)`), reward 1 on a match, else 0:
- both sides are split into items at commas and newlines (a multi-value answer is a
  comma-separated list, e.g. "Camping Tent, Cooler, Hammock"); empty items are dropped;
- each item is stripped, case-folded, its whitespace collapsed, surrounding quotes and a
  trailing period removed;
- an item that reads as a number (optionally after a leading "$") is compared as a number:
  whole-number floats count as integers ("42.0" == "42"), two integers must be equal, other
  numbers match within a relative tolerance of 1e-6 ("19.99" == "19.990"); so write
  numbers without thousands separators;
- the item lists must have the same length and match pairwise, in order when the task is
  `ordered` (top-k rankings, user SQL with ORDER BY), else as multisets.

User task file, one JSON object per line (blank lines are skipped):
    {"id": "q1", "question": "How many ...?", "sql": "SELECT ..."}        answer = what the SQL returns
    {"id": "q2", "question": "...", "answer": "42"}                        no oracle tool call
    {"id": "q3", "question": "...", "sql": ["SELECT ...", "SELECT ..."]}   answer = the last query's result
Optional keys: "ordered" (compare a multi-value answer in order; default: the last SQL has
ORDER BY, else false), "split" ("train" or "eval"; of the tasks without it, 20% are held
out for eval by a hash of their ids: `agentopd.splits.split_user_tasks`), anything else is
kept in `task.data`. When both "sql" and "answer" are given they must agree.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from agentopd.env import Task, seeded_rng, unique_tasks
from agentopd.tool import ToolError
from envs.sql_db.database import ORDER_YEARS, STATUSES
from tools.sql import QueryResult, SqlDatabase

TASK_SEED = 7
HOLDOUT_FRACTION = 0.1
REL_TOL = 1e-6
COMBO_HOLDOUT_FRACTION = 0.15
HELD_OUT_CITIES = 2
ORDERS_PER_TEMPLATE = 400
ENTITY_PARAMS = ("customer", "product", "order", "employee", "city")


class Difficulty(StrEnum):
    COUNT = "count"  # one table, a filter or a lookup
    JOIN = "join"
    AGGREGATE = "aggregate"  # SUM / AVG over a join or a group
    TOPK = "topk"  # ranked lists, compared in order
    TWO_STEP = "two_step"  # two queries: the second uses a value read from the first's output
    EXPLORE = "explore"  # the schema must be looked up first (list_tables / describe_table), 2-4 calls


CLASSIC = tuple(d.value for d in Difficulty if d != Difficulty.EXPLORE)  # what difficulty=None selects


Params = dict[str, Any]


@dataclass(frozen=True)
class Template:
    name: str
    difficulty: Difficulty
    question: str
    sql: str
    params: Callable[[Catalog], list[Params]]
    next_sql: str | None = None  # two-step: the second query, with {value} from the first's output
    tie_sql: str | None = None  # top-k: the ranking metric for k + 1 rows ({k1}); ties are skipped
    find_table: bool = False  # explore: the oracle calls list_tables first
    describe: tuple[str, ...] = ()  # explore: the tables the oracle describes before querying


@dataclass
class Catalog:
    """The entity lists templates draw their parameters from."""

    customers: list[str]
    products: list[str]
    employees: list[str]
    non_managers: list[str]
    stores: list[str]
    cities: list[str]
    categories: list[str]
    orders: list[int]
    rng: Any

    def sample_orders(self) -> list[int]:
        return sorted(int(i) for i in self.rng.choice(self.orders, ORDERS_PER_TEMPLATE, replace=False))


_ITEMS = "FROM order_items oi JOIN orders o ON o.id = oi.order_id"
_T = Template
_D = Difficulty
TEMPLATES: tuple[Template, ...] = (
    _T("count_city", _D.COUNT, "How many customers live in {city}?",
       "SELECT COUNT(*) FROM customers WHERE city = '{city}'", lambda c: [{"city": x} for x in c.cities]),
    _T("count_category", _D.COUNT, "How many products are in the {category} category?",
       "SELECT COUNT(*) FROM products WHERE category = '{category}'", lambda c: [{"category": x} for x in c.categories]),
    _T("count_status_year", _D.COUNT, "How many {status} orders were placed in {year}?",
       "SELECT COUNT(*) FROM orders WHERE status = '{status}' AND order_date LIKE '{year}%'",
       lambda c: [{"status": s, "year": y} for s in STATUSES for y in ORDER_YEARS]),
    _T("count_city_signup", _D.COUNT, "How many customers in {city} signed up in {year}?",
       "SELECT COUNT(*) FROM customers WHERE city = '{city}' AND signup_year = {year}",
       lambda c: [{"city": x, "year": y} for x in c.cities for y in range(2018, 2025)]),
    _T("price_of", _D.COUNT, "What is the price of the {product}?",
       "SELECT price FROM products WHERE name = '{product}'", lambda c: [{"product": x} for x in c.products]),
    _T("city_of", _D.COUNT, "Which city does {customer} live in?",
       "SELECT city FROM customers WHERE name = '{customer}'", lambda c: [{"customer": x} for x in c.customers]),
    _T("date_of", _D.COUNT, "On what date was order {order} placed?",
       "SELECT order_date FROM orders WHERE id = {order}", lambda c: [{"order": x} for x in c.sample_orders()]),
    _T("role_of", _D.COUNT, "What is the job of {employee}?",
       "SELECT role FROM employees WHERE name = '{employee}'", lambda c: [{"employee": x} for x in c.employees]),
    _T("order_customer", _D.JOIN, "Who placed order {order}?",
       "SELECT c.name FROM orders o JOIN customers c ON c.id = o.customer_id WHERE o.id = {order}",
       lambda c: [{"order": x} for x in c.sample_orders()]),
    _T("order_store", _D.JOIN, "Which store handled order {order}?",
       "SELECT s.name FROM orders o JOIN stores s ON s.id = o.store_id WHERE o.id = {order}",
       lambda c: [{"order": x} for x in c.sample_orders()]),
    _T("customer_orders", _D.JOIN, "How many orders did {customer} place?",
       "SELECT COUNT(*) FROM orders o JOIN customers c ON c.id = o.customer_id WHERE c.name = '{customer}'",
       lambda c: [{"customer": x} for x in c.customers]),
    _T("employee_store", _D.JOIN, "At which store does {employee} work?",
       "SELECT s.name FROM employees e JOIN stores s ON s.id = e.store_id WHERE e.name = '{employee}'",
       lambda c: [{"employee": x} for x in c.employees]),
    _T("store_orders_year", _D.JOIN, "How many orders did the {store} store handle in {year}?",
       "SELECT COUNT(*) FROM orders o JOIN stores s ON s.id = o.store_id WHERE s.name = '{store}' AND o.order_date LIKE '{year}%'",
       lambda c: [{"store": s, "year": y} for s in c.stores for y in ORDER_YEARS]),
    _T("order_total", _D.AGGREGATE, "What is the total of order {order}?",
       "SELECT ROUND(SUM(quantity * unit_price), 2) FROM order_items WHERE order_id = {order}",
       lambda c: [{"order": x} for x in c.sample_orders()]),
    _T("customer_spent", _D.AGGREGATE, "How much did {customer} spend in total?",
       f"SELECT ROUND(SUM(oi.quantity * oi.unit_price), 2) {_ITEMS} JOIN customers c ON c.id = o.customer_id WHERE c.name = '{{customer}}'",
       lambda c: [{"customer": x} for x in c.customers]),
    _T("units_year", _D.AGGREGATE, "How many units of the {product} were sold in {year}?",
       f"SELECT SUM(oi.quantity) {_ITEMS} JOIN products p ON p.id = oi.product_id WHERE p.name = '{{product}}' AND o.order_date LIKE '{{year}}%'",
       lambda c: [{"product": x, "year": y} for x in c.products for y in ORDER_YEARS]),
    _T("store_revenue", _D.AGGREGATE, "What was the revenue of the {store} store in {year}?",
       f"SELECT ROUND(SUM(oi.quantity * oi.unit_price), 2) {_ITEMS} JOIN stores s ON s.id = o.store_id WHERE s.name = '{{store}}' AND o.order_date LIKE '{{year}}%'",
       lambda c: [{"store": s, "year": y} for s in c.stores for y in ORDER_YEARS]),
    _T("avg_price", _D.AGGREGATE, "What is the average price of {category} products?",
       "SELECT ROUND(AVG(price), 2) FROM products WHERE category = '{category}'",
       lambda c: [{"category": x} for x in c.categories]),
    _T("avg_salary", _D.AGGREGATE, "What is the average salary at the {store} store?",
       "SELECT ROUND(AVG(e.salary), 2) FROM employees e JOIN stores s ON s.id = e.store_id WHERE s.name = '{store}'",
       lambda c: [{"store": x} for x in c.stores]),
    _T("top_products_year", _D.TOPK, "Which {k} products sold the most units in {year}?",
       f"SELECT p.name {_ITEMS} JOIN products p ON p.id = oi.product_id WHERE o.order_date LIKE '{{year}}%' GROUP BY p.id ORDER BY SUM(oi.quantity) DESC LIMIT {{k}}",
       lambda c: [{"k": k, "year": y} for k in range(1, 6) for y in ORDER_YEARS],
       tie_sql=f"SELECT SUM(oi.quantity) {_ITEMS} WHERE o.order_date LIKE '{{year}}%' GROUP BY oi.product_id ORDER BY 1 DESC LIMIT {{k1}}"),
    _T("top_category_products", _D.TOPK, "Which {k} {category} products sold the most units?",
       "SELECT p.name FROM order_items oi JOIN products p ON p.id = oi.product_id WHERE p.category = '{category}' GROUP BY p.id ORDER BY SUM(oi.quantity) DESC LIMIT {k}",
       lambda c: [{"k": k, "category": x} for k in range(1, 5) for x in c.categories],
       tie_sql="SELECT SUM(oi.quantity) FROM order_items oi JOIN products p ON p.id = oi.product_id WHERE p.category = '{category}' GROUP BY p.id ORDER BY 1 DESC LIMIT {k1}"),
    _T("priciest", _D.TOPK, "What are the {k} most expensive {category} products?",
       "SELECT name FROM products WHERE category = '{category}' ORDER BY price DESC LIMIT {k}",
       lambda c: [{"k": k, "category": x} for k in range(1, 5) for x in c.categories],
       tie_sql="SELECT price FROM products WHERE category = '{category}' ORDER BY price DESC LIMIT {k1}"),
    _T("top_customers_city", _D.TOPK, "Which {k} customers in {city} spent the most?",
       f"SELECT c.name {_ITEMS} JOIN customers c ON c.id = o.customer_id WHERE c.city = '{{city}}' GROUP BY c.id ORDER BY SUM(oi.quantity * oi.unit_price) DESC LIMIT {{k}}",
       lambda c: [{"k": k, "city": x} for k in range(1, 4) for x in c.cities],
       tie_sql=f"SELECT SUM(oi.quantity * oi.unit_price) {_ITEMS} JOIN customers c ON c.id = o.customer_id WHERE c.city = '{{city}}' GROUP BY c.id ORDER BY 1 DESC LIMIT {{k1}}"),
    _T("top_employee", _D.TOPK, "Which employee at the {store} store handled the most orders in {year}?",
       "SELECT e.name FROM orders o JOIN employees e ON e.id = o.employee_id JOIN stores s ON s.id = o.store_id WHERE s.name = '{store}' AND o.order_date LIKE '{year}%' GROUP BY e.id ORDER BY COUNT(*) DESC LIMIT 1",
       lambda c: [{"store": s, "year": y, "k": 1} for s in c.stores for y in ORDER_YEARS],
       tie_sql="SELECT COUNT(*) FROM orders o JOIN stores s ON s.id = o.store_id WHERE s.name = '{store}' AND o.order_date LIKE '{year}%' GROUP BY o.employee_id ORDER BY 1 DESC LIMIT {k1}"),
    _T("customer_favorites", _D.TOPK, "Which {k} products did {customer} buy the most units of?",
       f"SELECT p.name {_ITEMS} JOIN products p ON p.id = oi.product_id JOIN customers c ON c.id = o.customer_id WHERE c.name = '{{customer}}' GROUP BY p.id ORDER BY SUM(oi.quantity) DESC LIMIT {{k}}",
       lambda c: [{"k": 1 + i % 2, "customer": x} for i, x in enumerate(c.customers)],
       tie_sql=f"SELECT SUM(oi.quantity) {_ITEMS} JOIN customers c ON c.id = o.customer_id WHERE c.name = '{{customer}}' GROUP BY oi.product_id ORDER BY 1 DESC LIMIT {{k1}}"),
    _T("customer_priciest", _D.TOPK, "What are the {k} most expensive products {customer} bought?",
       f"SELECT p.name {_ITEMS} JOIN products p ON p.id = oi.product_id JOIN customers c ON c.id = o.customer_id WHERE c.name = '{{customer}}' GROUP BY p.id ORDER BY p.price DESC LIMIT {{k}}",
       lambda c: [{"k": 2 - i % 2, "customer": x} for i, x in enumerate(c.customers)],
       tie_sql=f"SELECT p.price {_ITEMS} JOIN products p ON p.id = oi.product_id JOIN customers c ON c.id = o.customer_id WHERE c.name = '{{customer}}' GROUP BY p.id ORDER BY 1 DESC LIMIT {{k1}}"),
    _T("same_city", _D.TWO_STEP, "How many customers live in the same city as {customer}?",
       "SELECT city FROM customers WHERE name = '{customer}'", lambda c: [{"customer": x} for x in c.customers],
       next_sql="SELECT COUNT(*) FROM customers WHERE city = '{value}'"),
    _T("pricier", _D.TWO_STEP, "How many products cost more than the {product}?",
       "SELECT price FROM products WHERE name = '{product}'", lambda c: [{"product": x} for x in c.products],
       next_sql="SELECT COUNT(*) FROM products WHERE price > {value}"),
    _T("same_day", _D.TWO_STEP, "How many orders were placed on the same day as order {order}?",
       "SELECT order_date FROM orders WHERE id = {order}", lambda c: [{"order": x} for x in c.sample_orders()],
       next_sql="SELECT COUNT(*) FROM orders WHERE order_date = '{value}'"),
    _T("manager_of", _D.TWO_STEP, "Who manages the store where {employee} works?",
       "SELECT store_id FROM employees WHERE name = '{employee}'", lambda c: [{"employee": x} for x in c.non_managers],
       next_sql="SELECT name FROM employees WHERE store_id = {value} AND role = 'Manager'"),
    _T("last_order_total", _D.TWO_STEP, "What was the total of the last order by {customer}?",
       "SELECT o.id FROM orders o JOIN customers c ON c.id = o.customer_id WHERE c.name = '{customer}' ORDER BY o.order_date DESC LIMIT 1",
       lambda c: [{"customer": x, "k": 1} for x in c.customers],
       next_sql="SELECT ROUND(SUM(quantity * unit_price), 2) FROM order_items WHERE order_id = {value}",
       tie_sql="SELECT julianday(o.order_date) FROM orders o JOIN customers c ON c.id = o.customer_id WHERE c.name = '{customer}' ORDER BY 1 DESC LIMIT {k1}"),
)  # fmt: skip

# The explore family: questions worded without the column names, for an agent that does not see the schema.
# The oracle looks up what it needs (list_tables when the question names no table, describe_table for each
# table its SQL reads), then runs the gold SQL: 2-4 tool calls. Built after TEMPLATES, so adding these did not
# change any earlier task (they draw from the same generator afterwards).
_X = Difficulty.EXPLORE
_ROLES = ("Manager", "Sales Associate", "Cashier", "Stock Clerk")
EXPLORE_TEMPLATES: tuple[Template, ...] = (
    _T("x_joined", _X, "How many customers from {city} joined in {year}?",
       "SELECT COUNT(*) FROM customers WHERE city = '{city}' AND signup_year = {year}",
       lambda c: [{"city": x, "year": y} for x in c.cities for y in range(2018, 2025)], describe=("customers",)),
    _T("x_email", _X, "What is the email address of {customer}?",
       "SELECT email FROM customers WHERE name = '{customer}'", lambda c: [{"customer": x} for x in c.customers],
       describe=("customers",)),
    _T("x_opened", _X, "In what year did the {store} store open?",
       "SELECT opened_year FROM stores WHERE name = '{store}'", lambda c: [{"store": x} for x in c.stores],
       describe=("stores",)),
    _T("x_earns", _X, "How much does {employee} earn?",
       "SELECT salary FROM employees WHERE name = '{employee}'", lambda c: [{"employee": x} for x in c.employees],
       describe=("employees",)),
    _T("x_hired", _X, "In what year was {employee} hired?",
       "SELECT hire_year FROM employees WHERE name = '{employee}'", lambda c: [{"employee": x} for x in c.employees],
       describe=("employees",)),
    _T("x_kind", _X, "What kind of product is the {product}?",
       "SELECT category FROM products WHERE name = '{product}'", lambda c: [{"product": x} for x in c.products],
       describe=("products",)),
    _T("x_status", _X, "What is the status of order {order}?",
       "SELECT status FROM orders WHERE id = {order}", lambda c: [{"order": x} for x in c.sample_orders()],
       describe=("orders",)),
    _T("x_units", _X, "How many units were bought in order {order}?",
       "SELECT SUM(quantity) FROM order_items WHERE order_id = {order}", lambda c: [{"order": x} for x in c.sample_orders()],
       find_table=True, describe=("order_items",)),
    _T("x_lines", _X, "How many different products are in order {order}?",
       "SELECT COUNT(DISTINCT product_id) FROM order_items WHERE order_id = {order}",
       lambda c: [{"order": x} for x in c.sample_orders()], find_table=True, describe=("order_items",)),
    _T("x_staff", _X, "How many people with the job {role} work at the {store} store?",
       "SELECT COUNT(*) FROM employees e JOIN stores s ON s.id = e.store_id WHERE s.name = '{store}' AND e.role = '{role}'",
       lambda c: [{"role": r, "store": s} for r in _ROLES for s in c.stores], describe=("employees", "stores")),
    _T("x_first_order", _X, "On what date did {customer} place their first order?",
       "SELECT MIN(o.order_date) FROM orders o JOIN customers c ON c.id = o.customer_id WHERE c.name = '{customer}'",
       lambda c: [{"customer": x} for x in c.customers], describe=("customers", "orders")),
    _T("x_same_year", _X, "How many customers joined in the same year as {customer}?",
       "SELECT signup_year FROM customers WHERE name = '{customer}'", lambda c: [{"customer": x} for x in c.customers],
       next_sql="SELECT COUNT(*) FROM customers WHERE signup_year = {value}", describe=("customers",)),
    _T("x_coworkers", _X, "How many employees work at the same store as {employee}?",
       "SELECT store_id FROM employees WHERE name = '{employee}'", lambda c: [{"employee": x} for x in c.employees],
       next_sql="SELECT COUNT(*) FROM employees WHERE store_id = {value}", describe=("employees",)),
    _T("x_buyer_email", _X, "What is the email address of the customer who placed order {order}?",
       "SELECT customer_id FROM orders WHERE id = {order}", lambda c: [{"order": x} for x in c.sample_orders()],
       next_sql="SELECT email FROM customers WHERE id = {value}", describe=("orders", "customers")),
    _T("x_seller_pay", _X, "How much does the employee who handled order {order} earn?",
       "SELECT employee_id FROM orders WHERE id = {order}", lambda c: [{"order": x} for x in c.sample_orders()],
       next_sql="SELECT salary FROM employees WHERE id = {value}", describe=("orders", "employees")),
)  # fmt: skip


def first_cell(table_text: str) -> str:
    """The first cell of the first row of a tool output table (how the oracle reads a value)."""
    lines = table_text.split("\n")
    assert len(lines) >= 2 and not lines[1].startswith("(no rows)"), table_text
    return lines[1].split(" | ")[0]


def answer_text(result: QueryResult) -> str:
    """A query result as the expected final answer: every cell, row by row, joined by ', '."""
    return ", ".join(result.values())


def _catalog(db: SqlDatabase, rng: Any) -> Catalog:
    def column(sql: str) -> list[Any]:
        result = db.query(sql, max_rows=100_000)
        assert not result.more, sql
        return [r[0] for r in result.rows]

    return Catalog(
        customers=column("SELECT name FROM customers ORDER BY id"),
        products=column("SELECT name FROM products ORDER BY id"),
        employees=column("SELECT name FROM employees ORDER BY id"),
        non_managers=column("SELECT name FROM employees WHERE role != 'Manager' ORDER BY id"),
        stores=column("SELECT name FROM stores ORDER BY id"),
        cities=column("SELECT DISTINCT city FROM customers ORDER BY city"),
        categories=column("SELECT DISTINCT category FROM products ORDER BY category"),
        orders=column("SELECT id FROM orders ORDER BY id"),
        rng=rng,
    )


def _held_out(catalog: Catalog, rng: Any) -> set[tuple[str, Any]]:
    held: set[tuple[str, Any]] = set()
    for kind, pool in (
        ("customer", catalog.customers),
        ("product", catalog.products),
        ("order", catalog.orders),
        ("employee", catalog.employees),
    ):
        n = max(1, round(HOLDOUT_FRACTION * len(pool)))
        held |= {(kind, pool[i]) for i in rng.choice(len(pool), n, replace=False)}
    held |= {("city", catalog.cities[i]) for i in rng.choice(len(catalog.cities), HELD_OUT_CITIES, replace=False)}
    return held


def generate_tasks(db: SqlDatabase, explore: bool = True) -> list[Task]:
    """Every generated task over the built-in database (deterministic), train and eval; `explore=False`
    stops before the explore family (the classic tasks are the same either way: they come first)."""
    rng = seeded_rng(TASK_SEED)
    catalog = _catalog(db, rng)
    held = _held_out(catalog, rng)
    tasks = []
    for template in (*TEMPLATES, *(EXPLORE_TEMPLATES if explore else ())):
        for params in template.params(catalog):
            entities = [(k, v) for k, v in params.items() if k in ENTITY_PARAMS]
            if entities:
                is_eval = any(e in held for e in entities)
            else:
                is_eval = bool(rng.random() < COMBO_HOLDOUT_FRACTION)
            task = _make_task(db, template, params, "eval" if is_eval else "train")
            if task is not None:
                tasks.append(task)
    return tasks


def _make_task(db: SqlDatabase, template: Template, params: Params, split: str) -> Task | None:
    sql = template.sql.format(**params)
    if template.tie_sql is not None:
        k = params["k"]
        metric = [r[0] for r in db.query(template.tie_sql.format(**params, k1=k + 1)).rows]
        if len(metric) < k or any(a is None or b is None or a <= b for a, b in zip(metric, metric[1:], strict=False)):
            return None  # a tie (or too few rows) would make the ranking ambiguous
    gold: str | list[str] = sql
    if template.next_sql is not None:
        second = template.next_sql.replace("{value}", first_cell(db.sql_query(sql)))
        gold = [sql, second]
        sql = second
    result = db.query(sql)
    if not result.rows or any(v is None for row in result.rows for v in row) or result.more:
        return None
    task_id = template.name + ":" + "|".join(str(v) for k, v in params.items() if f"{{{k}}}" in template.question)
    data = {"sql": gold, "difficulty": str(template.difficulty), "template": template.name, "split": split,
            "ordered": template.tie_sql is not None and template.next_sql is None, "data_source": "sql_db"}  # fmt: skip
    if template.next_sql is not None:
        data["next_sql"] = template.next_sql
    if template.find_table or template.describe:
        data["lookups"] = [["list_tables", {}]] * template.find_table + [["describe_table", {"name": t}] for t in template.describe]
    return Task(id=task_id, question=template.question.format(**params), answer=answer_text(result), data=data)


# --- grading -----------------------------------------------------------------------------
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?")
_QUOTES = "\"'`"


def _item(text: str) -> str | int | float:
    text = " ".join(text.split()).casefold().strip(_QUOTES).rstrip(".").strip()
    number = text.removeprefix("$")
    if _NUMBER.fullmatch(number):
        value = float(number)
        return int(value) if value.is_integer() else value
    return text


def _items(text: str) -> list[str | int | float]:
    return [_item(part) for part in re.split(r"[,\n]", text) if part.strip(" \t" + _QUOTES)]


def _same(a: str | int | float, b: str | int | float) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-9)


def _sort_key(x: str | int | float) -> tuple[int, Any]:
    return (1, x) if isinstance(x, str) else (0, x)


def answers_match(expected: str, given: str, *, ordered: bool = True) -> bool:
    """Does `given` match `expected` under the sql_db rule (see the module docstring)?"""
    want, got = _items(str(expected)), _items(str(given))
    if len(want) != len(got):
        return False
    if not ordered:
        want, got = sorted(want, key=_sort_key), sorted(got, key=_sort_key)
    return all(_same(a, b) for a, b in zip(want, got, strict=True))


# --- user task files ---------------------------------------------------------------------
_ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)
_TASK_KEYS = ("id", "question", "sql", "answer", "ordered", "split")


def load_tasks_jsonl(path: str | Path, db: SqlDatabase, db_label: str | None = None) -> list[Task]:
    """Read a user task file; expected answers of sql-only tasks come from running the SQL on `db` (`db_label`: what an
    error about a task's SQL calls that database, e.g. the built-in one; None: nothing added)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"tasks: no file at {str(path)!r}")
    return unique_tasks(_read_lines(path, db, f" on {db_label}" if db_label else ""), path)


def _read_lines(path: Path, db: SqlDatabase, on: str) -> Iterator[tuple[str, Task]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", _parse_line(line, lineno, db, on)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None


def _parse_line(line: str, lineno: int, db: SqlDatabase, on: str = "") -> Task:
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise ValueError(f"invalid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    question = obj.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("missing 'question' (a non-empty string)")
    task_id = obj.get("id", f"line-{lineno}")
    if not isinstance(task_id, str | int) or isinstance(task_id, bool):
        raise ValueError(f"'id' must be a string or an integer, got {task_id!r:.80}")
    sql, answer = obj.get("sql"), obj.get("answer")
    if sql is None and answer is None:
        raise ValueError("the task needs 'sql' or 'answer' (or both)")
    if answer is not None and (not isinstance(answer, str | int | float) or isinstance(answer, bool)):
        raise ValueError(f"'answer' must be a string or a number, got {answer!r:.80}")
    if sql is not None:
        queries = [sql] if isinstance(sql, str) else sql
        if not isinstance(queries, list) or not queries or not all(isinstance(q, str) and q.strip() for q in queries):
            raise ValueError("'sql' must be a non-empty string or a list of them")
    split = obj.get("split")
    if split not in (None, "train", "eval"):
        raise ValueError(f"'split' must be 'train' or 'eval', got {split!r:.80}")
    ordered = obj.get("ordered", bool(sql is not None and _ORDER_BY.search(queries[-1])))
    if not isinstance(ordered, bool):
        raise ValueError(f"'ordered' must be true or false, got {ordered!r:.80}")
    expected = None
    if sql is not None:
        for i, q in enumerate(queries):
            try:
                result = db.query(q)
            except ToolError as e:
                raise ValueError(f"sql[{i}] failed{on}: {e}") from None
        if not result.rows:
            raise ValueError(f"the sql returns no rows{on}; give the expected 'answer' too")
        if result.more:
            raise ValueError(f"the sql returns more than {db.max_rows} rows{on} (max_rows)")
        expected = answer_text(result)
    if answer is not None:
        answer = str(answer).strip() if isinstance(answer, str) else answer_text(QueryResult(["answer"], [(answer,)]))
        if expected is not None and not answers_match(answer, expected, ordered=ordered):
            raise ValueError(f"'answer' {answer!r:.80} disagrees with what the sql returns{on}: {expected!r:.80}")
        expected = answer
    data = {k: v for k, v in obj.items() if k not in _TASK_KEYS}
    data.update({"ordered": ordered, "split": split, "data_source": data.get("data_source", "sql_db")})
    if sql is not None:
        data["sql"] = sql
    return Task(id=str(task_id), question=question.strip(), answer=expected, data=data)
