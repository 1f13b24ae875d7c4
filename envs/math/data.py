"""Math env task files: JSONL, or Parquet when pyarrow is installed.

One task per line (JSONL) or row (Parquet, chosen by the `.parquet` suffix):

    {"id": "aime-1", "problem": "Find ...", "answer": "204", "data_source": "aime24"}

`problem` (non-empty string) and `answer` (a string or number) are required; `id`
(default `line-<n>` / `row-<n>`), `data_source` (kept for multi-teacher routing) and `split`
("train" or "eval"; of the tasks without it, 20% are held out for eval by a hash of their
ids: `agentopd.splits.split_user_tasks`) are optional; other keys are kept in `Task.data`. Rows in the verl/DAPO layout are read too:
the problem is the last user message of `prompt` and the answer `reward_model.ground_truth`.
Anything malformed raises ValueError naming the file and line (or row) number.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentopd.env import Task, jsonl_rows, unique_tasks


def load_tasks(path: str | Path) -> list[Task]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"math: tasks file {str(path)!r} does not exist")
    rows = _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path)
    return unique_tasks(((where, _task(row, where, label)) for where, label, row in rows), path)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, str, Any]]:
    for where, lineno, row in jsonl_rows(path):
        yield where, f"line-{lineno}", row


def _parquet_rows(path: Path) -> Iterator[tuple[str, str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet task files needs pyarrow (pip install pyarrow), "
                         "or convert the file to JSONL") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own error types for corrupt files
        raise ValueError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    for i, row in enumerate(table.to_pylist(), 1):
        yield f"{path} row {i}", f"row-{i}", row


def _task(row: Any, where: str, label: str) -> Task:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object with 'problem' and 'answer', got {type(row).__name__}")
    problem, answer = row.get("problem"), row.get("answer")
    if problem is None and isinstance(row.get("prompt"), list):  # verl / DAPO layout
        users = [m.get("content") for m in row["prompt"] if isinstance(m, dict) and m.get("role") == "user"]
        problem = users[-1] if users else None
        if answer is None and isinstance(row.get("reward_model"), dict):
            answer = row["reward_model"].get("ground_truth")
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"{where}: 'problem' must be a non-empty string, got {problem!r:.60}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise ValueError(f"{where}: 'answer' must be a non-empty string or a number, got {answer!r:.60}")
    task_id = row.get("id", label)
    if isinstance(task_id, bool) or not isinstance(task_id, (str, int)):
        raise ValueError(f"{where}: 'id' must be a string or an integer, got {task_id!r:.60}")
    source = row.get("data_source")
    if source is not None and not isinstance(source, str):
        raise ValueError(f"{where}: 'data_source' must be a string, got {source!r:.60}")
    extra = {k: v for k, v in row.items() if k not in ("id", "problem", "answer")}
    return Task(id=str(task_id), question=problem, answer=str(answer).strip(), data=extra)
