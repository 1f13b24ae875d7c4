"""The `calculator` environment: multi-step arithmetic word problems with a `calculate` tool.

    env = agentopd.make_env("calculator")                      # 1,000 generated training tasks
    env = agentopd.make_env("calculator", split="eval")        # 200 held-out tasks
    env = agentopd.make_env("calculator", tasks="my.jsonl")    # your own {"question", "answer"} lines
    messages, info = env.reset(seed=0)
    for action in env.oracle(env.task): obs, reward, terminated, truncated, info = env.step(action)

Kwargs:
    tasks      a JSONL file of your own tasks (format and answer rule: `envs.calculator.data`);
               when given, `num_tasks` and `seed` are not used.
    split      "train" | "eval" | "all". Generated tasks (`envs.calculator.problems`: 11 templates
               of 1-3 steps): eval questions are held out of every train set. Your tasks: a line's
               optional "split" key, else 20% of the lines held out by a hash of their ids
               (`agentopd.splits.split_user_tasks`).
    num_tasks  how many generated tasks (default 1000 for train and all, 200 for eval).
    seed       the generated task set's seed (default 0); `reset(seed=...)` picks the task.
    max_turns  assistant turns before truncation (default 6).

The tool is `tools.calculator.calculate` (exact arithmetic, safe by construction). The
oracle makes one `calculate` call per planned step, feeding each printed result into the
next expression, and answers with the last result. Reward 1 when the final reply states
the expected number (`envs.calculator.data.parse_answer` / `answers_match`), else 0.
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import Any

from agentopd.env import Action, Privileged, Task, ToolEnv, actions_text
from agentopd.splits import split_user_tasks
from agentopd.tool import Tool
from envs.calculator.data import answers_match, load_tasks, parse_answer
from envs.calculator.problems import Split, generate
from tools.calculator import calculate, format_number

__all__ = ["CalculatorEnv", "Split"]

SYSTEM_PROMPT = "Solve the problem. Use the calculate tool for the arithmetic, then reply with only the final number."
DEFAULT_NUM_TASKS = {Split.TRAIN: 1000, Split.EVAL: 200, Split.ALL: 1000}


class CalculatorEnv(ToolEnv):
    name = "calculator"

    def __init__(
        self,
        tasks: str | Path | None = None,
        split: str = "train",
        num_tasks: int | None = None,
        seed: int = 0,
        max_turns: int = 6,
    ):
        self.split = Split.parse(split, "calculator")
        if tasks is not None and str(tasks) != "":
            task_list = split_user_tasks(load_tasks(tasks), self.split, tasks)
        else:
            n = DEFAULT_NUM_TASKS[self.split] if num_tasks is None else int(num_tasks)
            if n < 1:
                raise ValueError(f"calculator: num_tasks must be >= 1, got {num_tasks!r}")
            task_list = list(_generated_tasks(int(seed), self.split, n))
        super().__init__(task_list, max_turns=int(max_turns))

    def tools(self) -> list[Tool]:
        return [calculate]

    def system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def grade(self, task: Task, answer: str) -> float:
        return 1.0 if answers_match(parse_answer(answer), task.data["value"]) else 0.0

    def privileged_context(self, task: Task, kind: Privileged) -> str | None:
        """SOLUTION: the oracle's calculations and the answer; no SCHEMA (nothing is hidden but the solution)."""
        return actions_text(self.oracle(task)) if kind == Privileged.SOLUTION else None

    def oracle(self, task: Task) -> list[Action]:
        actions: list[Action] = []
        results: dict[str, str] = {}
        for k, step in enumerate(task.data["steps"]):
            expression = step.format(**results)
            actions.append(
                {"role": "assistant", "content": "", "tool_calls": [{"name": "calculate", "arguments": {"expression": expression}}]}
            )
            results[f"r{k}"] = calculate(expression)
        final = results[f"r{len(results) - 1}"] if results else _plain(task)
        actions.append({"role": "assistant", "content": final})
        return actions


@lru_cache(maxsize=8)  # a few (seed, split, size) sets per process
def _generated_tasks(seed: int, split: Split, num: int) -> tuple[Task, ...]:
    """Generated tasks, computed once per process: a rollout makes an env per episode, and
    drawing 1,000 problems took ~85 ms of every one."""
    return tuple(
        Task(
            id=f"calc-{p.split}-{i:05d}",
            question=p.question,
            answer=format_number(p.answer),
            data={"value": p.answer, "steps": p.steps, "template": p.template, "split": str(p.split)},
        )
        for i, p in _numbered(generate(seed, split, num))
    )


def _numbered(problems: list[Any]) -> list[tuple[int, Any]]:
    """Number problems within their own split, so ids agree between split="all" and the others."""
    counters: dict[str, int] = {}
    out = []
    for p in problems:
        counters[p.split] = counters.get(p.split, 0) + 1
        out.append((counters[p.split] - 1, p))
    return out


def _plain(task: Task) -> str:
    """A user task's answer as a bare number (no currency or separators)."""
    value: Fraction = task.data["value"]
    return format_number(value.numerator if value.denominator == 1 else value)
