"""The trajectory store: schema of docs/design.md 3.5, round trip, no duplicates, crash safety."""

import json
import multiprocessing as mp
import os
import signal
import sqlite3
import time

from agentopd.store import Store
from agentopd.types import Episode, Message, StopReason, TokenStream, ToolCall, Turn

CONTRACT_COLUMNS = {
    "id", "step", "env", "task_id", "reward", "success", "num_turns", "stop_reason", "prompt_len",
    "token_ids", "response_mask", "logprobs", "turn_index", "teacher_logprobs", "messages",
}  # fmt: skip


def make_episode(step=0, task="t1") -> Episode:
    call = Message("assistant", "", [ToolCall("sql_query", {"query": "SELECT 1"})])
    msgs = [Message("user", "q?"), call, Message("tool", "1", name="sql_query"), Message("assistant", "1")]
    turns = [Turn(call, [msgs[2]], raw_text="<tool_call>...", tool_calls={"sql_query": 1}), Turn(msgs[3], [], raw_text="1")]
    stream = TokenStream([5, 6, 7, 8, 9, 10], 2, [1, 1, 0, 0], [-0.1, -0.2, 0.0, 0.0], [0, 0, 0, 0])
    return Episode("sql_db", task, msgs, [], turns, 1.0, True, StopReason.ANSWER, stream, step=step)


def test_schema_and_round_trip(tmp_path):
    store = Store(tmp_path / "trajectories.db")
    ep = make_episode()
    store.add(ep, "000000-0000")
    cols = {c.name for c in store.table.columns}
    assert CONTRACT_COLUMNS <= cols
    row = store.table.get("000000-0000")
    assert json.loads(row["token_ids"]) == ep.tokens.token_ids and row["teacher_logprobs"] is None
    back = store.get("000000-0000")
    assert back.tokens == ep.tokens and [m.to_dict() for m in back.messages] == [m.to_dict() for m in ep.messages]
    assert back.turns[0].tool_calls == {"sql_query": 1} and back.stop_reason is StopReason.ANSWER
    store.set_teacher_logprobs("000000-0000", [-0.3, -0.1, 0.0, 0.0], ep.tokens)
    row = store.table.get("000000-0000")
    assert abs(row["kl_mean"] - ((-0.1 + 0.3) + (-0.2 + 0.1)) / 2) < 1e-12


def test_same_id_never_duplicates_and_delete_after(tmp_path):
    store = Store(tmp_path / "t.db")
    for step in range(4):
        store.add(make_episode(step), f"{step:06d}-0000")
    store.add(make_episode(2), "000002-0000")
    assert store.count() == 4
    assert store.delete_after(1) == 2 and store.count() == 2


def test_readonly_reader_sees_live_writes(tmp_path):
    writer = Store(tmp_path / "t.db")
    writer.add(make_episode(0), "a")
    reader = Store(tmp_path / "t.db", readonly=True)
    assert reader.count() == 1
    writer.add(make_episode(1), "b")
    assert reader.count() == 2
    try:
        reader.db.execute("delete from episodes")
        raise AssertionError("read-only store accepted a write")
    except sqlite3.OperationalError:
        pass


def _writer(path, ready):
    store = Store(path)
    for i in range(10_000):
        store.add(make_episode(i), f"{i:06d}")
        if i == 20:
            ready.set()
        time.sleep(0.001)


def test_killed_writer_loses_nothing_finished(tmp_path):
    path = tmp_path / "t.db"
    ready = mp.get_context("fork").Event()
    proc = mp.get_context("fork").Process(target=_writer, args=(path, ready))
    proc.start()
    assert ready.wait(30)
    time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    store = Store(path, readonly=True)
    n = store.count()
    assert n > 20
    ids = [r["id"] for r in store.iter_rows()]
    assert ids == [f"{i:06d}" for i in range(n)]  # every finished episode, in order, readable
    for _, ep in store.iter_episodes():
        assert ep.tokens is not None
