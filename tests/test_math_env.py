r"""The math env: \boxed extraction and normalisation, generated tasks, oracles, fuzzing, task files."""

import importlib.util
import json
import random
import time

import pytest

from agentopd.checker import check_env
from agentopd.registry import make_env
from envs.math import MathEnv
from envs.math.answers import answers_match, extract, last_boxed, normalize

HAS_PYARROW = importlib.util.find_spec("pyarrow") is not None


@pytest.mark.parametrize(
    "text, boxed",
    [
        (r"so x = \boxed{5}.", "5"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"first \boxed{1}, finally \boxed{ \left( 2, \{3\} \right) }", r" \left( 2, \{3\} \right) "),
        (r"$\boxed 7$", "7"),
        (r"\fbox{8}", "8"),
        (r"\boxed{unclosed {", None),
        (r"\boxedx", None),
        ("no box at all", None),
        ("", None),
    ],
)
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    "given, expected, match",
    [
        (r"\frac{1}{2}", "1/2", True),
        (r"\dfrac{1}{2}", "0.5", True),
        (r"\tfrac12", r"\frac{1}{2}", True),
        (r"-\frac{3}{4}", "-0.75", True),
        (r"\frac{\sqrt{2}}{2}", r"\sqrt{2}/2", True),
        (r"$1{,}000$", "1000", True),
        ("1,000", "1000", True),
        (r"x = 5", "5", True),
        (r"90^\circ", "90", True),
        (r"50\%", "50", True),
        (r"\text{(B)}", "(B)", True),
        (r"\left( 1, 2 \right)", "(1,2)", True),
        (r"2^{10}", "1024", True),
        (r"3 \cdot 4", "12", True),
        ("0.3333333", r"\frac{1}{3}", True),
        ("0.33", r"\frac{1}{3}", False),
        ("3", "4", False),
        ("(1,3)", "(1,2)", False),
        ("", "", False),
        (None, "5", False),
        (r"10^{10^{10}}", "1", False),
        ("5" + " " * 2000, "5", False),  # over the length cap
    ],
)
def test_answers_match(given, expected, match):
    assert answers_match(given, expected) is match


def test_normalize():
    assert normalize(r" $\dfrac{23}{12}$. ") == "(23)/(12)"
    assert normalize(r"\text{ Evelyn }") == "Evelyn"


def test_regex_format():
    import re

    pattern = re.compile(r"Answer:\s*(\S+)")
    assert extract("Answer: 3\nwait... Answer: 4", pattern) == "4"
    assert extract("nothing", pattern) is None
    env = MathEnv(num_tasks=20, answer_format=r"Answer:\s*(\S+)")
    env.reset(seed=0)
    _, reward, *_ = env.step({"role": "assistant", "content": f"Answer: {env.task.answer}"})
    assert reward == 1.0
    env.reset(seed=0)
    _, reward, *_ = env.step({"role": "assistant", "content": f"\\boxed{{{env.task.answer}}}"})
    assert reward == 0.0  # only the configured format counts
    for bad in ("(unclosed", r"no groups", r"(a)(b)"):
        with pytest.raises(ValueError, match="answer_format"):
            MathEnv(num_tasks=5, answer_format=bad)


def test_generated_tasks_are_deterministic_and_held_out():
    a, b = MathEnv(seed=3, num_tasks=50), MathEnv(seed=3, num_tasks=50)
    assert [(t.id, t.question, t.answer) for t in a.tasks] == [(t.id, t.question, t.answer) for t in b.tasks]
    assert [t.question for t in MathEnv(seed=4, num_tasks=50).tasks] != [t.question for t in a.tasks]
    train = {t.question for seed in (0, 1) for t in MathEnv(seed=seed).tasks}
    evals = MathEnv(split="eval").tasks
    assert len(evals) == 200 and not train & {t.question for t in evals}
    assert len({t.data["template"] for t in MathEnv().tasks}) == 8
    with pytest.raises(ValueError, match="split"):
        MathEnv(split="validation")


def test_every_oracle_earns_one():
    for fmt in ("boxed", r"Answer:\s*(\S+)"):
        env = MathEnv(split="eval", answer_format=fmt)
        train = MathEnv(answer_format=fmt)
        for e, task in [(env, t) for t in env.tasks] + [(train, t) for t in random.Random(0).sample(train.tasks, 200)]:
            e.reset(options={"task_id": task.id})
            (action,) = e.oracle(task)
            obs, reward, terminated, truncated, info = e.step(action)
            assert (obs, reward, terminated, truncated, info["success"]) == ([], 1.0, True, False, True), task
    assert MathEnv(split="eval").oracle(env.tasks[0])[0]["content"].endswith("$.")


def test_single_turn_no_tools():
    env = make_env("math", num_tasks=10)
    messages, info = env.reset(seed=1)
    assert info["tools"] == [] and env.tools() == []
    assert [m["role"] for m in messages] == ["system", "user"] and "\\boxed" in messages[0]["content"]
    obs, reward, terminated, truncated, info = env.step(
        {"role": "assistant", "content": "", "tool_calls": [{"name": "calculate", "arguments": {"expression": "1+1"}}]}
    )
    assert obs[0]["content"].startswith("Error: unknown tool") and info["tool_errors"] == 1
    assert (reward, terminated, truncated) == (0.0, False, True)
    env.reset(seed=1)
    _, reward, terminated, _, _ = env.step({"role": "assistant", "content": r"I think \boxed{-99999}"})
    assert (reward, terminated) == (0.0, True)


@pytest.mark.parametrize("kwargs", [{}, {"answer_format": r"Answer:\s*(\S+)"}])
def test_checker_passes(kwargs):
    report = check_env("math", **kwargs)
    assert report.ok, report.summary()


def _hostile_action(rng):
    kind = rng.randrange(5)
    if kind == 0:  # hostile final answers: graded (reward 0), never raise
        return {"role": "assistant", "content": rng.choice(HOSTILE_CONTENT)}
    if kind == 1:
        return {"role": "assistant", "content": None}
    if kind == 2:  # any tool call is an error: there are no tools
        call = rng.choice([{"name": "calculate", "arguments": {"expression": "9**9**9"}}, {"name": None}, "x", None, 3,
                           {"name": "\\boxed{1}", "arguments": "not json"}])
        return {"role": "assistant", "content": rng.choice(HOSTILE_CONTENT), "tool_calls": [call]}
    if kind == 3:
        return {"role": "assistant", "content": "", "tool_calls": rng.choice(["calculate", {"name": "x"}, 1, True])}
    return rng.choice([None, "text", 1.5, [], b"bytes"])


HOSTILE_CONTENT = [
    "", " ", "\\boxed{" * 5000, "}" * 5000 + "\\boxed{1}", "\\boxed{" + "{" * 10_000 + "}" * 10_000 + "}",
    "\\boxed{" + "\\frac{1}{2}" * 2000 + "}", "\\boxed{10^{10^{10^{10}}}}", "\\boxed{9**9**9}", "\\boxed{2^(2^30)}",
    "\\boxed{__import__('os')}", "\\boxed{ünïcødé ✓}", "\\boxed{\x00}", "\\boxed{" + "(" * 500 + "}",
    "x" * 100_000, "\\boxed{1/0}", "\\boxed{\\sqrt{-1}}", "\\boxed{" + "1" * 900 + "}", "\\text{" * 3000,
]


def test_fuzz_hostile_actions():
    env = MathEnv()
    rng = random.Random(0)
    worst, errors = 0.0, 0
    for _ in range(1500):
        env.reset(seed=rng.randrange(10_000))
        action = _hostile_action(rng)
        t0 = time.perf_counter()
        obs, reward, terminated, truncated, info = env.step(action)
        worst = max(worst, time.perf_counter() - t0)
        assert reward == 0.0 and terminated != truncated
        if truncated:  # a refused action: error tool messages, counted
            assert obs and all(m["role"] == "tool" and m["content"].startswith("Error:") for m in obs)
            assert info["tool_errors"] == len(obs)
            errors += 1
        else:
            assert obs == [] and info["tool_errors"] == 0
    assert errors > 500 and worst < 2.0, (errors, worst)


# --- user task files -------------------------------------------------------------------------


def _write(tmp_path, lines, name="tasks.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_user_task_file(tmp_path):
    path = _write(tmp_path, [
        json.dumps({"id": "aime-1", "problem": "Find 2+2.", "answer": "4", "data_source": "aime24"}),
        json.dumps({"problem": "Half of one?", "answer": "\\frac{1}{2}"}),
        "",
        json.dumps({"problem": "What is 6*7?", "answer": 42, "level": "easy"}),
        json.dumps({"data_source": "dapo", "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "2^5?"}],
                    "reward_model": {"ground_truth": "32", "style": "rule"}}),
    ])
    env = make_env("math", tasks=str(path), split="all")
    assert [t.id for t in env.tasks] == ["aime-1", "line-2", "line-4", "line-5"]
    assert env.tasks[0].data["data_source"] == "aime24" and env.tasks[2].data["level"] == "easy"
    assert env.tasks[3].question == "2^5?" and env.tasks[3].answer == "32"
    for task in env.tasks:
        env.reset(options={"task_id": task.id})
        assert env.step(env.oracle(task)[0])[1] == 1.0
    env.reset(options={"task_id": "line-2"})
    assert env.step({"role": "assistant", "content": "so \\boxed{0.5}"})[1] == 1.0


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"problem": "p", "answer": ', "not valid JSON"),
        ("[1, 2]", "expected an object"),
        ('{"answer": "1"}', "'problem' must be a non-empty string"),
        ('{"problem": "p"}', "'answer' must be a non-empty string or a number"),
        ('{"problem": "p", "answer": ""}', "'answer' must be"),
        ('{"problem": "p", "answer": true}', "'answer' must be"),
        ('{"problem": "p", "answer": "1", "id": [1]}', "'id' must be"),
        ('{"problem": "p", "answer": "1", "data_source": 3}', "'data_source' must be a string"),
        ('{"id": "a", "problem": "p", "answer": "1"}', "duplicate id 'a'"),
    ],
)
def test_malformed_task_file_names_line(tmp_path, bad_line, message):
    path = _write(tmp_path, [json.dumps({"id": "a", "problem": "p", "answer": "1"}), "", bad_line])
    with pytest.raises(ValueError) as e:
        MathEnv(tasks=path)
    assert f"{path}:3" in str(e.value) and message in str(e.value), str(e.value)


def test_missing_or_empty_task_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        MathEnv(tasks=tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="no tasks"):
        MathEnv(tasks=_write(tmp_path, [""]))


@pytest.mark.skipif(HAS_PYARROW, reason="pyarrow is installed")
def test_parquet_without_pyarrow_is_a_clear_error(tmp_path):
    path = tmp_path / "tasks.parquet"
    path.write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match="needs pyarrow"):
        MathEnv(tasks=path)


@pytest.mark.skipif(not HAS_PYARROW, reason="needs pyarrow")
def test_parquet_tasks(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "tasks.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"problem": "1+1?", "answer": "2", "data_source": "a"},
        {"problem": "Half?", "answer": "\\frac{1}{2}", "data_source": "b"},
    ]), path)
    env = MathEnv(tasks=path, split="all")
    assert [t.id for t in env.tasks] == ["row-1", "row-2"]
    for task in env.tasks:
        env.reset(options={"task_id": task.id})
        assert env.step(env.oracle(task)[0])[1] == 1.0
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "p", "answer": "1"}, {"problem": "", "answer": "2"}]), bad)
    with pytest.raises(ValueError, match="row 2"):
        MathEnv(tasks=bad)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        MathEnv(tasks=junk)
