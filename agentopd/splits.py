"""How the train/eval split reaches an environment (the env contract, docs/design.md 3.2).

    env = make_env_for_split("sql_db", "eval", max_turns=4)     # the env serves its eval split
    env = make_env_for_split("reverse_words", "eval")          # a plugin without `split`: held out for it
    describe_split("reverse_words")                            # how the split reaches that env, in words

Training plays train tasks; evals play held-out ones. Two ways, picked per env:
1. The env's constructor takes `split` ("train" | "eval" | "all") and serves that split itself —
   the built-ins do, holding out entities (sql_db) or questions (calculator) of generated tasks.
2. Any other env that has a `tasks` list of `agentopd.env.Task` (every `ToolEnv`): a fixed share
   (`HELD_OUT_SHARE`) of its tasks is held out for evaluation, chosen by a hash of each task's id,
   so the same tasks are held out in every process, run and order of the list; train is the rest.
An env with neither cannot be evaluated on held-out tasks: that is a ValueError saying so (and
`agentopd check-env` reports it).

A user's own task file (`tasks=...` of sql_db, calculator, math) is split by `split_user_tasks`: a line's
optional `"split": "train" | "eval"` puts it in that split; the lines without one are divided as in 2.
"""

from __future__ import annotations

import hashlib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentopd.env import Split, Task
from agentopd.registry import env_factory, make_env

if TYPE_CHECKING:
    import gymnasium

HELD_OUT_SHARE = 0.2


def takes_split(factory: Callable[..., gymnasium.Env]) -> bool:
    """Whether an env class or factory accepts a `split` keyword."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return "split" in params


def held_out_ids(task_ids: Sequence[str], env_name: str) -> set[str]:
    """The ids held out for evaluation: the `HELD_OUT_SHARE` of them (at least 1) with the smallest
    hash of their id. ValueError when there are too few tasks to hold any out."""
    if len(task_ids) < 2:
        raise ValueError(
            f"env {env_name!r} has {len(task_ids)} task(s): at least 2 are needed to hold one out for evaluation "
            f"(or give the env a `split` constructor argument that serves its own eval tasks)"
        )
    n_eval = max(1, math.floor(len(task_ids) * HELD_OUT_SHARE))
    ranked = sorted(task_ids, key=lambda i: hashlib.sha256(str(i).encode()).digest())
    return set(ranked[:n_eval])


def split_tasks(tasks: Sequence[Task], split: str, env_name: str) -> list[Task]:
    if Split.parse(split, env_name) is Split.ALL:
        return list(tasks)
    held = held_out_ids([t.id for t in tasks], env_name)
    return [t for t in tasks if (t.id in held) == (split == Split.EVAL)]


def split_user_tasks(tasks: Sequence[Task], split: Split, source: str | Path) -> list[Task]:
    """The tasks of `split` from a user's task file `source`: a task whose line has a `split` key
    (`task.data["split"]`: "train" | "eval") is in that split only; of the others, `HELD_OUT_SHARE`
    (at least 1) are held out for eval by a hash of their ids (`held_out_ids`), the rest train.
    ValueError for another `split` value, and when `split` is left without tasks (a one-task file
    has no train tasks: its task is held out)."""
    for t in tasks:
        if t.data.get("split") not in (None, Split.TRAIN, Split.EVAL):
            raise ValueError(f"{source}: task {t.id!r}: 'split' must be 'train' or 'eval', got {t.data['split']!r:.80}")
    if split is Split.ALL:
        return list(tasks)
    unmarked = [t.id for t in tasks if t.data.get("split") is None]
    held = held_out_ids(unmarked, str(source)) if len(unmarked) > 1 else set(unmarked)
    chosen = [t for t in tasks if (t.data.get("split") or (Split.EVAL if t.id in held else Split.TRAIN)) == split]
    if not chosen and split is Split.TRAIN and len(unmarked) < 2:
        raise ValueError(
            f"{source}: no train tasks: {len(unmarked)} of its {len(tasks)} line(s) have no 'split' key, and of those "
            f"{HELD_OUT_SHARE:.0%} (at least 1) are held out for eval, so at least 2 unmarked lines are needed to train "
            f'on one; add lines (a file of a few lines shows the format, not one that trains), or mark one "split": "train"'
        )
    if not chosen:
        raise ValueError(
            f"{source}: no {split} tasks: of its {len(tasks)} task(s), {len(tasks) - len(unmarked)} have a 'split' key and "
            f"{len(held)} of the other {len(unmarked)} are held out for eval ({HELD_OUT_SHARE:.0%}, at least 1, by a hash "
            f'of their ids); add tasks, or mark some with "split": "{split}"'
        )
    return chosen


def without_split(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """An env's constructor arguments less `split` (a copy): which split an env serves is chosen where it is
    made (`make_env_for_split`), never by a preset's or a user's `env.kwargs`."""
    return {k: v for k, v in (kwargs or {}).items() if k != "split"}


def make_env_for_split(name: str, split: str = "train", **kwargs: Any) -> gymnasium.Env:
    """An env of `name` serving `split` (see the module docstring); `kwargs` are its constructor's."""
    kwargs.pop("split", None)
    if takes_split(env_factory(name)):
        return make_env(name, split=split, **kwargs)
    env = make_env(name, **kwargs)
    if Split.parse(split, name) is Split.ALL:
        return env
    tasks = getattr(env.unwrapped, "tasks", None)
    restrict = getattr(env.unwrapped, "restrict_tasks", None)
    if not isinstance(tasks, list) or restrict is None:
        env.close()
        raise ValueError(
            f"env {name!r} cannot serve held-out tasks: its constructor takes no `split` argument and it is not a "
            f"ToolEnv with a `tasks` list (agentopd.splits explains both ways)"
        )
    restrict(split_tasks(tasks, split, name))
    return env


def describe_split(name: str, tasks: str | Path | None = None) -> str:
    """How the split reaches env `name` (given a user's task file `tasks` when it takes one), in words."""
    if takes_split(env_factory(name)) and tasks:
        return f"the task file's 'split' keys, else {HELD_OUT_SHARE:.0%} of its lines held out by a hash of their ids"
    if takes_split(env_factory(name)):
        return "the env's own `split` argument"
    return f"{HELD_OUT_SHARE:.0%} of its tasks held out by a hash of their ids"
