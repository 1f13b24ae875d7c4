"""Cross-tokenizer distillation wired end to end (issue 31): projection of span scores onto the student's tokens, the
run's refusals, and a real `agentopd run --env sql_db teacher=builtin:cross trainer.loss=xtok_k1` on tiny models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from agentopd.crosstok import align_episode
from agentopd.crosstok.project import cross_metrics, project
from agentopd.teacher.base import TeacherScores
from test_crosstok_align import TURNS, _episode


@pytest.fixture(scope="module")
def small_tok(tmp_path_factory):
    from agentopd.bootstrap import TINY_SPEC, ensure_tokenizer

    return ensure_tokenizer(TINY_SPEC, home=tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="module")
def big_tok(tmp_path_factory):
    """Another BPE over the same corpus (2x the vocabulary), as builtin:cross's."""
    from agentopd.bootstrap import TINY_SPEC, cross_spec, ensure_tokenizer

    return ensure_tokenizer(cross_spec(TINY_SPEC), home=tmp_path_factory.mktemp("home"))


def test_project_same_tokenizer_is_sampled_k1(small_tok):
    ep = _episode(small_tok, TURNS, [True, True])
    al = align_episode(ep, small_tok, small_tok)
    g = torch.Generator().manual_seed(0)
    t_lp = [(-float(torch.rand(1, generator=g)) * 3) * m for m in al.teacher_stream.response_mask]
    xs = project(al, ep.tokens, TeacherScores(t_lp))
    for m, a, b, c in zip(ep.tokens.response_mask, xs.train.logprobs, xs.store, t_lp):
        assert m == 0 or (a == pytest.approx(c) and b == pytest.approx(c))


def test_project_cross_spans(small_tok, big_tok):
    ep = _episode(small_tok, TURNS, [True, False])
    al = align_episode(ep, small_tok, big_tok)
    assert len(big_tok) > len(small_tok) and al.shares()["aligned"] == 1.0 and al.shares()["one_to_one"] < 1.0
    t_lp = [-0.25 * m for m in al.teacher_stream.response_mask]
    xs = project(al, ep.tokens, TeacherScores(t_lp))
    old = ep.tokens.logprobs
    for sid in range(al.num_spans):
        toks = [r for r, s in enumerate(al.student_span_R) if s == sid]
        n_t = sum(1 for s in al.teacher_span_R if s == sid)
        adv = -0.25 * n_t - sum(old[r] for r in toks)
        assert xs.span_kl[sid] == pytest.approx(-adv)
        for r in toks:  # each token carries the span's advantage; the store's per-token k1 sums to the span's
            assert xs.train.logprobs[r] - old[r] == pytest.approx(adv)
        assert sum(old[r] - xs.store[r] for r in toks) == pytest.approx(-adv)
    assert sum(xs.turn_kl.values()) == pytest.approx(sum(xs.span_kl))
    m = cross_metrics([al], [xs])
    assert m["xtok/aligned_share"] == 1.0 and 0 < m["xtok/one_to_one_share"] < 1 and {"xtok/kl_turn/0", "xtok/kl_turn/1"} <= set(m)


def test_config_accepts_xtok_and_refuses_what_is_not_wired():
    from agentopd.config import load_config

    cfg = load_config("sql_db", overrides=["trainer.loss=xtok_k1", "teacher=builtin:cross"])
    assert cfg.trainer.loss == "xtok_k1"
    with pytest.raises(ValueError, match="teacher_fraction"):
        load_config("sql_db", overrides=["trainer.loss=xtok_k1", "recipe.teacher_fraction=0.5"])


def add_cross_teacher(home: Path, env: str = "sql_db", sharpness: float = 1.2) -> Path:
    """A tiny cross-tokenizer teacher in a tiny home (conftest.build_tiny_home): a peaky random Qwen3 over a BPE
    of twice the vocabulary, cached where bootstrap(cross=True) finds it."""
    from transformers import Qwen3ForCausalLM

    from agentopd.bootstrap import RECIPE, TINY_SPEC, ModelSize, cross_spec, default_spec, ensure_tokenizer, env_version
    from agentopd.config import load_config
    from agentopd.splits import without_split

    tok = ensure_tokenizer(cross_spec(TINY_SPEC), home=home)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(ModelSize(hidden=32, layers=1, heads=2, kv_heads=1).config(tok, 1024))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(12.0)
        model.model.norm.weight.fill_(sharpness)
    root = home / "models" / "cross" / env
    model.save_pretrained(root / "teacher")
    tok.save_pretrained(root / "teacher")
    kwargs = without_split(load_config(env).env.kwargs)
    report = {"spec": asdict(cross_spec(default_spec(env))), "env_kwargs": kwargs, "recipe": RECIPE, "env_version": env_version(env), "test": True}
    (root / "report.json").write_text(json.dumps(report))
    return root / "teacher"


@pytest.mark.parametrize("loss", ["xtok_k1", "xtok_full"])
def test_run_sql_db_with_builtin_cross_teacher(tiny_home, tmp_path, loss):
    add_cross_teacher(tiny_home)
    run = tmp_path / loss
    env = {**os.environ, "AGENTOPD_HOME": str(tiny_home)}
    cmd = [sys.executable, "-m", "agentopd.cli", "run", "--env", "sql_db", "--run-dir", str(run), "teacher=builtin:cross",
           f"trainer.loss={loss}", "steps=2", "rollout.tasks_per_step=2", "rollout.n=2", "rollout.max_new_tokens=16",
           "rollout.max_turns=2", "eval.num_tasks=2", "eval.every=0", "run.checkpoint_every=0", "trainer.lr=1e-3"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "xtok/aligned_share" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["xtok/aligned_share"] == 1.0 and 0 < r["xtok/one_to_one_share"] < 1.0
        assert "xtok/kl_turn/0" in r and r["xtok/spans_per_token"] < 1.0
        if loss == "xtok_full":  # span starts trained, the 1:1 ones with the mapped KL
            assert 0 < r["xtok/mapped_share"] <= r["xtok/start_share"] == pytest.approx(r["xtok/spans_per_token"], abs=1e-6)
            assert r["train/distill_loss"] > 0


@pytest.mark.parametrize("overrides", [("run.objective=sft",), ("recipe.sft_steps=1", "trainer.loss=xtok_k1")])
def test_sft_on_a_teacher_of_another_tokenizer(tiny_home, tmp_path, overrides):
    """SFT across tokenizers (issue 51's cross-tokenizer baseline): the teacher plays with its own tokenizer and
    template, the student trains on each episode re-rendered in its own (agentopd.crosstok.retokenize). Refused
    before this (the pair check: another vocabulary); the store holds the student's tokens, the teacher's text."""
    import sqlite3

    from transformers import AutoTokenizer

    add_cross_teacher(tiny_home)
    run = tmp_path / "run"
    env = {**os.environ, "AGENTOPD_HOME": str(tiny_home)}
    cmd = [sys.executable, "-m", "agentopd.cli", "run", "--env", "sql_db", "--run-dir", str(run), "teacher=builtin:cross",
           *overrides, "steps=2", "rollout.tasks_per_step=2", "rollout.n=1", "rollout.max_new_tokens=16", "rollout.max_turns=2",
           "eval.num_tasks=2", "eval.every=0", "eval.teacher=false", "run.checkpoint_every=0", "trainer.lr=1e-3",
           "teacher.selftest=false"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "another tokenizer; it plays with its own" in done.stdout + done.stderr
    student_tok = AutoTokenizer.from_pretrained(run / "tokenizer")
    db = sqlite3.connect(run / "trajectories.db")
    rows = db.execute("select step, token_ids, response_mask, turns, info from episodes where split='train' order by step").fetchall()
    sft_steps = [r for r in rows if "retokenized" in json.loads(r[4])]
    assert len(sft_steps) == 2 * (2 if overrides[0] == "run.objective=sft" else 1)
    for _, ids, mask, turns, _ in sft_steps:
        ids, mask = json.loads(ids), json.loads(mask)
        assert max(ids) < len(student_tok)
        text = student_tok.decode(ids)
        for turn in json.loads(turns):  # each of the teacher's turns, as it sampled it, in the student's tokens
            assert turn["raw_text"] in text
    records = [r for line in (run / "metrics.jsonl").read_text().splitlines() if "loss" in (r := json.loads(line))]
    assert len(records) == 2 and all(r["loss"] > 0 for r in records)


def test_check_pair_cross(tiny_home, monkeypatch):
    from agentopd.checker import Status
    from agentopd.crosstok.pair import check_cross_pair

    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))
    teacher = add_cross_teacher(tiny_home)
    student = tiny_home / "models" / "sql_db" / "student"
    report = check_cross_pair(student, teacher, "sql_db")
    by = {c.name: c for c in report.checks}
    assert report.ok and all(c.status is Status.PASS for c in report.checks), report.checks
    assert "different tokenizers" in by["vocabulary"].detail and "shared vocabulary" in by["vocabulary"].detail
    assert "aligned 100.0%" in by["alignment"].detail and "1:1 100.0%" not in by["alignment"].detail
    assert "max |span k1|" in by["self_score"].detail
    # the same-tokenizer check refuses this pair; a cross-tokenizer run accepts it (test_run_sql_db_with_builtin_cross_teacher)
    from agentopd.pair import check_pair

    assert not check_pair(student, teacher, "sql_db", self_score=False).ok


def test_qwen3_student_qwen35_teacher_random_weights(qwen3_dir, qwen35_dir, tmp_path):
    """Real vocabularies: a Qwen3-vocab episode scored by a random Qwen3.5-vocab teacher (248,320 rows) through the
    cross-tokenizer path (the issue's real-vocabulary pair, on CPU with a 1-layer model: the path runs)."""
    import time

    from _tiny import real_vocab_model
    from transformers import AutoTokenizer

    from agentopd.teacher import HFTeacher, TeacherMode

    s_tok, t_tok = AutoTokenizer.from_pretrained(qwen3_dir), AutoTokenizer.from_pretrained(qwen35_dir)
    real_vocab_model(rows=248_320).save_pretrained(tmp_path / "t")
    t_tok.save_pretrained(tmp_path / "t")
    ep = _episode(s_tok, TURNS, [True, True])
    t0 = time.perf_counter()
    al = align_episode(ep, s_tok, t_tok)
    teacher = HFTeacher(tmp_path / "t", device="cpu", dtype=torch.float32, offload_after_score=False, top_k=4)
    (sc,) = teacher.score([al.teacher_stream], mode=TeacherMode.TOPK)
    from agentopd.crosstok import token_bytes
    from agentopd.losses.crosstok import vocab_map

    map_w, share = vocab_map(token_bytes(s_tok), token_bytes(t_tok))
    xs = project(al, ep.tokens, sc, map_w)
    assert al.shares()["aligned"] == 1.0 and 0.5 < share < 0.7  # Qwen3's 151k of Qwen3.5's 248k spellings
    assert all(x != 0.0 for x, m in zip(xs.train.logprobs, ep.tokens.response_mask) if m)
    starts = [row for row in xs.train.topk_ids if row[0] != -2]
    assert len(starts) == al.num_spans and any(i >= 0 for row in starts for i in row)
    print(f"qwen3 -> qwen3.5 random teacher: {al.num_spans} spans, vocab share {share:.3f}, {time.perf_counter() - t0:.2f} s")


def test_server_teacher_of_another_tokenizer(tiny_home, tmp_path):
    """teacher=<a vLLM server> with teacher.tokenizer and trainer.loss=xtok_k1: the run re-renders each episode in the
    teacher's tokenizer and the server scores those ids. The server is the FAKE of vLLM's /v1/completions from
    test_server_teacher (no vLLM server runs in the main suite), over real HTTP, serving the builtin:cross teacher;
    the scores it gives equal the local teacher's on the same first step (same seed: the same episodes)."""
    import sqlite3

    from test_server_teacher import fake_vllm, serving
    from transformers import AutoModelForCausalLM

    teacher_dir = add_cross_teacher(tiny_home)
    env = {**os.environ, "AGENTOPD_HOME": str(tiny_home)}
    common = ["steps=1", "rollout.tasks_per_step=2", "rollout.n=2", "rollout.max_new_tokens=16", "rollout.max_turns=2",
              "eval.num_tasks=2", "eval.every=0", "eval.teacher=false", "run.checkpoint_every=0", "trainer.loss=xtok_k1",
              "rollout.temperature=1.0"]  # a server scores at temperature 1
    with serving(fake_vllm(AutoModelForCausalLM.from_pretrained(teacher_dir).eval())) as url:
        scored = {}
        for name, teacher in [("server", [f"teacher={url}", f"teacher.tokenizer={teacher_dir}"]),
                              ("local", ["teacher=builtin:cross"])]:
            cmd = [sys.executable, "-m", "agentopd.cli", "run", "--env", "sql_db", "--run-dir", str(tmp_path / name),
                   *common, *teacher]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            db = sqlite3.connect(tmp_path / name / "trajectories.db")
            scored[name] = dict(db.execute("select id, teacher_logprobs from episodes where split='train'").fetchall())
    assert scored["server"].keys() == scored["local"].keys() and len(scored["local"]) == 4
    for eid, local in scored["local"].items():
        assert json.loads(scored["server"][eid]) == pytest.approx(json.loads(local), abs=1e-4)


def test_a_server_teacher_needs_its_tokenizer_for_a_cross_loss():
    from agentopd.config import load_config

    with pytest.raises(ValueError, match="teacher.tokenizer"):
        load_config("sql_db", overrides=["trainer.loss=xtok_k1", "teacher=http://localhost:8000", "eval.teacher=false",
                                         "rollout.temperature=1.0"])
    cfg = load_config("sql_db", overrides=["trainer.loss=xtok_k1", "teacher=http://localhost:8000", "eval.teacher=false",
                                           "rollout.temperature=1.0", "teacher.tokenizer=some/folder"])
    assert cfg.teacher.tokenizer == "some/folder"
