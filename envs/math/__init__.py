r"""The `math` environment: single-turn problems, no tools, graded on the final answer.

The path for DAPO-Math / AIME / MATH-500 style data:

    env = agentopd.make_env("math")                                   # 1,000 generated problems
    env = agentopd.make_env("math", tasks="aime.jsonl")               # or .parquet (needs pyarrow)
    env = agentopd.make_env("math", tasks="dapo.parquet", answer_format=r"Answer:\s*(\S+)")
    messages, info = env.reset(seed=0)                                # info["tools"] == []
    obs, reward, terminated, truncated, info = env.step({"role": "assistant", "content": r"... \boxed{5}"})

Kwargs:
    tasks          a JSONL/Parquet file (`envs.math.data`); when given, `num_tasks` and `seed`
                   are not used.
    split          "train" | "eval" | "all" of the generated problems (`envs.math.problems`), or
                   of your tasks: a line's optional "split" key, else 20% of the lines held out
                   by a hash of their ids (`agentopd.splits.split_user_tasks`).
    num_tasks      how many generated problems (default 1000 for train and all, 200 for eval).
    seed           the generated set's seed (default 0).
    answer_format  "boxed" (default: the last `\boxed{...}`), or a regex with exactly one
                   group that captures the answer (its last match counts).
    system_prompt  replaces the default instruction (e.g. when the problems carry their own).
    max_turns      default 1: the first assistant message ends the episode. A tool call
                   gets an "Error: unknown tool" message (there are none) and, at the turn
                   limit, truncation with reward 0.

Reward 1 when the extracted answer matches the expected one (`envs.math.answers`), else 0.
The oracle replies with a short worked solution ending in `\boxed{answer}` (for a custom
format: the first of a few standard phrasings, e.g. "Answer: 5", that the format reads).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from agentopd.env import Action, Privileged, Task, ToolEnv
from agentopd.splits import split_user_tasks
from agentopd.tool import Tool
from envs.math.answers import BOXED, answers_match, extract
from envs.math.data import load_tasks
from envs.math.problems import Split, generate

__all__ = ["MathEnv", "Split"]

BOXED_PROMPT = "Solve the problem. Put the final answer in \\boxed{}."
PLAIN_PROMPT = "Solve the problem and state the final answer."
DEFAULT_NUM_TASKS = {Split.TRAIN: 1000, Split.EVAL: 200, Split.ALL: 1000}


class MathEnv(ToolEnv):
    name = "math"

    def __init__(
        self,
        tasks: str | Path | None = None,
        split: str = "train",
        num_tasks: int | None = None,
        seed: int = 0,
        answer_format: str = BOXED,
        system_prompt: str | None = None,
        max_turns: int = 1,
    ):
        self.split = Split.parse(split, "math")
        self.answer_format = answer_format
        self.pattern = None if answer_format == BOXED else _compile(answer_format)
        self._system_prompt = system_prompt or (BOXED_PROMPT if self.pattern is None else PLAIN_PROMPT)
        if tasks is not None and str(tasks) != "":
            task_list = split_user_tasks(load_tasks(tasks), self.split, tasks)
        else:
            n = DEFAULT_NUM_TASKS[self.split] if num_tasks is None else int(num_tasks)
            if n < 1:
                raise ValueError(f"math: num_tasks must be >= 1, got {num_tasks!r}")
            task_list = list(_generated_tasks(int(seed), self.split, n))
        super().__init__(task_list, max_turns=int(max_turns))

    def tools(self) -> list[Tool]:
        return []

    def system_prompt(self) -> str:
        return self._system_prompt

    def grade(self, task: Task, answer: str) -> float:
        assert task.answer is not None
        return 1.0 if answers_match(extract(answer, self.pattern), task.answer) else 0.0

    def privileged_context(self, task: Task, kind: Privileged) -> str | None:
        """SOLUTION: the oracle's reply (the task's worked solution where it has one, else its answer); no SCHEMA."""
        return self.oracle(task)[0]["content"] if kind == Privileged.SOLUTION else None

    def oracle(self, task: Task) -> list[Action]:
        a = task.answer
        candidates = [f"The answer is $\\boxed{{{a}}}$.", f"Answer: {a}", f"The answer is {a}.", f"#### {a}", str(a)]
        if "solution" in task.data:
            candidates.insert(0, task.data["solution"])
        reply = next((c for c in candidates if self.grade(task, c) == 1.0), candidates[0])
        return [{"role": "assistant", "content": reply}]


def _compile(answer_format: str) -> re.Pattern[str]:
    try:
        pattern = re.compile(answer_format)
    except re.error as e:
        raise ValueError(f"math: answer_format {answer_format!r} is not a valid regex ({e})") from None
    if pattern.groups != 1:
        raise ValueError(f"math: answer_format {answer_format!r} must have exactly one group, has {pattern.groups}")
    return pattern


@lru_cache(maxsize=8)  # a few (seed, split, size) sets per process
def _generated_tasks(seed: int, split: Split, num: int) -> tuple[Task, ...]:
    """Generated problems, drawn once per process: a rollout makes an env per episode, and drawing 1,000 problems
    took 8-42 ms of every one (benchmarks/results/rollout_loop.md)."""
    counters: dict[str, int] = {}
    tasks = []
    for p in generate(seed, split, num):
        i = counters[p.split] = counters.get(p.split, -1) + 1
        data = {"solution": p.solution, "template": p.template, "split": str(p.split), "data_source": "generated"}
        tasks.append(Task(id=f"math-{p.split}-{i:05d}", question=p.problem, answer=p.answer, data=data))
    return tuple(tasks)

