"""Evaluation: play a model on an environment's tasks and summarise success, turns and errors.

    result = evaluate(model_or_path, tokenizer, "sql_db", split="eval", num_tasks=100)
    result.success_rate, result.mean_turns, result.tool_error_rate, result.parse_error_rate

Greedy by default (temperature 0), so a figure is reproducible; `n > 1` with a temperature gives
pass@n style figures (`pass_at_n`: a task counts once any of its n samples succeeds).
The same function serves the runner's periodic evals, the bootstrap's reports and `agentopd eval`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from agentopd.engines.base import Engine
from agentopd.env import Task, ToolEnv
from agentopd.rollout import Rollout, RolloutConfig

if TYPE_CHECKING:
    import torch
from agentopd.splits import make_env_for_split, without_split
from agentopd.types import Episode, StopReason


@dataclass
class EvalResult:
    env: str
    split: str
    num_tasks: int
    n: int
    success_rate: float
    pass_at_n: float
    mean_reward: float
    mean_turns: float
    tool_error_rate: float  # tool errors per tool call
    parse_error_rate: float  # turns with a malformed tool call per turn
    stop_reasons: dict[str, int] = field(default_factory=dict)
    episodes: list[Episode] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("episodes")
        return d

    def timeout_note(self, rollout: RolloutConfig) -> str | None:
        """A line when episodes ran out of `rollout.episode_timeout_s` (graded 0: the success rate is the machine's, not
        the model's). The clock runs from an episode's start while up to `rollout.concurrency` share the engine: a 1.5B
        model on a 2-core CPU lost 31 of 50 math episodes so at the default 300 s (2026-11-29)."""
        timed_out = self.stop_reasons.get(str(StopReason.TIMEOUT), 0)
        if not timed_out:
            return None
        total = sum(self.stop_reasons.values())
        return (f"{timed_out} of {total} episodes timed out (rollout.episode_timeout_s={rollout.episode_timeout_s:g}, "
                f"{min(rollout.concurrency, total)} at once) and count as failures: raise rollout.episode_timeout_s or "
                f"lower rollout.concurrency for a model this slow on this machine")  # fmt: skip


def summarise(env: str, split: str, n: int, episodes: list[Episode]) -> EvalResult:
    by_task: dict[str, bool] = {}
    for e in episodes:
        by_task[e.task_id] = by_task.get(e.task_id, False) or e.success
    turns = [t for e in episodes for t in e.turns]
    calls = sum(sum(t.tool_calls.values()) for t in turns)
    tool_errors = sum(sum(t.tool_call_errors.values()) for t in turns)
    stops: dict[str, int] = {}
    for e in episodes:
        stops[str(e.stop_reason)] = stops.get(str(e.stop_reason), 0) + 1
    k = max(len(episodes), 1)
    return EvalResult(
        env=env,
        split=split,
        num_tasks=len(by_task),
        n=n,
        success_rate=sum(e.success for e in episodes) / k,
        pass_at_n=sum(by_task.values()) / max(len(by_task), 1),
        mean_reward=sum(e.reward for e in episodes) / k,
        mean_turns=sum(e.num_turns for e in episodes) / k,
        tool_error_rate=tool_errors / calls if calls else 0.0,
        parse_error_rate=sum(t.parse_error for t in turns) / max(len(turns), 1),
        stop_reasons=stops,
        episodes=episodes,
    )


def eval_task_ids(tasks: Sequence[Task], num_tasks: int | None, seed: int = 0) -> list[str]:
    """`num_tasks` of an env's tasks: a fixed seeded sample (tasks are often grouped by
    template, so the first N would not be representative), in the env's order; all when None.
    `agentopd eval --num-tasks N` and a run's evals (`eval.num_tasks`) play the same set."""
    ids = [t.id for t in tasks]
    if num_tasks is None or num_tasks >= len(ids):
        return ids
    keep = set(random.Random(seed).sample(range(len(ids)), num_tasks))
    return [x for i, x in enumerate(ids) if i in keep]


async def evaluate_async(
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    env_factory: Callable[[], ToolEnv],
    *,
    env_name: str,
    split: str = "eval",
    num_tasks: int | None = 100,
    n: int = 1,
    rollout: RolloutConfig = RolloutConfig(temperature=0.0),
    step: int = 0,
    seed: int = 0,
    on_episode: Callable | None = None,
) -> EvalResult:
    env = env_factory()
    task_ids = eval_task_ids(env.tasks, num_tasks, seed)
    env.close()
    ro = Rollout(env_factory, engine, tokenizer, rollout)
    specs = Rollout.specs_for(task_ids, n=n, step=step, seed=seed, split=split)
    try:
        episodes = await ro.run(specs, on_episode)
    finally:
        ro.close()
    return summarise(env_name, split, n, episodes)


def evaluate(
    model: torch.nn.Module | str | Path,
    tokenizer: PreTrainedTokenizerBase,
    env_name: str,
    *,
    env_kwargs: dict[str, Any] | None = None,
    split: str = "eval",
    num_tasks: int | None = 100,
    n: int = 1,
    rollout: RolloutConfig = RolloutConfig(temperature=0.0),
    engine_kwargs: dict[str, Any] | None = None,
    engine_kind: str = "hf",
) -> EvalResult:
    """Evaluate a model (PreTrainedModel or path) with an engine of `engine_kind` (agentopd.engines:
    hf, fast, vllm or auto) on the env's `split` (agentopd.splits: the env's own, or a held-out share)."""
    from agentopd.engines import make_engine

    kwargs = without_split(env_kwargs)
    engine = make_engine(engine_kind, model, **{"vocab_size": len(tokenizer), **(engine_kwargs or {})})  # tokenizer's ids only

    async def go() -> EvalResult:
        try:
            return await evaluate_async(
                engine, tokenizer, lambda: make_env_for_split(env_name, split, **kwargs), env_name=env_name, split=split,
                num_tasks=num_tasks, n=n, rollout=rollout,
            )  # fmt: skip
        finally:
            await engine.close()

    return asyncio.run(go())
