"""The trajectory store: `trajectories.db` in a run directory (docs/design.md 3.5), via sqlite-utils.

One row per episode in table `episodes`, written (and committed) the moment the episode
finishes, in WAL mode with synchronous=NORMAL, so a killed process loses nothing already
finished (a power cut may lose the last commits, never the file) and a viewer can read
while the run writes; `with store.batch():` commits the writes inside it together. Token
streams are JSON arrays; `teacher_logprobs` is null until
the teacher scored the episode.

    store = Store(run_dir / "trajectories.db")
    store.add(episode, episode_id="000003-0007")      # id: step and slot, stable across resumes
    store.set_teacher_logprobs("000003-0007", [...])
    ep = store.get("000003-0007")                      # -> Episode
    for ep in store.iter_episodes(step=3): ...
    Store(path, readonly=True)                          # for viewers and checkers
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import sqlite_utils

from agentopd.types import Episode, Message, StopReason, TokenStream, Turn

EPISODE_COLUMNS: dict[str, type] = {
    "id": str,
    "step": int,
    "env": str,
    "task_id": str,
    "split": str,  # "train" episodes are trained on; "eval" episodes only measured
    "reward": float,
    "success": int,
    "num_turns": int,
    "stop_reason": str,
    "prompt_len": int,
    "num_tokens": int,
    "llm_tokens": int,
    "tool_errors": int,
    "parse_errors": int,
    "sample_index": int,
    "policy_version": int,
    "teacher": str,
    "kl_mean": float,
    "created_at": float,
    "token_ids": str,
    "response_mask": str,
    "logprobs": str,
    "turn_index": str,
    "teacher_logprobs": str,
    "messages": str,
    "tools": str,
    "turns": str,
    "info": str,
}


_INSERT = f"INSERT OR REPLACE INTO episodes ({', '.join(EPISODE_COLUMNS)}) VALUES ({', '.join('?' * len(EPISODE_COLUMNS))})"
JSON_COLUMNS = ("token_ids", "response_mask", "logprobs", "turn_index", "teacher_logprobs", "messages", "tools", "turns", "info")


def decode_json_columns(row: dict[str, Any]) -> dict[str, Any]:
    """An `episodes` row (any subset of its columns) with its JSON columns parsed."""
    out = dict(row)
    for col in JSON_COLUMNS:
        if isinstance(out.get(col), str):
            out[col] = json.loads(out[col])
    return out


def connect_readonly(path: str | Path) -> sqlite3.Connection:
    """A read-only connection to a trajectory store: URI mode=ro (the file is never created or
    written) + query_only; rows as sqlite3.Row. What viewers and checkers read through."""
    conn = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA query_only = 1")
    return conn


def _dumps(x: Any) -> str:
    return json.dumps(x, separators=(",", ":"), ensure_ascii=False)


def _ints(xs: list[int]) -> str:
    """A JSON array of ints, as `_dumps` writes it (3-4x faster for token ids)."""
    return "[" + ",".join(map(str, xs)) + "]"


def episode_row(episode: Episode, episode_id: str, split: str = "train", teacher: str | None = None) -> dict[str, Any]:
    """The `episodes` row of an episode (JSON arrays for the token stream)."""
    s = episode.tokens
    row: dict[str, Any] = {
        "id": episode_id,
        "step": episode.step,
        "env": episode.env,
        "task_id": episode.task_id,
        "split": split,
        "reward": float(episode.reward),
        "success": int(bool(episode.success)),
        "num_turns": episode.num_turns,
        "stop_reason": str(episode.stop_reason),
        "prompt_len": s.prompt_len if s else None,
        "num_tokens": len(s.token_ids) if s else None,
        "llm_tokens": s.num_llm_tokens if s else None,
        "tool_errors": episode.tool_errors,
        "parse_errors": sum(int(t.parse_error) for t in episode.turns),
        "sample_index": episode.sample_index,
        "policy_version": episode.policy_version,
        "teacher": teacher,
        "kl_mean": None,
        "created_at": time.time(),
        "token_ids": _ints(s.token_ids) if s else None,
        "response_mask": _ints(s.response_mask) if s else None,
        "logprobs": _dumps(s.logprobs) if s else None,
        "turn_index": _ints(s.turn_index) if s else None,
        "teacher_logprobs": None,
        "messages": _dumps([m.to_dict() for m in episode.messages]),
        "tools": _dumps(episode.tools),
        "turns": _dumps(
            [
                {
                    "raw_text": t.raw_text,
                    "tool_errors": t.tool_errors,
                    "parse_error": t.parse_error,
                    "tool_calls": t.tool_calls,
                    "tool_call_errors": t.tool_call_errors,
                    "reward": t.reward,
                    "num_observation_messages": len(t.observation),
                }
                for t in episode.turns
            ]
        ),
        "info": _dumps(episode.info),
    }
    if episode.teacher_logprobs is not None:
        row.update(_teacher_fields(s, episode.teacher_logprobs))
    return row


def _teacher_fields(stream: TokenStream | None, teacher_logprobs: list[float]) -> dict[str, Any]:
    """teacher_logprobs as JSON plus the episode's mean per-token reverse-KL estimate (k1)."""
    pairs = stream.kl_k1(teacher_logprobs) if stream is not None else []
    kl = sum(v for _, v in pairs) / len(pairs) if pairs else None
    return {"teacher_logprobs": _dumps(teacher_logprobs), "kl_mean": kl}


def row_to_episode(row: dict[str, Any]) -> Episode:
    """Rebuild an Episode (with its TokenStream) from an `episodes` row."""
    row = decode_json_columns(row)
    messages = [Message.from_dict(m) for m in row["messages"]]
    turn_rows = row["turns"] or []
    assistants = [m for m in messages if m.role == "assistant"]
    turns = []
    for i, t in enumerate(turn_rows):
        turns.append(
            Turn(
                assistant=assistants[i] if i < len(assistants) else Message("assistant", t.get("raw_text", "")),
                observation=[],
                reward=t.get("reward", 0.0),
                tool_errors=t.get("tool_errors", 0),
                parse_error=t.get("parse_error", False),
                raw_text=t.get("raw_text", ""),
                tool_calls=t.get("tool_calls", {}),
                tool_call_errors=t.get("tool_call_errors", {}),
            )
        )
    tokens = None
    if row.get("token_ids") is not None:
        tokens = TokenStream(
            token_ids=row["token_ids"],
            prompt_len=row["prompt_len"],
            response_mask=row["response_mask"],
            logprobs=row["logprobs"],
            turn_index=row["turn_index"],
        )
    return Episode(
        env=row["env"],
        task_id=row["task_id"],
        messages=messages,
        tools=row["tools"] or [],
        turns=turns,
        reward=row["reward"],
        success=bool(row["success"]),
        stop_reason=StopReason(row["stop_reason"]),
        tokens=tokens,
        teacher_logprobs=row.get("teacher_logprobs") or None,
        step=row["step"],
        sample_index=row.get("sample_index") or 0,
        policy_version=row.get("policy_version") or 0,
        info=row.get("info") or {},
    )


class Store:
    """The `episodes` table of one run. Writers commit per episode; readers open read-only."""

    def __init__(self, path: str | Path, readonly: bool = False):
        self.path = Path(path)
        self.readonly = readonly
        if readonly:
            if not self.path.exists():
                raise FileNotFoundError(f"no trajectory store at {self.path}")
            conn = connect_readonly(self.path)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, check_same_thread=False)
        self.db = sqlite_utils.Database(conn)
        if not readonly:
            self.db.enable_wal()
            # WAL + synchronous=NORMAL: a commit is an append to the WAL, no fsync; what was committed survives the
            # process being killed (the OS holds it), a power cut may lose the last commits but never corrupts the file
            self.db.execute("PRAGMA synchronous=NORMAL")
            table = self.db["episodes"]
            if not table.exists():
                table.create(EPISODE_COLUMNS, pk="id")
                table.create_index(["step"])
                table.create_index(["split", "step"])
            # covers every filter of the viewer's episode list, so a page never reads whole rows
            table.create_index(
                ["step", "id", "split", "env", "success", "reward", "num_turns", "stop_reason"],
                index_name="episodes_list",
                if_not_exists=True,
            )

    @property
    def table(self) -> sqlite_utils.db.Table:
        return self.db["episodes"]  # type: ignore[return-value]

    def add(self, episode: Episode, episode_id: str, split: str = "train", teacher: str | None = None) -> None:
        """Write one finished episode now (replacing a row of the same id: re-runs never duplicate);
        committed at once, or with the rest of a `batch()` it is written in."""
        assert not self.readonly
        row = episode_row(episode, episode_id, split, teacher)
        self._write(_INSERT, [row[c] for c in EPISODE_COLUMNS])

    def set_teacher_logprobs(self, episode_id: str, teacher_logprobs: list[float], stream: TokenStream) -> None:
        assert not self.readonly
        fields = _teacher_fields(stream, teacher_logprobs)
        self._write("UPDATE episodes SET teacher_logprobs = ?, kl_mean = ? WHERE id = ?", [fields["teacher_logprobs"], fields["kl_mean"], episode_id])

    def _write(self, sql: str, params: list[Any]) -> None:
        """One statement, committed now unless a `batch()` is open (then at its end)."""
        conn = self.db.conn
        in_batch = conn.in_transaction
        conn.execute(sql, params)
        if not in_batch:
            conn.commit()

    def batch(self) -> AbstractContextManager[Any]:
        """Writes inside commit together, at the end (one transaction): for episodes that finished
        together, e.g. one Ray work item; nothing of it is visible or kept until the commit."""
        assert not self.readonly
        return self.db.atomic()

    def get(self, episode_id: str) -> Episode:
        return row_to_episode(self.table.get(episode_id))

    def iter_rows(self, where: str | None = None, params: Any = None, order_by: str = "step, id") -> Iterator[dict]:
        yield from self.table.rows_where(where, params, order_by=order_by)

    def iter_episodes(self, step: int | None = None, split: str | None = None) -> Iterator[tuple[str, Episode]]:
        clauses, params = [], []
        if step is not None:
            clauses.append("step = ?")
            params.append(step)
        if split is not None:
            clauses.append("split = ?")
            params.append(split)
        for row in self.iter_rows(" and ".join(clauses) or None, params):
            yield row["id"], row_to_episode(row)

    def count(self, where: str | None = None, params: Any = None) -> int:
        return self.table.count_where(where, params) if where else self.table.count

    def delete_after(self, step: int) -> int:
        """Drop episodes of steps > `step` (a resumed run regenerates them). Returns how many."""
        assert not self.readonly
        n = self.count("step > ?", [step])
        with self.db.conn:
            self.table.delete_where("step > ?", [step])
        return n

    def close(self) -> None:
        self.db.conn.close()
