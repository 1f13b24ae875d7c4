"""The environment checker: does an env keep the contract of docs/design.md 3.2?

    from agentopd.checker import check_env
    report = check_env("sql_db", max_turns=4)      # by registered name (+ env kwargs), or an env instance
    report.ok, [(c.name, c.status, c.detail) for c in report.checks]

Checks, in order (each one a named `Check` with pass / fail / skip and a detail line):
    gymnasium          `gymnasium.utils.env_checker.check_env` (spaces, reset/step API, seeding,
                       step determinism, returned data not reused); its render checks and its
                       spec-based close check are skipped (no render modes; env not made by
                       gymnasium.make: `close_twice` below covers close)
    reset_types        reset -> (list of system/user messages, info with `tools` schemas and `task_id`)
    step_types         step -> (list of tool messages, float, bool, bool, info with int `tool_errors`)
    determinism        same seed -> same task and identical reset and oracle-step results, also
                       across two env instances when the checker built the env itself
    oracle             every oracle solution earns reward 1 on a sample of tasks
    fuzz               `fuzz_steps` random bad actions (unknown tools, wrong types, non-dict
                       arguments, strings, None, hostile strings) raise nothing and come back as
                       tool messages starting with "Error:", counted in `info["tool_errors"]`,
                       none slower than `max_step_s`
    hostile_values     every hostile string (SQL injection, `9**9**9`, 10,000 characters,
                       control and non-ASCII characters, ...) as each string argument of each
                       tool, correctly typed: nothing raises, each reply is a tool message,
                       none slower than `max_step_s` (whether it is an error is the env's call)
    privileged         `privileged_context(task, kind)` gives a non-empty str or None for every kind
                       (agentopd.env.Privileged), never raises; skipped for an env without the method
    close_twice        `close()` twice raises nothing

An env instance passed in is closed at the end.
"""

from __future__ import annotations

import random
import time
import traceback
import warnings
from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import gymnasium
from gymnasium.utils.env_checker import check_env as gym_check_env
from gymnasium.utils.env_checker import data_equivalence


class Status(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"


@dataclass
class Check:
    name: str
    status: Status
    detail: str = ""


@dataclass
class CheckReport:
    env: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.status is not Status.FAIL for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status is Status.FAIL]

    def summary(self) -> str:
        lines = [f"{self.env}: {'ok' if self.ok else 'FAILED'}"]
        lines += [f"  {c.status.value:4}  {c.name}: {c.detail}" for c in self.checks]
        return "\n".join(lines)


class CheckFailed(AssertionError):
    """A check's expectation did not hold (the message is the check's detail)."""


def check_env(
    name_or_env: str | gymnasium.Env,
    *,
    fuzz_steps: int = 1000,
    oracle_tasks: int = 20,
    seeds: tuple[int, ...] = (0, 1, 7),
    max_step_s: float = 2.0,
    **kwargs: Any,
) -> CheckReport:
    """Run every check on an env (a registered name built with `kwargs`, or an instance)."""
    if isinstance(name_or_env, str):
        from agentopd.registry import make_env

        def make() -> gymnasium.Env:
            return make_env(name_or_env, **kwargs)

        env, label, fresh = make(), name_or_env, make
    else:
        if kwargs:
            raise ValueError(f"env kwargs {sorted(kwargs)} given with an env instance; pass a name instead")
        env, fresh = name_or_env, None
        label = getattr(env.unwrapped, "name", type(env.unwrapped).__name__)
    report = CheckReport(label)
    steps: list[tuple[str, Callable[[], str]]] = [
        ("gymnasium", lambda: _gymnasium(env)),
        ("reset_types", lambda: _reset_types(env)),
        ("step_types", lambda: _step_types(env)),
        ("determinism", lambda: _determinism(env, seeds, fresh)),
        ("oracle", lambda: _oracle(env, oracle_tasks)),
        ("fuzz", lambda: _fuzz(env, fuzz_steps, max_step_s)),
        ("hostile_values", lambda: _hostile_values(env, max_step_s)),
        ("privileged", lambda: _privileged(env)),
        ("close_twice", lambda: _close_twice(env)),
    ]
    if isinstance(name_or_env, str):
        steps.append(("split", lambda: _split(name_or_env, kwargs)))
    for name, run in steps:
        report.checks.append(_run_check(name, run))
    return report


def _run_check(name: str, run: Callable[[], str]) -> Check:
    try:
        detail = run()
    except _Skip as e:
        return Check(name, Status.SKIP, str(e))
    except CheckFailed as e:
        return Check(name, Status.FAIL, str(e))
    except Exception as e:  # an env that raises fails the check; show where
        where = traceback.extract_tb(e.__traceback__)[-1]
        return Check(name, Status.FAIL, f"raised {type(e).__name__}: {e} (at {where.filename}:{where.lineno})")
    return Check(name, Status.PASS, detail)


class _Skip(Exception):
    pass


def _split(name: str, kwargs: dict[str, Any]) -> str:
    """Training and evaluation get disjoint, non-empty task sets (agentopd.splits: the env's own
    `split` argument, or a share of its tasks held out by the runner)."""
    from agentopd.env import Split
    from agentopd.splits import describe_split, make_env_for_split, without_split

    kwargs = without_split(kwargs)
    ids = {}
    for split in (Split.TRAIN, Split.EVAL):
        try:
            env = make_env_for_split(name, split, **kwargs)
        except ValueError as e:
            raise CheckFailed(f"no held-out tasks for evaluation: {e}") from None
        ids[split] = {t.id for t in getattr(env.unwrapped, "tasks", [])}
        env.close()
        if not ids[split]:
            raise CheckFailed(f"the {split} split has no tasks")
    shared = ids[Split.TRAIN] & ids[Split.EVAL]
    if shared:
        raise CheckFailed(f"{len(shared)} task id(s) in both train and eval, e.g. {sorted(shared)[0]!r}")
    return f"{len(ids[Split.TRAIN])} train / {len(ids[Split.EVAL])} eval tasks, disjoint ({describe_split(name, kwargs.get('tasks'))})"


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise CheckFailed(message)


# --- the checks ---------------------------------------------------------------------------------
def _gymnasium(env: gymnasium.Env) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            gym_check_env(env, skip_render_check=True, skip_close_check=True)
        except AssertionError as e:
            raise CheckFailed(f"gymnasium check_env: {e}") from None
    notes = sorted({str(w.message).split("\x1b[0m")[0].removeprefix("\x1b[33mWARN: ")[:160] for w in caught})
    detail = "passed; skipped: render checks (no render modes), spec close check (see close_twice)"
    return detail + (f"; warnings: {' | '.join(notes)}" if notes else "")


def _is_messages(obs: Any, roles: tuple[str, ...]) -> bool:
    return isinstance(obs, list) and all(
        isinstance(m, dict) and m.get("role") in roles and isinstance(m.get("content"), str) for m in obs
    )


def _reset_types(env: gymnasium.Env) -> str:
    result = env.reset(seed=0)
    _expect(isinstance(result, tuple) and len(result) == 2, f"reset must return (observation, info), got {type(result).__name__}")
    obs, info = result
    _expect(_is_messages(obs, ("system", "user")) and len(obs) > 0, f"reset observation must be a non-empty list of system/user messages, got {obs!r:.200}")
    _expect(isinstance(info, dict), f"reset info must be a dict, got {type(info).__name__}")
    _expect("task_id" in info and isinstance(info["task_id"], str) and info["task_id"] != "", f"info['task_id'] must be a non-empty str, got {info.get('task_id')!r}")
    tools = info.get("tools")
    _expect(isinstance(tools, list), f"info['tools'] must be a list of JSON tool schemas, got {tools!r:.200}")
    names = []
    for schema in tools:
        fn = schema.get("function") if isinstance(schema, dict) else None
        _expect(
            isinstance(schema, dict) and schema.get("type") == "function" and isinstance(fn, dict) and isinstance(fn.get("name"), str),
            f"each tool schema must be {{'type': 'function', 'function': {{'name': ..., ...}}}}, got {schema!r:.200}",
        )
        names.append(fn["name"])
    _expect(len(set(names)) == len(names), f"duplicate tool names {names}")
    return f"{len(obs)} initial messages; tools: {', '.join(names) or 'none'}"


def _oracle_actions(env: gymnasium.Env) -> list[dict[str, Any]]:
    u = env.unwrapped
    if not hasattr(u, "oracle") or getattr(u, "task", None) is None:
        raise _Skip("the env has no oracle(task) / current task")
    return u.oracle(u.task)


def _step_types(env: gymnasium.Env) -> str:
    env.reset(seed=0)
    actions = _oracle_actions(env)
    _expect(isinstance(actions, list) and actions, "oracle(task) must return a non-empty list of assistant messages")
    for i, action in enumerate(actions):
        result = env.step(action)
        _expect(isinstance(result, tuple) and len(result) == 5, f"step must return a 5-tuple, got {result!r:.200}")
        obs, reward, terminated, truncated, info = result
        _expect(_is_messages(obs, ("tool", "user")), f"step {i}: observation must be a list of tool/user messages, got {obs!r:.200}")
        _expect(isinstance(reward, float) and not isinstance(reward, bool), f"step {i}: reward must be a float, got {type(reward).__name__}")
        _expect(type(terminated) is bool and type(truncated) is bool, f"step {i}: terminated/truncated must be bool, got {type(terminated).__name__}/{type(truncated).__name__}")
        _expect(isinstance(info, dict) and isinstance(info.get("tool_errors"), int), f"step {i}: info['tool_errors'] must be an int, got {info!r:.200}")
        if terminated or truncated:
            _expect(i == len(actions) - 1, f"the episode ended at oracle step {i} of {len(actions)}")
            return f"{len(actions)} oracle steps, ended with terminated={terminated} truncated={truncated}"
    raise CheckFailed(f"the episode did not end after the oracle's {len(actions)} actions (the last must answer without a tool call)")


def _rollout(env: gymnasium.Env, seed: int) -> list[Any]:
    """reset(seed) then the oracle actions: every returned value, copied."""
    obs, info = env.reset(seed=seed)
    trace: list[Any] = [deepcopy((obs, info))]
    for action in _oracle_actions(env):
        result = env.step(deepcopy(action))
        trace.append(deepcopy(result))
        if result[2] or result[3]:
            break
    return trace


def _determinism(env: gymnasium.Env, seeds: tuple[int, ...], fresh: Callable[[], gymnasium.Env] | None) -> str:
    other = fresh() if fresh is not None else None
    task_ids = set()
    try:
        for seed in seeds:
            a, b = _rollout(env, seed), _rollout(env, seed)
            _expect(data_equivalence(a, b, exact=True), f"seed {seed}: two runs on the same env differ: {_first_difference(a, b)}")
            if other is not None:
                c = _rollout(other, seed)
                _expect(data_equivalence(a, c, exact=True), f"seed {seed}: two env instances differ: {_first_difference(a, c)}")
            task_ids.add(a[0][1]["task_id"])
    finally:
        if other is not None:
            other.close()
    where = "one env and a second instance" if other is not None else "one env"
    return f"seeds {list(seeds)} -> tasks {sorted(task_ids)}, identical on {where}"


def _first_difference(a: list[Any], b: list[Any]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if not data_equivalence(x, y, exact=True):
            return f"{'reset' if i == 0 else f'step {i}'}: {x!r:.150} vs {y!r:.150}"
    return f"{len(a)} vs {len(b)} results"


def _oracle(env: gymnasium.Env, n: int) -> str:
    u = env.unwrapped
    tasks = getattr(u, "tasks", None)
    if tasks:
        rng = random.Random(0)
        sample = rng.sample(list(tasks), min(n, len(tasks)))
        resets = [{"options": {"task_id": t.id}} for t in sample]
    else:
        resets = [{"seed": s} for s in range(n)]
    failures = []
    for reset in resets:
        env.reset(**reset)
        task_id = getattr(u.task, "id", reset)
        reward, ended = 0.0, False
        for action in _oracle_actions(env):
            _, reward, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                ended = terminated
                break
        if not ended or reward != 1.0:
            failures.append(f"{task_id} (reward {reward}, terminated {ended})")
    _expect(not failures, f"{len(failures)}/{len(resets)} oracle solutions failed: {', '.join(map(str, failures[:5]))}")
    return f"{len(resets)} tasks, all reward 1.0"


def _privileged(env: gymnasium.Env) -> str:
    from agentopd.env import Privileged

    u = env.unwrapped
    if not hasattr(u, "privileged_context"):
        raise _Skip("the env has no privileged_context(task, kind)")
    env.reset(seed=0)
    given = []
    for kind in Privileged:
        text = u.privileged_context(u.task, kind)
        _expect(text is None or (isinstance(text, str) and text.strip() != ""),
                f"privileged_context(task, {kind.value!r}) must be a non-empty str or None, got {text!r:.200}")  # fmt: skip
        given.append(f"{kind.value}: {'none' if text is None else f'{len(text)} chars'}")
    return "; ".join(given)


# --- fuzzing --------------------------------------------------------------------------------------
HOSTILE_STRINGS = (
    "",
    " ",
    "'; DROP TABLE users; --",
    "ATTACH DATABASE '/tmp/x.db' AS x",
    "PRAGMA writable_schema = ON",
    "9**9**9",
    "10**-10**10",
    "\x00\x01\x02",
    "{\"name\": ",
    "<tool_call>{}</tool_call>",
    "ünïcødé ✓ 数据库 🙂",
    "\u202etxt.exe",
    "x" * 10_000,
    "(" * 500,
    "../../etc/passwd",
    "None",
    "null",
    "__import__('os').system('echo hi')",
)
_JSON_VALUES: dict[str, tuple[Any, ...]] = {
    "string": ("text", "'; DROP TABLE t; --", "ünï ✓"),
    "integer": (3, -1, 0),
    "number": (2.5, 0.1, -1e300),  # not whole: an integer parameter refuses them
    "boolean": (True, False),
    "array": ([], [1, "a"], [None]),
    "object": ({}, {"a": 1}, {"nested": {"x": [1]}}),
    "null": (None,),
}

_SCALAR_TYPES = ("string", "integer", "number", "boolean")


def _wrong_value(rng: random.Random, json_type: str) -> Any:
    """A value no parameter of `json_type` accepts (an int is a valid number, so is not 'wrong')."""
    ok = {json_type} | ({"integer"} if json_type == "number" else set())
    kinds = [k for k in _JSON_VALUES if k not in ok]
    return rng.choice(_JSON_VALUES[rng.choice(kinds)])


def _any_value(rng: random.Random) -> Any:
    return rng.choice([*HOSTILE_STRINGS, *[v for vs in _JSON_VALUES.values() for v in vs]])


def _bad_call(rng: random.Random, tools: list[dict[str, Any]]) -> Any:
    """One tool call that must be refused."""
    fns = [t["function"] for t in tools]
    kind = rng.randrange(7) if fns else rng.randrange(3)
    if kind == 0:  # not a call at all
        return rng.choice([None, 7, "sql_query", [], ["a"], rng.choice(HOSTILE_STRINGS)])
    if kind == 1:  # an unknown tool
        known = {f["name"] for f in fns}
        name = rng.choice([n for n in (*HOSTILE_STRINGS, "rm_rf", "eval", "Sql_Query", "list_tables ") if n not in known])
        return {"name": name, "arguments": {"x": _any_value(rng)}}
    if kind == 2:  # a name that is not a string
        return {"name": rng.choice([None, 3, ["sql_query"], {"n": 1}]), "arguments": {}}
    fn = rng.choice(fns)
    props: dict[str, Any] = (fn.get("parameters") or {}).get("properties") or {}
    required = list((fn.get("parameters") or {}).get("required") or [])
    if kind == 3:  # arguments that are not an object (a JSON-ish string that is not JSON, a list, ...)
        return {"name": fn["name"], "arguments": rng.choice([None, 3, [1, 2], "not json {", "{'a': 1}", "[]", rng.choice(HOSTILE_STRINGS)])}
    if kind == 4:  # an unknown argument
        args = {p: _JSON_VALUES.get(props[p].get("type"), ("x",))[0] for p in required}
        args[rng.choice(["__class__", "evil", "query ", "ünï", "x" * 300])] = _any_value(rng)
        return {"name": fn["name"], "arguments": args}
    # wrong types only where a refusal is owed: scalar, non-nullable parameters
    typed = [p for p, s in props.items() if isinstance(s, dict) and s.get("type") in _SCALAR_TYPES and not s.get("nullable")]
    if kind == 5 and typed:  # a wrong type
        args = {p: _JSON_VALUES.get(props[p].get("type"), ("x",))[0] for p in required}
        p = rng.choice(typed)
        args[p] = _wrong_value(rng, props[p]["type"])
        return {"name": fn["name"], "arguments": args}
    if required:  # a required argument missing
        return {"name": fn["name"], "arguments": {}}
    return {"name": fn["name"] + "_", "arguments": {}}


def bad_action(rng: random.Random, tools: list[dict[str, Any]]) -> Any:
    """One malformed or hostile assistant action that the env must refuse with an "Error:" tool message."""
    kind = rng.randrange(10)
    if kind == 0:  # not a message at all
        return rng.choice([None, 0, 1.5, [], ["tool_calls"], rng.choice(HOSTILE_STRINGS), b"bytes"])
    if kind == 1:  # tool_calls that is not a list
        return {"role": "assistant", "content": "", "tool_calls": rng.choice(["sql_query", 5, {"name": "x"}, True, rng.choice(HOSTILE_STRINGS[2:])])}
    calls = [_bad_call(rng, tools) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
    return {"role": "assistant", "content": rng.choice(["", *HOSTILE_STRINGS[:6]]), "tool_calls": calls}


def _fuzz(env: gymnasium.Env, n: int, max_step_s: float) -> str:
    rng = random.Random(1234)
    _, info = env.reset(seed=0)
    tools, worst, errors, episodes = info["tools"], 0.0, 0, 1
    for i in range(n):
        action = bad_action(rng, tools)
        t0 = time.perf_counter()
        try:
            obs, reward, terminated, truncated, step_info = env.step(action)
        except Exception as e:
            raise CheckFailed(f"bad action {i} raised {type(e).__name__}: {e}; action: {action!r:.300}") from None
        worst = max(worst, time.perf_counter() - t0)
        _expect(not terminated, f"bad action {i} ended the episode as an answer: {action!r:.300}")
        _expect(bool(obs) and _is_messages(obs, ("tool",)), f"bad action {i} did not come back as tool messages: {obs!r:.300}")
        bad = [m["content"][:120] for m in obs if not m["content"].startswith("Error:")]
        if bad:
            raise CheckFailed(f"bad action {i} got a reply that does not start with 'Error:': {bad[0]!r}; action: {action!r:.300}")
        _expect(step_info.get("tool_errors") == len(obs), f"bad action {i}: info['tool_errors']={step_info.get('tool_errors')!r} for {len(obs)} error messages")
        _expect(reward == 0.0, f"bad action {i} earned reward {reward}")
        errors += len(obs)
        if truncated:
            env.reset(seed=i + 1)
            episodes += 1
    _expect(worst <= max_step_s, f"the slowest bad action took {worst:.2f} s (limit {max_step_s} s)")
    return f"{n} bad actions over {episodes} episodes -> {errors} 'Error:' tool messages; slowest step {worst * 1e3:.1f} ms"


def _hostile_values(env: gymnasium.Env, max_step_s: float) -> str:
    _, info = env.reset(seed=0)
    calls = []
    for schema in info["tools"]:
        fn = schema["function"]
        props = (fn.get("parameters") or {}).get("properties") or {}
        base = {p: _JSON_VALUES[s["type"]][0] for p, s in props.items() if s.get("type") in _JSON_VALUES}
        calls += [
            {"name": fn["name"], "arguments": {**base, p: text}}
            for p, s in props.items() if s.get("type") == "string" for text in HOSTILE_STRINGS
        ]
    if not calls:
        raise _Skip("no tool takes a string argument")
    worst, errors = 0.0, 0
    for i, call in enumerate(calls):
        t0 = time.perf_counter()
        try:
            obs, _, terminated, truncated, _ = env.step({"role": "assistant", "content": "", "tool_calls": [call]})
        except Exception as e:
            raise CheckFailed(f"{call!r:.200} raised {type(e).__name__}: {e}") from None
        worst = max(worst, time.perf_counter() - t0)
        _expect(not terminated and len(obs) == 1 and _is_messages(obs, ("tool",)), f"{call!r:.200} got {obs!r:.200}")
        errors += obs[0]["content"].startswith("Error:")
        if truncated:
            env.reset(seed=i + 1)
    _expect(worst <= max_step_s, f"the slowest hostile call took {worst:.2f} s (limit {max_step_s} s)")
    return f"{len(calls)} calls, {errors} refused with 'Error:'; slowest step {worst * 1e3:.1f} ms"


def _close_twice(env: gymnasium.Env) -> str:
    env.close()
    env.close()
    return "close() twice raised nothing"
