"""teacher.overlap: the teacher scores each played episode beside the rollout (agentopd.backends.overlap).

The scorer against the same teacher's scores taken after the rollout (a tiny random Qwen3 as in test_teacher.py),
its batching, its errors; the refusals at config load; the memory plan; and a short run on the tiny embedded pair
whose stored teacher scores equal the plain run's. The GPU side (a CUDA stream of its own beside the engine's
decode) is measured by benchmarks/realsize.py, not here: these machines have no GPU.
"""

from __future__ import annotations

import json
import sqlite3
import time

import pytest
import torch

from agentopd.backends.overlap import OverlapScorer
from agentopd.teacher import HFTeacher, TeacherMode
from test_teacher import make_streams, tiny_model


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout_s, "the scorer's thread did not score in time"
        time.sleep(0.01)


class Counting:
    """A teacher that counts the streams of each call (a real HFTeacher underneath)."""

    def __init__(self, teacher):
        self.teacher, self.calls = teacher, []

    def score(self, streams, *, mode):
        self.calls.append(len(streams))
        return self.teacher.score(streams, mode=mode)


def test_scores_equal_the_teachers_own_after_the_rollout():
    teacher = HFTeacher(tiny_model(), device="cpu", max_tokens_per_batch=10_000)
    streams = make_streams(12, seed=3)
    after = teacher.score(streams, mode=TeacherMode.TOPK)
    counting = Counting(teacher)
    least = sum(len(s.token_ids) for s in streams[:4])  # several calls
    scorer = OverlapScorer({"t": counting}, ["t"] * 12, TeacherMode.TOPK, min_tokens=least)
    for i in (5, 0, 11, 2, 7):  # played out of plan order; episode 10 never played
        scorer.add(i, streams[i])
    _wait_for(lambda: counting.calls)  # these hold enough tokens: scored while the rest still play
    for i in (1, 3, 4, 6, 8, 9):
        scorer.add(i, streams[i])
    scores, metrics = scorer.finish()
    assert scores[10] is None and len(counting.calls) > 1 and sum(counting.calls) == 11
    for i, sc in enumerate(scores):
        if i != 10:
            assert torch.allclose(torch.tensor(sc.logprobs), torch.tensor(after[i].logprobs), atol=1e-5)
            assert sc.topk_ids == after[i].topk_ids
    assert metrics["teacher/overlap_s"] >= 0 and 0 <= metrics["teacher/overlap_share"] <= 1


def test_each_teacher_gets_its_own_episodes():
    a, b = tiny_model(seed=1), tiny_model(seed=2)
    teachers = {"a": Counting(HFTeacher(a, device="cpu")), "b": Counting(HFTeacher(b, device="cpu"))}
    streams = make_streams(6, seed=4)
    who = ["a", "b", "a", "b", "b", "a"]
    scorer = OverlapScorer(teachers, who, TeacherMode.LOGPROBS, min_tokens=1)
    for i, s in enumerate(streams):
        scorer.add(i, s)
    scores, _ = scorer.finish()
    assert sum(teachers["a"].calls) == 3 and sum(teachers["b"].calls) == 3
    for i, name in enumerate(who):
        alone = teachers[name].teacher.score([streams[i]])[0].logprobs
        assert scores[i].logprobs == pytest.approx(alone, abs=1e-5)


def test_a_teacher_error_names_the_teacher_and_stops_the_run():
    class Broken:
        def score(self, streams, *, mode):
            raise ValueError("token id 999 is outside the teacher's vocabulary")

    scorer = OverlapScorer({"big": Broken()}, ["big"] * 2, TeacherMode.LOGPROBS, min_tokens=1)
    scorer.add(0, make_streams(1)[0])
    with pytest.raises(RuntimeError, match="teacher 'big': token id 999"):
        scorer.finish()
    with pytest.raises(ValueError, match="min_tokens must be >= 1"):
        OverlapScorer({}, [], TeacherMode.LOGPROBS, min_tokens=0)


def test_cancel_scores_nothing_more():
    counting = Counting(HFTeacher(tiny_model(), device="cpu"))
    scorer = OverlapScorer({"t": counting}, ["t"] * 3, TeacherMode.LOGPROBS, min_tokens=10**9)
    for i, s in enumerate(make_streams(3)):
        scorer.add(i, s)
    scorer.cancel()
    assert counting.calls == [] and not scorer._thread.is_alive()


@pytest.mark.parametrize("keys, message", [
    (["run.backend=ray"], "local backend's; on run.backend=ray"),
    (["teacher.offload=true"], "set teacher.offload=false"),
    (["recipe.intervene_below=-1.0"], "with recipe.intervene_below"),
    (["teacher.privileged=schema"], "with teacher.privileged"),
    (["trainer.loss=xtok_k1"], "with trainer.loss=xtok_k1"),
])  # fmt: skip
def test_refused_where_the_teacher_cannot_score_as_played(keys, message):
    from agentopd.config import load_config

    with pytest.raises(ValueError, match=message):
        load_config("sql_db", overrides=["teacher.overlap=true", *keys])
    load_config("sql_db", overrides=keys)  # each is fine without it


def test_the_memory_plan_holds_the_teachers_work_in_the_rollout():
    from agentopd.config import load_config
    from agentopd.flops import ModelShape
    from agentopd.memory_plan import Phase, plan_memory
    from test_memory_plan import Q8, Q17

    shapes = {"student": ModelShape.from_hf_config(Q17), "teacher": ModelShape.from_hf_config(Q8)}
    example = "configs/examples/qwen3-gpu.yaml"
    plain = plan_memory(load_config("sql_db", config_file=example), shapes, [139.0])
    beside = plan_memory(load_config("sql_db", config_file=example, overrides=["teacher.overlap=true"]), shapes, [139.0])
    assert not plain.teacher_offload and not beside.teacher_offload and beside.fits
    work = next(i for i in beside.items if i.what.startswith("scoring work"))
    assert tuple(work.phases) == (Phase.ROLLOUT, Phase.TEACHER) and work.gib > 1
    assert beside.peak(0, Phase.ROLLOUT) == pytest.approx(plain.peak(0, Phase.ROLLOUT) + work.gib)
    assert beside.peak(0, Phase.TEACHER) == pytest.approx(plain.peak(0, Phase.TEACHER))
    # an H100's 79 GiB: a teacher that auto would offload stays resident (and the engine sleeps if it must)
    small = plan_memory(load_config("sql_db", config_file=example, overrides=["teacher.overlap=true"]), shapes, [79.2])
    assert not small.teacher_offload


SHORT = ["steps=2", "rollout.tasks_per_step=3", "rollout.n=2", "rollout.max_new_tokens=24", "rollout.max_turns=3",
         "eval.every=0", "teacher.selftest_oracle=false", "run.seed=5"]  # fmt: skip


def _teacher_scores(run) -> dict[str, list[float]]:
    with sqlite3.connect(run / "trajectories.db") as db:
        rows = db.execute("SELECT id, teacher_logprobs FROM episodes WHERE split = 'train'").fetchall()
    return {i: json.loads(lp) for i, lp in rows}


def test_a_run_scores_beside_the_rollout_as_it_would_after(cli, tiny_home, tmp_path):
    plain, beside = tmp_path / "plain", tmp_path / "beside"
    assert cli("run", "--env", "sql_db", "--run-dir", plain, *SHORT).exit_code == 0
    result = cli("run", "--env", "sql_db", "--run-dir", beside, *SHORT, "teacher.overlap=true", "teacher.overlap_min_tokens=1")
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (beside / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "loss" in r]
    assert len(trained) == 2 and all(r["teacher/overlap_s"] >= 0 and 0 <= r["teacher/overlap_share"] <= 1 for r in trained)
    assert any(r["teacher/overlap_share"] > 0 for r in trained)  # some episodes were scored while others still played
    a, b = _teacher_scores(plain), _teacher_scores(beside)
    assert a.keys() == b.keys() and len(a) == 12
    for k in a:
        assert b[k] == pytest.approx(a[k], abs=1e-4), k


@pytest.mark.gpu
def test_on_a_gpu_the_thread_scores_on_a_stream_of_its_own_beside_other_work():
    """The scorer's kernels run on its own CUDA stream while this thread keeps the default stream busy (standing in
    for the engine's decode): the scores equal the teacher's own after, taken on the default stream."""
    shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64)
    teacher = HFTeacher(tiny_model(**shape), device="cuda", dtype=torch.bfloat16, offload_after_score=False)
    streams = make_streams(16, seed=6)
    after = teacher.score(streams, mode=TeacherMode.HIDDEN)
    scorer = OverlapScorer({"t": teacher}, ["t"] * 16, TeacherMode.HIDDEN, min_tokens=1, device=torch.device("cuda"))
    assert scorer._stream is not None and scorer._stream != torch.cuda.default_stream()
    busy = torch.randn(2048, 2048, device="cuda")
    for i, s in enumerate(streams):
        scorer.add(i, s)
        for _ in range(20):
            busy = torch.tanh(busy @ busy)
    scores, metrics = scorer.finish()
    torch.cuda.synchronize()
    for a, b in zip(scores, after):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3) and a.hidden.device.type == "cpu"
        assert torch.allclose(a.hidden.float(), b.hidden.float(), atol=2e-2)
    assert metrics["teacher/overlap_share"] > 0
