"""Calculator env data: user task files and the answer-matching rule.

Task file (JSONL, one object per line; blank lines are skipped):

    {"id": "q1", "question": "What is 15% of 80?", "answer": 12}
    {"question": "3 pens at $1.25 each?", "answer": "$3.75", "expression": "3 * 1.25"}

`question` (non-empty string) and `answer` (a number, or a string that reads as one) are
required; `id` (default `line-<n>`), `expression` (what the oracle passes to
`calculate`; it must evaluate to the answer) and `split` ("train" or "eval"; of the tasks
without it, 20% are held out for eval by a hash of their ids:
`agentopd.splits.split_user_tasks`) are optional; other keys are kept in `Task.data`.
A malformed line raises ValueError naming the file and line number.

Answer rule (`parse_answer`, `answers_match`): strip whitespace, surrounding `*`/backticks,
a trailing period, currency signs ($ € £) and a `%` sign, and thousands separators
(`1,234.50`); what is left must be a plain number (`-12`, `3.75`, `1e3`) or a fraction
(`3/4`). If the whole reply is not a number, its last number is taken ("The total is $63."
reads as 63). Two numbers match when |given - expected| <= 1e-6 * max(1, |expected|).
"""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path
from typing import Any

from agentopd.env import Task, jsonl_rows, unique_tasks
from agentopd.tool import ToolError
from tools.calculator import calculate, evaluate

TOLERANCE = Fraction(1, 10**6)
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?(?:/\d+)?")
_LAST_NUMBER = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|[-+]?(?:\d+(?:\.\d+)?|\.\d+)(?:/\d+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?:\D|$))")
_STRIP = str.maketrans("", "", "$€£%")


def _read(text: str) -> Fraction | None:
    if not _NUMBER.fullmatch(text):
        return None
    try:
        num, _, den = text.partition("/")
        return Fraction(num) / int(den) if den else Fraction(num)
    except (ValueError, ZeroDivisionError):
        return None


def parse_answer(text: Any) -> Fraction | None:
    """The number an answer states (see the module docstring), or None."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        return None
    if not isinstance(text, str):
        text = repr(text)
    s = text.strip().strip("*`").strip().rstrip(".").translate(_STRIP).replace(" ", "")
    s = _THOUSANDS.sub("", s)
    value = _read(s)
    if value is None:
        found = _LAST_NUMBER.findall(text[-2000:])
        value = _read(found[-1].replace(",", "")) if found else None
    return value


def answers_match(given: Fraction | None, expected: Fraction) -> bool:
    return given is not None and abs(given - expected) <= TOLERANCE * max(1, abs(expected))


def load_tasks(path: str | Path) -> list[Task]:
    """Tasks from a JSONL file; ValueError naming `path:line` for anything malformed."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"calculator: tasks file {str(path)!r} does not exist")
    return unique_tasks(((where, _task(row, where, lineno)) for where, lineno, row in jsonl_rows(path)), path)


def _task(row: Any, where: str, lineno: int) -> Task:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object with 'question' and 'answer', got {type(row).__name__}")
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: 'question' must be a non-empty string, got {question!r:.60}")
    if "answer" not in row:
        raise ValueError(f"{where}: missing 'answer'")
    value = parse_answer(row["answer"])
    if value is None or not isinstance(row["answer"], (str, int, float)):
        raise ValueError(f"{where}: 'answer' must be a number, got {row['answer']!r:.60}")
    task_id = row.get("id", f"line-{lineno}")
    if not isinstance(task_id, (str, int)) or isinstance(task_id, bool):
        raise ValueError(f"{where}: 'id' must be a string or an integer, got {task_id!r:.60}")
    extra = {k: v for k, v in row.items() if k not in ("id", "question", "answer", "expression")}
    data: dict[str, Any] = {**extra, "value": value, "steps": ()}
    if "expression" in row:
        expression = row["expression"]
        try:
            result, _ = evaluate(expression)
        except ToolError as e:
            raise ValueError(f"{where}: 'expression' {expression!r:.60} is refused by calculate: {e}") from None
        if not answers_match(Fraction(result), value):
            raise ValueError(f"{where}: 'expression' gives {calculate(expression)}, but 'answer' is {row['answer']!r}")
        data["steps"] = (expression,)
    return Task(id=str(task_id), question=question, answer=str(row["answer"]), data=data)
