"""Recoverable mistakes for demonstrations: a wrong first attempt the env answers with an error,
then the oracle's own turn — so a teacher trained on them has seen error states and how to leave them.

    rng = random.Random(0)
    demo = with_mistake(env, task, env.oracle(task), rng)     # None when no mistake applies
    demo.actions        # the oracle's turns with one wrong turn inserted before the turn it spoils
    demo.mistake_turns  # (k,): the assistant turn(s) to leave out of the loss
    sample = mask_turns(TrainSample.from_stream(episode.tokens), demo.mistake_turns)
    result = recovery_eval(model, tokenizer, "sql_db", env_kwargs={"difficulty": ["explore"]})  # after a mistake
    result.success_rate, result.by_kind     # how often the model recovers from the error state (per kind)

Mistakes (`MistakeKind`), each a near miss of one tool call of the oracle (a kind drawn at random, at a
random tool-call turn it applies to; the first one the env really rejects is used; a near miss is a
name, never an SQL keyword that would only give a syntax error):
- wrong_column: a column in a `sql_query` replaced by a plausible other name (signup_year -> signup,
  email -> email_address): the env answers "Error: no such column: ..." (with the columns when the
  env's error hints are on);
- wrong_table: a table after FROM/JOIN, or `describe_table`'s argument, in the singular/plural
  (customers -> customer): "Error: no such table ..." / "Error: no table named ...";
- wrong_value: a quoted filter value in lower case ('Boston' -> 'boston'): the query returns "(no rows)".
A near miss counts only when the env, replayed to that point, answers it with a tool message that
starts with "Error:" or shows "(no rows)": an attempt that returned a plausible wrong value (a COUNT
of 0) would teach nothing recoverable, and is not used. Tasks whose oracle has no tool call, or whose
calls have nothing to spoil, get no mistake (`with_mistake` returns None).

Measuring recovery (`recovery_eval`): each held-out task is played with the oracle's turns up to and
including an injected mistake scripted (`AfterMistake`, an engine wrapper), then the model continues
from the error state; its success rate is the share of those episodes it still solves.

Masking: the mistaken turn's tokens get response_mask 0 (`mask_turns`); the env's reply to it stays
in the context (mask 0 as every observation), and the correction that follows keeps mask 1. The token
stream itself is the one the agent loop built (docs/design.md 3.1): only the loss mask changes.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from agentopd.batch import TrainSample
from agentopd.engines.base import Engine, GenerateRequest, GenerateResult
from agentopd.engines.scripted import ScriptedEngine

if TYPE_CHECKING:
    import gymnasium
    import torch

    from agentopd.evaluate import EvalResult
    from agentopd.rollout import EpisodeSpec, RolloutConfig
    from agentopd.types import Episode


class MistakeKind(StrEnum):
    WRONG_COLUMN = "wrong_column"
    WRONG_TABLE = "wrong_table"
    WRONG_VALUE = "wrong_value"


@dataclass(frozen=True)
class DemoWithMistake:
    """The actions of a demonstration with one recoverable mistake, and which turn is the mistake."""

    actions: list[dict[str, Any]]
    mistake_turns: tuple[int, ...]  # assistant turn indices (0-based) to mask out of the loss
    kind: MistakeKind
    reply: str  # what the env answered the mistake with


# near misses a model plausibly writes for a column; other names lose their last "_part" or gain "_name"
_COLUMN_MISSES = {
    "name": "full_name", "email": "email_address", "city": "town", "price": "cost", "salary": "pay",
    "status": "state", "category": "type", "role": "job", "quantity": "qty", "id": "order_id",
    "order_id": "order_number", "order_date": "date",
}  # fmt: skip
_KEYWORDS = frozenset({"order", "group", "from", "select", "where", "table", "index", "join", "by"})  # a miss is a name, not a syntax error
_QUOTED = re.compile(r"('(?:[^']|'')*')")
_WORD = re.compile(r"\b[A-Za-z_]\w*\b")
_FROM_TABLE = re.compile(r"(\b(?:from|join)\s+)(\w+)", re.IGNORECASE)


def _column_miss(column: str) -> str:
    if column in _COLUMN_MISSES:
        return _COLUMN_MISSES[column]
    head, _, tail = column.rpartition("_")
    return head if head and head.lower() not in _KEYWORDS else f"{column}_name"


def _table_miss(table: str) -> str:
    miss = table[:-1] if table.endswith("s") else f"{table}s"
    return miss if miss.lower() not in _KEYWORDS else f"{miss}_table"


def _outside_quotes(sql: str, fn) -> str:
    """Apply `fn` to the parts of `sql` outside single-quoted literals."""
    return "".join(part if _QUOTED.fullmatch(part) else fn(part) for part in _QUOTED.split(sql))


def _spoil_column(sql: str, columns: set[str], rng: random.Random) -> str | None:
    used = sorted({w for part in _QUOTED.split(sql) if not _QUOTED.fullmatch(part) for w in _WORD.findall(part)} & columns)
    if not used:
        return None
    column = rng.choice(used)
    miss = _column_miss(column)
    done = [False]

    def swap(part: str) -> str:
        def one(m: re.Match) -> str:
            if done[0] or m.group(0) != column:
                return m.group(0)
            done[0] = True
            return miss

        return _WORD.sub(one, part)

    return _outside_quotes(sql, swap)


def _spoil_table(sql: str, tables: set[str], rng: random.Random) -> str | None:
    found = [m for m in _FROM_TABLE.finditer(sql) if m.group(2) in tables]
    if not found:
        return None
    m = rng.choice(found)
    return sql[: m.start(2)] + _table_miss(m.group(2)) + sql[m.end(2) :]


def _spoil_value(sql: str, rng: random.Random) -> str | None:
    literals = [m for m in _QUOTED.finditer(sql) if m.group(1).lower() != m.group(1)]
    if not literals:
        return None
    m = rng.choice(literals)
    return sql[: m.start()] + m.group(1).lower() + sql[m.end() :]


def _schema(env: gymnasium.Env) -> tuple[set[str], set[str]]:
    """(column names, table names) of an env with a SQL database (`env.db.schema`), else empty sets."""
    schema = getattr(getattr(env, "db", None), "schema", None) or {}
    return {c.name for cols in schema.values() for c in cols}, set(schema)


def _spoiled_call(call: dict[str, Any], kind: MistakeKind, columns: set[str], tables: set[str], rng: random.Random) -> dict[str, Any] | None:
    name, arguments = call.get("name"), dict(call.get("arguments") or {})
    if name == "sql_query" and isinstance(arguments.get("query"), str):
        sql = arguments["query"]
        spoiled = {
            MistakeKind.WRONG_COLUMN: lambda: _spoil_column(sql, columns, rng),
            MistakeKind.WRONG_TABLE: lambda: _spoil_table(sql, tables, rng),
            MistakeKind.WRONG_VALUE: lambda: _spoil_value(sql, rng),
        }[kind]()
        return None if spoiled is None or spoiled == sql else {"name": name, "arguments": {**arguments, "query": spoiled}}
    if name == "describe_table" and kind == MistakeKind.WRONG_TABLE and isinstance(arguments.get("name"), str):
        return {"name": name, "arguments": {**arguments, "name": _table_miss(arguments["name"])}}
    return None


def _reply(env: Any, task: Any, prefix: Sequence[dict[str, Any]], action: dict[str, Any]) -> str | None:
    """What the env answers `action` with after replaying `prefix` on `task` (None if the episode ended first)."""
    env.reset(options={"task_id": task.id})
    for a in prefix:
        _, _, terminated, truncated, _ = env.step(a)
        if terminated or truncated:
            return None
    obs, _, terminated, _, _ = env.step(action)
    return None if terminated or not obs else "\n".join(str(m.get("content", "")) for m in obs)


def rejected(reply: str) -> bool:
    """Does an env reply tell the model its call was wrong (an error, or an empty result)?"""
    return reply.startswith("Error:") or "(no rows)" in reply


def with_mistake(env: Any, task: Any, actions: Sequence[dict[str, Any]], rng: random.Random) -> DemoWithMistake | None:
    """`actions` (the oracle's, for `task`) with one recoverable mistake inserted (see the module
    docstring), or None when none applies. `env` is stepped (reset to `task`) to check the mistake."""
    env = getattr(env, "unwrapped", env)
    if len(actions) + 1 > getattr(env, "max_turns", len(actions) + 1):
        return None  # no turn to spare for the mistake
    columns, tables = _schema(env)
    turns = [i for i, a in enumerate(actions) if a.get("tool_calls")]
    kinds = list(MistakeKind)
    rng.shuffle(kinds)
    for kind in kinds:  # a kind first, then a turn it applies to: every kind gets its share
        rng.shuffle(turns)
        for i in turns:
            calls = list(actions[i]["tool_calls"])
            j = rng.randrange(len(calls))
            spoiled = _spoiled_call(calls[j], kind, columns, tables, rng)
            if spoiled is None:
                continue
            bad = {**actions[i], "content": actions[i].get("content") or "", "tool_calls": [*calls[:j], spoiled, *calls[j + 1 :]]}
            reply = _reply(env, task, actions[:i], bad)
            if reply is not None and rejected(reply):
                return DemoWithMistake([*actions[:i], bad, *actions[i:]], (i,), kind, reply)
    return None


def mask_turns(sample: TrainSample, turns: Sequence[int]) -> TrainSample:
    """A copy of `sample` with the tokens of assistant turns `turns` out of the loss (response_mask 0)."""
    assert len(sample.turn_index) == len(sample.response_mask), "turn_index and response_mask must align"
    drop = set(turns)
    mask = [0 if k in drop else m for m, k in zip(sample.response_mask, sample.turn_index, strict=True)]
    return replace(sample, response_mask=mask)


class AfterMistake:
    """An engine that answers an episode's first requests with scripted turns, then hands the episode to `engine`."""

    def __init__(self, engine: Engine, tokenizer: PreTrainedTokenizerBase):
        self.engine = engine
        self.scripted = ScriptedEngine(tokenizer)
        self._left: dict[str, int] = {}

    def script(self, episode_id: str, actions: Sequence[dict[str, Any]]) -> None:
        self.scripted.script(episode_id, actions)
        self._left[episode_id] = len(actions)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self._left.get(request.episode_id, 0) > 0:
            self._left[request.episode_id] -= 1
            return await self.scripted.generate(request)
        return await self.engine.generate(request)

    def release(self, episode_id: str) -> None:
        self._left.pop(episode_id, None)
        self.scripted.release(episode_id)
        self.engine.release(episode_id)

    async def update_weights(self, state_dict: dict[str, Any]) -> None:
        await self.engine.update_weights(state_dict)

    async def close(self) -> None:
        await self.engine.close()


@dataclass
class RecoveryResult:
    """A recovery evaluation: the episodes' summary and the success rate after each kind of mistake."""

    eval: EvalResult  # split "<split>+mistake"
    by_kind: dict[str, float]  # MistakeKind value -> success rate of the episodes that began with it

    @property
    def success_rate(self) -> float:
        return self.eval.success_rate


def recovery_cases(env_name: str, env_kwargs: dict[str, Any] | None = None, *, split: str = "eval", num_tasks: int | None = 100,
                   seed: int = 0) -> list[tuple[EpisodeSpec, DemoWithMistake]]:  # fmt: skip
    """(EpisodeSpec, DemoWithMistake) for the tasks of `split` a mistake applies to (of `num_tasks` drawn as evaluate does)."""
    from agentopd.evaluate import eval_task_ids
    from agentopd.rollout import Rollout
    from agentopd.splits import make_env_for_split, without_split

    env = make_env_for_split(env_name, split, **without_split(env_kwargs))
    rng = random.Random(seed)
    cases: list[tuple[str, DemoWithMistake]] = []
    try:
        u = env.unwrapped
        for task_id in eval_task_ids(u.tasks, num_tasks, seed):
            task = u.tasks[u.task_index(options={"task_id": task_id})]
            demo = with_mistake(env, task, u.oracle(task), rng)
            if demo is not None:
                cases.append((task_id, demo))
    finally:
        env.close()
    specs = Rollout.specs_for([t for t, _ in cases], n=1, seed=seed, split=split)
    return [(spec, demo) for spec, (_, demo) in zip(specs, cases, strict=True)]


def recovery_eval(
    model: torch.nn.Module | None,
    tokenizer: PreTrainedTokenizerBase,
    env_name: str,
    *,
    env_kwargs: dict[str, Any] | None = None,
    split: str = "eval",
    num_tasks: int | None = 100,
    rollout: RolloutConfig | None = None,
    seed: int = 0,
    engine: Engine | None = None,
) -> RecoveryResult:
    """How often `model` (or an `engine` given instead) solves held-out tasks after an injected mistake
    (module docstring), over the `recovery_cases` tasks."""
    from agentopd.engines import make_engine
    from agentopd.evaluate import summarise
    from agentopd.rollout import Rollout, RolloutConfig
    from agentopd.splits import make_env_for_split, without_split

    kwargs = without_split(env_kwargs)
    cases = recovery_cases(env_name, kwargs, split=split, num_tasks=num_tasks, seed=seed)
    wrapped = AfterMistake(engine if engine is not None else make_engine("hf", model, vocab_size=len(tokenizer)), tokenizer)
    for spec, demo in cases:
        wrapped.script(spec.episode_id, demo.actions[: demo.mistake_turns[-1] + 1])  # up to and including the mistake

    async def go() -> list[Episode]:
        ro = Rollout(lambda: make_env_for_split(env_name, split, **kwargs), wrapped, tokenizer, rollout or RolloutConfig(temperature=0.0))
        try:
            return await ro.run([spec for spec, _ in cases])
        finally:
            ro.close()
            await wrapped.close()

    episodes = asyncio.run(go())
    by_kind: dict[str, list[bool]] = {}
    for (_, demo), episode in zip(cases, episodes, strict=True):
        by_kind.setdefault(demo.kind.value, []).append(episode.success)
    return RecoveryResult(summarise(env_name, f"{split}+mistake", 1, episodes),
                          {k: round(sum(v) / len(v), 4) for k, v in sorted(by_kind.items())})  # fmt: skip
