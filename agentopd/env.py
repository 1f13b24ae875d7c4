"""ToolEnv: the Gym contract for multi-turn tool-using chat environments (docs/design.md 3.2).

An environment speaks chat messages (plain dicts, so any agent framework can drive it):

    env = agentopd.make_env("sql_db")
    messages, info = env.reset(seed=0)          # [{"role": "system", ...}, {"role": "user", ...}]
    info["tools"], info["task_id"]              # OpenAI-style JSON tool schemas, the task's id
    obs, reward, terminated, truncated, info = env.step(
        {"role": "assistant", "content": "", "tool_calls": [{"name": "sql_query", "arguments": {"query": "SELECT 1"}}]})
    obs                                         # [{"role": "tool", "name": "sql_query", "content": "..."}]

An episode ends when the assistant answers without a tool call (`terminated`, reward from
`grade`) or at `max_turns` (`truncated`, reward 0). Bad actions never raise: they come back
as tool messages beginning with "Error:" and are counted in `info["tool_errors"]`.

A subclass supplies its tasks, its tools, `grade(task, answer)` and `oracle(task)` (the
reference list of assistant actions that solves a task).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np

from agentopd.tool import Tool, ToolResult, invoke, tool_name, tool_schema

Action = dict[str, Any]
Messages = list[dict[str, Any]]


class EnvError(ValueError):
    """A user's environment failed (its constructor, reset, step or grader raised): one line naming
    the env, the method and the error, which `agentopd` prints and exits with code 2."""

    def __init__(self, env: str, method: str, error: BaseException):
        message = str(error) if isinstance(error, (ValueError, EnvError)) else f"{type(error).__name__}: {error}"
        super().__init__(f"env {env!r}: {method} failed: {message}")
        self.env, self.method = env, method


class Split(StrEnum):
    """Which tasks an env serves: generated envs hold some out for evaluation."""

    TRAIN = "train"
    EVAL = "eval"
    ALL = "all"

    @classmethod
    def parse(cls, value: str, env_name: str) -> Split:
        """The split named by a kwarg; ValueError naming the env and the accepted values."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{env_name}: split must be one of {[s.value for s in cls]}, got {value!r}") from None


class Privileged(StrEnum):
    """Kinds of privileged context an env can give a teacher about a task (`teacher.privileged`; agentopd.privileged):
    text the student's prompt lacks."""

    SOLUTION = "solution"  # the task's reference solution (the oracle's actions, a worked solution, the gold SQL)
    SCHEMA = "schema"  # what the student must look up first (the hidden database schema of sql_db_explore)


@dataclass(frozen=True)
class Task:
    """One task. `answer` is the expected final answer (as text); `data` holds env extras
    (e.g. the gold SQL, a difficulty, a `data_source` used for multi-teacher routing)."""

    id: str
    question: str
    answer: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


def jsonl_rows(path: Path) -> Iterator[tuple[str, int, Any]]:
    """(where, line number, parsed JSON) for every non-blank line of a user task file;
    a line that is not JSON is a ValueError naming `path:line`."""
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            yield where, lineno, row


def unique_tasks(tasks: Iterable[tuple[str, Task]], source: str | Path) -> list[Task]:
    """Tasks read from a user file, in order, given as (where, task) with `where` like "path:line".
    A repeated id is a ValueError naming both places; a file without tasks is one too."""
    out: list[Task] = []
    seen: dict[str, str] = {}
    for where, task in tasks:
        if task.id in seen:
            raise ValueError(f"{where}: duplicate id {task.id!r} (first at {seen[task.id]})")
        seen[task.id] = where
        out.append(task)
    if not out:
        raise ValueError(f"{source}: no tasks (the file is empty)")
    return out


class MessagesSpace(gymnasium.Space):
    """A list of chat messages: dicts with a string `role` and string `content`."""

    def __init__(self, roles: Sequence[str] = ("system", "user", "assistant", "tool")):
        super().__init__(shape=None, dtype=None)
        self.roles = tuple(roles)

    def contains(self, x: Any) -> bool:
        return isinstance(x, list) and all(
            isinstance(m, dict) and m.get("role") in self.roles and isinstance(m.get("content"), str) for m in x
        )

    def sample(self, mask: Any = None, probability: Any = None) -> Messages:
        return [{"role": str(self.np_random.choice(self.roles)), "content": ""}]

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"MessagesSpace({self.roles})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, MessagesSpace) and other.roles == self.roles


class ActionSpace(MessagesSpace):
    """One assistant message: `{"role": "assistant", "content": str, "tool_calls": [...]}`."""

    def __init__(self) -> None:
        super().__init__(roles=("assistant",))

    def contains(self, x: Any) -> bool:
        return super().contains([x]) and isinstance(x.get("tool_calls", []), list)

    def sample(self, mask: Any = None, probability: Any = None) -> Action:
        return {"role": "assistant", "content": "", "tool_calls": []}


class ToolEnv(gymnasium.Env):
    """Base class for tool environments. Subclasses set `name` and implement the abstract methods."""

    name: str = "tool_env"
    metadata = {"render_modes": []}
    max_tool_output_chars = 4000  # the agent loop also caps tool output in tokens

    def __init__(self, tasks: Sequence[Task], max_turns: int = 8):
        if not tasks:
            raise ValueError(f"{self.name}: no tasks")
        if max_turns < 1:
            raise ValueError(f"{self.name}: max_turns must be >= 1, got {max_turns}")
        self.tasks = list(tasks)
        self.max_turns = max_turns
        self.observation_space = MessagesSpace()
        self.action_space = ActionSpace()
        self.task: Task | None = None
        self.turn = 0
        self._done = True
        self._by_id = {t.id: i for i, t in enumerate(self.tasks)}
        if len(self._by_id) != len(self.tasks):
            raise ValueError(f"{self.name}: duplicate task ids")

    # --- to implement --------------------------------------------------------------
    def tools(self) -> list[Tool]:
        """The tools the model may call in the current task (empty for tool-free envs)."""
        raise NotImplementedError

    def system_prompt(self) -> str:
        raise NotImplementedError

    def grade(self, task: Task, answer: str) -> float:
        """Reward in [0, 1] for a final answer."""
        raise NotImplementedError

    def oracle(self, task: Task) -> list[Action]:
        """Assistant actions that solve `task` (the last one answers without tool calls)."""
        raise NotImplementedError

    def privileged_context(self, task: Task, kind: Privileged) -> str | None:
        """Text about `task` of that kind that the student's prompt lacks, for a teacher to read (privileged
        self-distillation, agentopd.privileged); None where the env has none (the default: a run that asks fails
        before it starts, naming the env and `teacher.privileged`)."""
        return None

    def restrict_tasks(self, tasks: Sequence[Task]) -> None:
        """Serve only `tasks` (a subset of this env's), e.g. the train or eval share agentopd.splits holds out."""
        if not tasks:
            raise ValueError(f"{self.name}: no tasks left after restricting")
        self.tasks = list(tasks)
        self._by_id = {t.id: i for i, t in enumerate(self.tasks)}

    # --- the Gym contract ------------------------------------------------------------
    def initial_messages(self, task: Task) -> Messages:
        return [{"role": "system", "content": self.system_prompt()}, {"role": "user", "content": task.question}]

    def task_index(self, seed: int | None = None, options: dict[str, Any] | None = None) -> int:
        options = options or {}
        if "task_id" in options:
            if str(options["task_id"]) not in self._by_id:
                raise ValueError(f"{self.name}: unknown task_id {options['task_id']!r}")
            return self._by_id[str(options["task_id"])]
        if "task_index" in options:
            return int(options["task_index"]) % len(self.tasks)
        return int(self.np_random.integers(len(self.tasks)))

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Messages, dict]:
        super().reset(seed=seed)
        self.task = self.tasks[self.task_index(seed, options)]
        self.turn = 0
        self._done = False
        tools = self.tools()
        if tools != getattr(self, "_schema_tools", None):  # schemas are built once per set of tools
            self._schema_tools, self._tools = tools, {tool_name(t): t for t in tools}
            self._schemas = [tool_schema(t) for t in tools]
        info = {"tools": _copy_json(self._schemas), "task_id": self.task.id, "tool_errors": 0}
        return self.initial_messages(self.task), info

    def step(self, action: Action) -> tuple[Messages, float, bool, bool, dict]:
        if self._done or self.task is None:
            raise RuntimeError(f"{self.name}: step() called before reset() or after the episode ended")
        self.turn += 1
        info: dict[str, Any] = {"task_id": self.task.id, "tool_errors": 0, "tool_calls": {}, "tool_call_errors": {}}
        if not isinstance(action, dict):
            return self._error_turn(info, f"the action must be an assistant message (a dict), got {type(action).__name__}")
        calls = action.get("tool_calls") or []
        if not isinstance(calls, list):
            return self._error_turn(info, "tool_calls must be a list of {'name': ..., 'arguments': {...}}")
        if not calls:
            content = action.get("content")
            answer = content if isinstance(content, str) else ""
            try:
                reward = float(self.grade(self.task, answer))
            except Exception as e:  # the env's own grader: not a bad action of the model
                raise EnvError(self.name, f"grade(task {self.task.id!r})", e) from e
            self._done = True
            info["success"] = reward >= 1.0
            return [], reward, True, False, info
        observation = [self._run_call(call, info) for call in calls]
        truncated = self.turn >= self.max_turns
        self._done = truncated
        if truncated:
            info["success"] = False
        return observation, 0.0, False, truncated, info

    def _error_turn(self, info: dict, text: str) -> tuple[Messages, float, bool, bool, dict]:
        info["tool_errors"] += 1
        truncated = self.turn >= self.max_turns
        self._done = truncated
        return [{"role": "tool", "name": "error", "content": f"Error: {text}"}], 0.0, False, truncated, info

    def _run_call(self, call: Any, info: dict) -> dict[str, Any]:
        name = call.get("name") if isinstance(call, dict) else None
        if not isinstance(name, str) or name not in self._tools:
            result = ToolResult(
                f"Error: unknown tool {name!r:.80}; available tools: {sorted(self._tools) or 'none'}", error=True
            )
            key = "unknown"
        else:
            arguments = call.get("arguments", {})
            if isinstance(arguments, str):  # some models emit arguments as a JSON string
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    pass
            result = invoke(self._tools[name], arguments)
            key = name
        info["tool_calls"][key] = info["tool_calls"].get(key, 0) + 1
        if result.error:
            info["tool_errors"] += 1
            info["tool_call_errors"][key] = info["tool_call_errors"].get(key, 0) + 1
        content = result.content
        if len(content) > self.max_tool_output_chars:
            content = content[: self.max_tool_output_chars] + f"\n[... truncated: {len(result.content)} characters in all]"
        return {"role": "tool", "name": key if key != "unknown" else str(name)[:80], "content": content}

    def close(self) -> None:
        self._done = True


def actions_text(actions: Sequence[Action]) -> str:
    """Assistant actions (an oracle's) as numbered text: each tool call as `name({json arguments})`, a final
    answer as `answer: ...` (what privileged_context(task, SOLUTION) gives for a tool env)."""
    lines = []
    for action in actions:
        calls = action.get("tool_calls") or []
        for call in calls:
            lines.append(f"{call['name']}({json.dumps(call.get('arguments', {}), sort_keys=True)})")
        if not calls:
            lines.append(f"answer: {action.get('content', '')}")
    return "\n".join(f"{i}. {line}" for i, line in enumerate(lines, 1))


def _copy_json(x: Any) -> Any:
    """A copy of JSON-shaped data (3x faster than copy.deepcopy), so callers may edit their schemas."""
    if type(x) is dict:
        return {k: _copy_json(v) for k, v in x.items()}
    if type(x) is list:
        return [_copy_json(v) for v in x]
    return x


def seeded_rng(seed: int) -> np.random.Generator:
    """The one way envs make their generators, so generated data is stable across versions."""
    return np.random.default_rng(seed)
