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
        "gymnasium", "reset_types", "step_types", "determinism", "oracle", "fuzz", "close_twice"
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
