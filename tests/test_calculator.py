"""The calculate tool and the calculator env: exactness, refusals, fuzzing, oracles, user task files."""

import json
import random
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentopd.checker import check_env
from agentopd.registry import make_env
from agentopd.tool import ToolError, invoke, tool_schema
from envs.calculator import CalculatorEnv
from envs.calculator.data import answers_match, parse_answer
from tools.calculator import calculate, format_number

# --- the tool --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("2 ** 3 ** 2", "512"),  # right-associative
        ("-2 ** 2", "-4"),  # ** binds tighter than unary minus
        ("(-2) ** 2", "4"),
        ("--3", "3"),
        ("+-+3", "-3"),
        ("10 - 4 - 3", "3"),  # left-associative
        ("0.1 + 0.2", "0.3"),  # exact, not 0.30000000000000004
        ("1/3 * 3", "1"),
        ("1/8", "0.125"),
        ("2/3", "0.666666666667"),
        ("-2/3", "-0.666666666667"),
        ("3 * 2.50 + 2 * 1.25", "10"),
        ("80 * (1 - 15/100)", "68"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("-7 % 3", "2"),
        ("7.5 % 2", "1.5"),
        ("2 ** -2", "0.25"),
        ("16 ** 0.5", "4"),
        ("27 ** (1/3)", "3"),
        ("(8/27) ** (2/3)", "0.444444444444"),
        ("sqrt(2)", "1.41421356237"),
        ("sqrt(2) * sqrt(2)", "2"),
        ("sqrt(1e-90)", "1e-45"),
        ("abs(-3/4)", "0.75"),
        ("round(2.675, 2)", "2.68"),  # exact decimal, half away from zero
        ("round(-2.5)", "-3"),
        ("round(1234, -2)", "1200"),
        ("floor(-2.5) + ceil(2.1)", "0"),
        ("min(3, 1/2, 7)", "0.5"),
        ("max(-1, -2)", "-1"),
        ("1_000.5 * 2", "2001"),
        ("1e3 + .5 + 5.", "1005.5"),
        ("2 ** 332", str(2**332)),  # big but allowed
        ("10 ** 99 * 9", str(9 * 10**99)),
        ("12345678901234567890.5", "12345678901234567890.5"),
        ("10 ** 20 / 3", "3.33333333333e19"),
        ("1e-9 / 3", "3.33333333333e-10"),
        ("0.1 ** 50", "1e-50"),
        ("(-1) ** (10 ** 50)", "1"),
        ("0 ** 0", "1"),
        ("  ( 1\n + 2 )  ", "3"),
        ("(" * 150 + "1" + ")" * 150, "1"),  # parentheses alone add no depth
    ],
)
def test_calculate_exact(expression, expected):
    assert calculate(expression) == expected


@pytest.mark.parametrize(
    "expression, message",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("1 / 0", "division by zero"),
        ("5 // (2 - 2)", "division by zero"),
        ("5 % 0", "modulo by zero"),
        ("0 ** -1", "division by zero"),
        ("9**9**9", "too large"),
        ("10**-10**10", "too small"),
        ("2**(2**30)", "too large"),
        ("(1/2) ** -400", "too large"),
        ("2 ** 333", "too large"),
        ("1e999", "too large"),
        ("1e-999", "too small"),
        ("9" * 101, "too large"),
        ("1" + "+1" * 300, "characters"),
        ("-(" * 110 + "1" + ")" * 110, "nested too deeply"),
        ("(" * 201 + "1" + ")" * 201, "too many nested parentheses"),
        ("-" * 300 + "1", "nested too deeply"),
        ("(" * 300 + "1" + ")" * 300, "characters"),
        ("(((1)", "cannot parse"),
        ("2 ^ 3", "**"),
        ("__import__('os').system('ls')", "attribute access"),
        ("__import__('os')", "unknown function '__import__'"),
        ("(1).real", "attribute access"),
        ("lambda: 1", "Lambda"),
        ("x + 1", "unknown name 'x'"),
        ("pi", "unknown name"),
        ("[1, 2]", "List"),
        ("1, 000", "commas"),
        ("1 < 2", "comparisons"),
        ("1 and 2", "and/or"),
        ("~1", "~"),
        ("1 << 2", "<<"),
        ("1j", "complex"),
        ("True + 1", "only numbers"),
        ("'a' * 3", "only numbers"),
        ("3 × 4", "unsupported character '×'"),
        ("\x00", "cannot parse"),
        ("(-8) ** (1/3)", "fractional powers of negative numbers"),
        ("sqrt(-1)", "not a real number"),
        ("sqrt(1, 2)", "exactly 1 argument"),
        ("round(1, 2, 3)", "1 to 2 arguments"),
        ("round(1.5, 0.5)", "whole n"),
        ("min()", "arguments"),
        ("abs(x=1)", "positional"),
        ("max(*[1])", "positional"),
    ],
)
def test_calculate_refuses(expression, message):
    t0 = time.perf_counter()
    with pytest.raises(ToolError, match=None) as e:
        calculate(expression)
    assert time.perf_counter() - t0 < 0.5, expression  # refusals are instant
    assert message in str(e.value), (expression, str(e.value))


def test_calculate_refuses_non_strings():
    for value in (None, 3, [1], {"a": 1}):
        with pytest.raises(ToolError, match="must be a string"):
            calculate(value)


_ops = st.sampled_from(["+", "-", "*", "/"])
_leaves = st.integers(-50, 50).map(lambda n: (f"({n})", Fraction(n)))


def _combine(children):
    def build(t):
        (a, va), op, (b, vb) = t
        if op == "/" and vb == 0:
            return (f"({a} {op} {b})", None)
        if va is None or vb is None:
            return (f"({a} {op} {b})", None)
        value = {"+": va + vb, "-": va - vb, "*": va * vb, "/": va / vb if vb else None}[op]
        return (f"({a} {op} {b})", value)

    return st.tuples(children, _ops, children).map(build)


@settings(max_examples=300, deadline=None)
@given(st.recursive(_leaves, _combine, max_leaves=12))
def test_calculate_matches_fraction_arithmetic(case):
    expression, value = case
    if value is None:  # a division by zero somewhere
        with pytest.raises(ToolError, match="division by zero"):
            calculate(expression)
    else:
        assert calculate(expression) == format_number(value.numerator if value.denominator == 1 else value)


@settings(max_examples=1500, deadline=None)
@given(st.text(alphabet="0123456789+-*/%().e ,^_abcjx\n\\'\"[]{}<>=!~@&|:;ü", max_size=80))
def test_calculate_only_ever_raises_tool_error(expression):
    t0 = time.perf_counter()
    try:
        result = calculate(expression)
    except ToolError as e:
        assert str(e)
    else:
        assert isinstance(result, str) and result
    assert time.perf_counter() - t0 < 1.0, expression


def test_schema_from_docstring():
    fn = tool_schema(calculate)["function"]
    assert fn["name"] == "calculate"
    assert fn["description"].startswith("Evaluate an arithmetic expression exactly")
    assert fn["parameters"]["properties"]["expression"]["type"] == "string"
    assert fn["parameters"]["required"] == ["expression"]
    assert invoke(calculate, {"expression": "6 * 7"}).content == "42"
    assert invoke(calculate, {"expression": 42}).content.startswith("Error:")


# --- answers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [
        ("63", 63),
        ("  63. ", 63),
        ("$1,234.50", Fraction(246900, 200)),
        ("**-12**", -12),
        ("3/4", Fraction(3, 4)),
        ("15%", 15),
        ("1e3", 1000),
        ("The total is $63.", 63),
        ("It costs 1,250.75 dollars in all", Fraction(125075, 100)),
        ("no number here", None),
        ("", None),
        (12.5, Fraction(25, 2)),
        (None, None),
    ],
)
def test_parse_answer(text, value):
    assert parse_answer(text) == (None if value is None else Fraction(value))


def test_answers_match_tolerance():
    assert answers_match(parse_answer("0.666666666667"), Fraction(2, 3))
    assert answers_match(parse_answer("1000000.0000001"), Fraction(1000000))
    assert not answers_match(parse_answer("62.99"), Fraction(63))
    assert not answers_match(None, Fraction(63))


# --- the env ---------------------------------------------------------------------------------


def _play(env, actions):
    reward, info = 0.0, {}
    for action in actions:
        _, reward, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            break
    return reward, terminated, info


def test_generated_tasks_are_deterministic_and_held_out():
    a, b = CalculatorEnv(seed=3, num_tasks=50), CalculatorEnv(seed=3, num_tasks=50)
    assert [(t.id, t.question, t.answer) for t in a.tasks] == [(t.id, t.question, t.answer) for t in b.tasks]
    assert [t.question for t in CalculatorEnv(seed=4, num_tasks=50).tasks] != [t.question for t in a.tasks]
    train = {t.question for seed in (0, 1) for t in CalculatorEnv(seed=seed).tasks}
    evals = CalculatorEnv(split="eval").tasks
    assert len(evals) == 200 and not train & {t.question for t in evals}
    both = {t.id: t.question for t in CalculatorEnv(split="all", num_tasks=300).tasks}
    assert any(i.startswith("calc-eval-") for i in both) and any(i.startswith("calc-train-") for i in both)
    for t in CalculatorEnv(num_tasks=300).tasks + CalculatorEnv(split="eval", num_tasks=40).tasks:
        assert both.get(t.id, t.question) == t.question  # same id, same question, whichever split
    templates = {t.data["template"] for t in CalculatorEnv().tasks}
    assert len(templates) == 11
    assert {len(t.data["steps"]) for t in CalculatorEnv().tasks} == {1, 2, 3}


def test_every_oracle_earns_one():
    for env, tasks in ((CalculatorEnv(split="eval"), None), (CalculatorEnv(), 300)):
        sample = env.tasks if tasks is None else random.Random(0).sample(env.tasks, tasks)
        for task in sample:
            env.reset(options={"task_id": task.id})
            actions = env.oracle(task)
            assert 2 <= len(actions) <= 4
            reward, terminated, info = _play(env, actions)
            assert (reward, terminated, info["success"]) == (1.0, True, True), task


def test_oracle_steps_feed_each_other():
    env = CalculatorEnv(split="eval")
    task = next(t for t in env.tasks if t.data["template"] == "unit_price")
    env.reset(options={"task_id": task.id})
    actions = env.oracle(task)
    results = []
    for action in actions[:-1]:
        obs, *_ = env.step(action)
        results.append(obs[0]["content"])
    assert actions[2]["tool_calls"][0]["arguments"]["expression"] == f"{results[0]} - {results[1]}"
    assert actions[-1]["content"] == results[-1]


def test_wrong_answer_and_turn_limit():
    env = CalculatorEnv(num_tasks=5, max_turns=2)
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step({"role": "assistant", "content": "-123456"})
    assert (reward, terminated, info["success"]) == (0.0, True, False)
    env.reset(seed=0)
    call = {"role": "assistant", "content": "", "tool_calls": [{"name": "calculate", "arguments": {"expression": "1+1"}}]}
    obs, _, _, truncated, _ = env.step(call)
    assert obs == [{"role": "tool", "name": "calculate", "content": "2"}] and not truncated
    _, reward, terminated, truncated, _ = env.step(call)
    assert (reward, terminated, truncated) == (0.0, False, True)


def test_bad_kwargs():
    with pytest.raises(ValueError, match="split"):
        CalculatorEnv(split="test")
    with pytest.raises(ValueError, match="num_tasks"):
        CalculatorEnv(num_tasks=0)


@pytest.mark.parametrize("kwargs", [{}, {"split": "eval"}])
def test_checker_passes(kwargs):
    report = check_env("calculator", **kwargs)
    assert report.ok, report.summary()


HOSTILE_EXPRESSIONS = [
    "9**9**9", "10**-10**10", "2**(2**30)", "(2**100)**(2**100)", "1" * 499, "9" * 600, "(" * 201 + "1" + ")" * 201,
    "-" * 499 + "1", "1+" * 249 + "1", "__import__('os').system('ls')", "().__class__.__bases__[0]", "lambda: 0",
    "open('/etc/passwd')", "x" * 10_000, "ünïcødé", "1 ✓ 2", "\x00", "", " ", "1/0", "0**-1", "5%0", "sqrt(-4)",
    "[i for i in range(10**9)]", "'a'*10**9", "f'{1}'", "1 if 1 else 2", "(1,2)", "{}", "1;2", "import os",
    "max(" + "1," * 200 + "1)", "round(1, 10**9)", "10**99*10", "1e308*10", "(1/3)**400", "round(2.5, -21)",
]


def _hostile_action(rng):
    kind = rng.randrange(6)
    if kind == 0:
        expression = rng.choice(HOSTILE_EXPRESSIONS)
        return {"role": "assistant", "content": "", "tool_calls": [{"name": "calculate", "arguments": {"expression": expression}}]}
    if kind == 1:  # arguments as a JSON string, valid or not
        args = rng.choice([json.dumps({"expression": rng.choice(HOSTILE_EXPRESSIONS)}), "{expression: 1}", "[]", "null"])
        return {"role": "assistant", "content": "", "tool_calls": [{"name": "calculate", "arguments": args}]}
    if kind == 2:  # wrong argument types and names
        args = rng.choice([{"expression": None}, {"expression": 12}, {"expression": ["1+1"]}, {"expr": "1"}, {}, None, 3])
        return {"role": "assistant", "content": None, "tool_calls": [{"name": "calculate", "arguments": args}]}
    if kind == 3:  # unknown or non-string tool names, calls that are not dicts
        call = rng.choice([{"name": "eval", "arguments": {}}, {"name": None}, {"name": ["calculate"]}, "calculate", None, 7])
        return {"role": "assistant", "content": "", "tool_calls": [call]}
    if kind == 4:  # tool_calls not a list
        return {"role": "assistant", "content": "", "tool_calls": rng.choice(["calculate", {"name": "calculate"}, 5, True])}
    return rng.choice([None, "just text", 42, ["x"], b"\xff"])  # not a message at all


def test_fuzz_hostile_actions():
    env = CalculatorEnv(max_turns=6)
    rng = random.Random(0)
    env.reset(seed=0)
    worst, errors = 0.0, 0
    for _ in range(1500):
        action = _hostile_action(rng)
        t0 = time.perf_counter()
        obs, reward, terminated, truncated, info = env.step(action)
        worst = max(worst, time.perf_counter() - t0)
        assert not terminated and reward == 0.0
        assert obs and all(m["role"] == "tool" and m["content"].startswith("Error:") for m in obs), (action, obs)
        assert info["tool_errors"] == len(obs)
        errors += len(obs)
        if truncated:
            env.reset(seed=rng.randrange(1000))
    assert errors >= 1500 and worst < 2.0, worst


# --- user task files -------------------------------------------------------------------------


def _write(tmp_path, lines, name="tasks.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_user_task_file(tmp_path):
    path = _write(tmp_path, [
        json.dumps({"id": "a", "question": "What is 15% of 80?", "answer": 12}),
        "",
        json.dumps({"question": "3 pens at $1.25 each?", "answer": "$3.75", "expression": "3 * 1.25", "level": 2}),
        json.dumps({"id": 7, "question": "Split $1,000 three ways.", "answer": "333.333333333"}),
    ])
    env = make_env("calculator", tasks=str(path), split="all")
    assert [t.id for t in env.tasks] == ["a", "line-3", "7"]
    assert env.tasks[1].data["level"] == 2
    for task in env.tasks:
        env.reset(options={"task_id": task.id})
        reward, terminated, _ = _play(env, env.oracle(task))
        assert reward == 1.0 and terminated
    assert len(env.oracle(env.tasks[1])) == 2  # the expression becomes a calculate call
    env.reset(options={"task_id": "a"})
    assert env.step({"role": "assistant", "content": "The answer is 12."})[1] == 1.0


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"question": "q", "answer": 1', "not valid JSON"),
        ('["q", 1]', "expected a JSON object"),
        ('{"answer": 1}', "'question' must be a non-empty string"),
        ('{"question": "q"}', "missing 'answer'"),
        ('{"question": "q", "answer": "twelve"}', "'answer' must be a number"),
        ('{"question": "q", "answer": [1]}', "'answer' must be a number"),
        ('{"question": "q", "answer": 1, "id": {"x": 1}}', "'id' must be"),
        ('{"question": "q", "answer": 5, "expression": "2+2"}', "gives 4"),
        ('{"question": "q", "answer": 5, "expression": "9**9**9"}', "refused by calculate"),
        ('{"id": "a", "question": "q", "answer": 1}', "duplicate id 'a'"),
    ],
)
def test_malformed_task_file_names_line(tmp_path, bad_line, message):
    path = _write(tmp_path, [json.dumps({"id": "a", "question": "q", "answer": 1}), "", bad_line])
    with pytest.raises(ValueError) as e:
        CalculatorEnv(tasks=path)
    assert f"{path}:3" in str(e.value) and message in str(e.value), str(e.value)


def test_missing_or_empty_task_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        CalculatorEnv(tasks=tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="no tasks"):
        CalculatorEnv(tasks=_write(tmp_path, ["", "  "]))


def test_generated_tasks_are_drawn_once_per_process(monkeypatch):
    """A rollout builds an env per episode: the generated set must not be drawn again each time
    (drawing 1,000 problems cost ~85 ms per env, most of a calculator rollout step)."""
    import envs.calculator as calc

    calls = []
    real = calc.generate
    monkeypatch.setattr(calc, "generate", lambda *a: calls.append(a) or real(*a))
    calc._generated_tasks.cache_clear()
    first = [CalculatorEnv(num_tasks=37, seed=5) for _ in range(3)]
    assert len(calls) == 1 and all(e.tasks == first[0].tasks for e in first)
    CalculatorEnv(num_tasks=37, seed=6)  # another set is its own draw
    assert len(calls) == 2
