"""The env checker: every registered env passes it, and it catches each kind of contract breach."""

import random

import pytest

from agentopd import registry
from agentopd.checker import Status, bad_action, check_env
from agentopd.env import Task, ToolEnv


@pytest.mark.parametrize("name", sorted(registry.envs()))
def test_every_registered_env_passes_the_checker(name):
    report = check_env(name)
    assert report.ok, report.summary()
    assert {c.name for c in report.checks if c.status is Status.PASS} >= {
        "gymnasium", "reset_types", "step_types", "determinism", "oracle", "fuzz", "privileged", "close_twice"
    }, report.summary()
    has_tools = bool(registry.make_env(name).reset(seed=0)[1]["tools"])
    hostile = next(c for c in report.checks if c.name == "hostile_values")
    assert hostile.status is (Status.PASS if has_tools else Status.SKIP), report.summary()


def test_a_plugin_env_passes_the_checker(demo_plugin):
    report = check_env("reverse_words", max_turns=3)
    assert report.ok, report.summary()
    fuzz = next(c for c in report.checks if c.name == "fuzz")
    assert fuzz.detail.startswith("1000 bad actions"), fuzz.detail


# --- a small env of our own, and the ways it can be broken -------------------------------------
def double(n: int) -> int:
    """Double a number.

    Args:
        n: The number.
    """
    return 2 * n


class DoubleEnv(ToolEnv):
    """Double a number with the `double` tool."""

    name = "double"

    def __init__(self, max_turns: int = 3):
        super().__init__([Task(id=f"d{i}", question=f"Double {i}.", answer=str(2 * i)) for i in range(10)], max_turns)

    def tools(self):
        return [double]

    def system_prompt(self) -> str:
        return "Use the double tool, then answer with the number."

    def grade(self, task, answer):
        return float(answer.strip() == task.answer)

    def oracle(self, task):
        n = int(task.question.split()[1].rstrip("."))
        call = {"name": "double", "arguments": {"n": n}}
        return [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "assistant", "content": str(2 * n)}]


class WrongOracle(DoubleEnv):
    def oracle(self, task):
        return [{"role": "assistant", "content": "-1"}]


class RaisesOnStrings(DoubleEnv):
    def step(self, action):
        if isinstance(action, str):
            raise TypeError("strings are not actions")
        return super().step(action)


class IgnoresSeed(DoubleEnv):
    calls = 0

    def task_index(self, seed=None, options=None):
        IgnoresSeed.calls += 1
        return IgnoresSeed.calls % len(self.tasks) if not options else super().task_index(seed, options)


class NoTaskId(DoubleEnv):
    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed, options=options)
        del info["task_id"]
        return obs, info


class CloseOnce(DoubleEnv):
    closed = False

    def close(self):
        if self.closed:
            raise RuntimeError("already closed")
        self.closed = True


class SilentErrors(DoubleEnv):
    def _run_call(self, call, info):
        msg = super()._run_call(call, info)
        return {**msg, "content": msg["content"].removeprefix("Error: ")}


class IntReward(DoubleEnv):
    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, int(reward), terminated, truncated, info


class EmptyPrivileged(DoubleEnv):
    def privileged_context(self, task, kind):
        return ""


def test_a_correct_env_passes():
    report = check_env(DoubleEnv())
    assert report.ok, report.summary()
    assert report.env == "double"


@pytest.mark.parametrize(
    "env_cls, check, detail",
    [
        (WrongOracle, "oracle", "oracle solutions failed"),
        (RaisesOnStrings, "fuzz", "raised TypeError: strings are not actions"),
        (IgnoresSeed, "determinism", "differ"),
        (NoTaskId, "reset_types", "info['task_id']"),
        (CloseOnce, "close_twice", "RuntimeError: already closed"),
        (SilentErrors, "fuzz", "does not start with 'Error:'"),
        (IntReward, "step_types", "reward must be a float"),
        (EmptyPrivileged, "privileged", "must be a non-empty str or None"),
    ],
)
def test_each_breach_is_caught_by_name(env_cls, check, detail):
    report = check_env(env_cls(), fuzz_steps=300)
    assert not report.ok
    failed = {c.name: c.detail for c in report.failed}
    assert check in failed, report.summary()
    assert detail in failed[check], report.summary()


def test_fuzzed_actions_are_all_bad_and_varied():
    rng = random.Random(0)
    env = DoubleEnv()
    _, info = env.reset(seed=0)
    contents = set()
    for _ in range(1000):
        obs, reward, terminated, truncated, step_info = env.step(bad_action(rng, info["tools"]))
        assert not terminated and reward == 0.0
        assert all(m["role"] == "tool" and m["content"].startswith("Error:") for m in obs)
        contents.update(m["content"].split(";")[0][:40] for m in obs)
        if truncated:
            env.reset()
    # unknown tools, non-object arguments, unknown and missing arguments, wrong types, non-dict actions
    for kind in ("Error: unknown tool", "Error: arguments must be", "Error: unknown argument", "Error: missing required",
                 "Error: argument 'n' must be int", "Error: the action must be", "Error: tool_calls must be"):
        assert any(c.startswith(kind) for c in contents), (kind, sorted(contents))


def test_kwargs_with_an_instance_are_refused():
    with pytest.raises(ValueError, match="pass a name instead"):
        check_env(DoubleEnv(), max_turns=2)


# --- a user's own task file: a held-out share of it (issue 27, defect 1) ---------------------------
def _user_task_file(tmp_path, name: str, n: int, splits: dict[int, str] | None = None):
    """`n` tasks for env `name` (sql_db over a one-table database of its own), line i marked with splits[i]."""
    import json
    import sqlite3

    kwargs = {"tasks": str(tmp_path / f"{name}.jsonl")}
    if name == "sql_db":
        kwargs["db_path"] = str(tmp_path / "mine.sqlite")
        with sqlite3.connect(kwargs["db_path"]) as conn:  # a file already made by an earlier call: the same table
            conn.execute("DROP TABLE IF EXISTS t")
            conn.executescript("CREATE TABLE t (x INTEGER); INSERT INTO t VALUES (1), (2), (3);")
        conn.close()
    lines = []
    for i in range(n):
        key = "problem" if name == "math" else "question"
        row = {"id": f"q{i}", key: f"What is {i} plus 1?", "answer": i + 1}
        if name == "sql_db":
            row = {"id": f"q{i}", "question": f"How many rows are above {i}?", "sql": f"SELECT COUNT(*) FROM t WHERE x > {i}"}
        if splits and i in splits:
            row["split"] = splits[i]
        lines.append(json.dumps(row))
    (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return kwargs


@pytest.mark.parametrize("name", ["sql_db", "calculator", "math"])
def test_a_users_task_file_holds_a_share_out_for_eval(name, tmp_path):
    kwargs = _user_task_file(tmp_path, name, 12)
    report = check_env(name, fuzz_steps=50, oracle_tasks=4, **kwargs)
    assert report.ok, report.summary()
    split = next(c for c in report.checks if c.name == "split")
    assert split.detail.startswith("10 train / 2 eval tasks, disjoint") and "hash of their ids" in split.detail, split.detail
    train = {t.id for t in registry.make_env(name, split="train", **kwargs).tasks}
    held = {t.id for t in registry.make_env(name, split="eval", **kwargs).tasks}
    assert held == {"q4", "q7"} and train == {f"q{i}" for i in range(12)} - held  # sha256 of the ids: every process alike
    assert len(registry.make_env(name, split="all", **kwargs).tasks) == 12


@pytest.mark.parametrize("name", ["sql_db", "calculator"])
def test_a_file_too_short_to_train_on_says_how_many_lines_it_needs(name, tmp_path):
    """Issue 55, item 7: the guide's two-line example (one unmarked line, one marked eval) was refused as a whole file,
    "no train tasks", without saying that the held-out share needs more unmarked lines."""
    two = _user_task_file(tmp_path, name, 2, {1: "eval"})
    message = (r"no train tasks: 1 of its 2 line\(s\) have no 'split' key, and of those 20% \(at least 1\) are held out "
               r"for eval, so at least 2 unmarked lines are needed to train on one")
    with pytest.raises(ValueError, match=message):
        registry.make_env(name, split="train", **two)
    three = _user_task_file(tmp_path, name, 3, {2: "eval"})
    assert len(registry.make_env(name, split="train", **three).tasks) == 1


@pytest.mark.parametrize("name", ["sql_db", "calculator", "math"])
def test_a_users_split_keys_choose_the_split(name, tmp_path):
    kwargs = _user_task_file(tmp_path, name, 6, {0: "eval", 1: "train", 3: "train", 4: "train", 5: "train"})
    assert {t.id for t in registry.make_env(name, split="eval", **kwargs).tasks} == {"q0", "q2"}  # q2: the one unmarked
    assert {t.id for t in registry.make_env(name, split="train", **kwargs).tasks} == {"q1", "q3", "q4", "q5"}
    one = _user_task_file(tmp_path, name, 1)
    assert [t.id for t in registry.make_env(name, split="eval", **one).tasks] == ["q0"]
    with pytest.raises(ValueError, match=r"\.jsonl: no train tasks.*\"split\": \"train\""):
        registry.make_env(name, split="train", **one)  # one task, held out: never trained on
    bad = _user_task_file(tmp_path, name, 3, {1: "test"})
    with pytest.raises(ValueError, match="'split' must be 'train' or 'eval'"):
        registry.make_env(name, **bad)
