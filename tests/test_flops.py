"""Compute accounting (agentopd.flops): the arithmetic against a hand count on a tiny config, then the `flops/*`
metrics of a short run recomputed from its stored episodes."""

import json
import sqlite3
from pathlib import Path

import pytest

from agentopd.flops import ModelShape
from _tiny import tiny_config, tiny_model

SHORT = [
    "rollout.tasks_per_step=4", "rollout.n=1", "rollout.max_new_tokens=24", "rollout.max_turns=3",
    "eval.num_tasks=2", "eval.every=0", "run.checkpoint_every=0", "trainer.lr=1e-3",
    "teacher.selftest_oracle=false",  # the tiny_home teachers are random: no better than the student on the oracle (conftest)
]  # fmt: skip


def _hand_count() -> int:
    # tiny_config: vocab 128, hidden 32, intermediate 64, 2 layers, 4 heads x 8, 2 KV heads, no biases
    q, kv, o = 32 * 32, 2 * (32 * 16), 32 * 32
    mlp = 3 * 32 * 64
    norms = 8 + 8 + 32 + 32  # q_norm, k_norm, the two layer norms
    layers = 2 * (q + kv + o + mlp + norms)
    return layers + 32 + 128 * 32  # final norm, the head's V x H (the input embedding left out)


@pytest.mark.parametrize("tie", [True, False])
def test_shape_matches_a_hand_count(tie):
    model = tiny_model(tie=tie)
    shape = ModelShape.of_model(model)
    assert (shape.compute_params, shape.layers, shape.q) == (_hand_count(), 2, 32)
    assert ModelShape.from_hf_config(tiny_config(tie=tie).to_dict()) == shape
    # the one parameter count (agentopd.shape) is the loaded model's: every parameter, a tied head once
    assert shape.params == sum(p.numel() for p in model.parameters())


def test_forward_counts_matmuls_and_causal_attention():
    shape = ModelShape(layers=2, hidden=4, heads=2, kv_heads=1, head_dim=4, intermediate=4, vocab=8, tied=True)
    n = shape.compute_params
    # T = 3: 2*N*3 weights; attention 4*2*8*(1+2+3)
    assert shape.forward(3) == 2 * n * 3 + 4 * 2 * 8 * 6
    assert shape.forward(3, start=1) == 2 * n * 2 + 4 * 2 * 8 * 5  # positions 1, 2 after a cached prefix
    assert shape.forward(3, start=1) + shape.forward(1) == shape.forward(3)
    assert shape.train(3) == 3 * shape.forward(3)
    assert shape.forward(0) == 0


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def test_run_logs_flops_that_the_episodes_account_for(cli, tmp_path, tiny_home):
    """recipe.teacher_fraction=0.5: half the episodes the teacher plays (generate), every episode it scores."""
    run = tmp_path / "run"
    result = cli("run", "--env", "calculator", "--run-dir", run, "steps=2", "recipe.teacher_fraction=0.5",
                 "eval.teacher=true", *SHORT)  # fmt: skip
    assert result.exit_code == 0, result.output
    models = tiny_home / "models" / "calculator"
    student, teacher = ModelShape.from_ref(models / "student"), ModelShape.from_ref(models / "teacher")
    db = sqlite3.connect(run / "trajectories.db")
    records = _records(run)
    cum = {"teacher": 0.0, "student": 0.0}
    for r in records:
        rows = db.execute("select token_ids, info from episodes where split='train' and step=?", (r["step"],)).fetchall()
        lengths = [(len(json.loads(ids)), json.loads(info or "{}").get("played_by") == "teacher") for ids, info in rows]
        assert r["flops/teacher_score"] == pytest.approx(sum(teacher.forward(n) for n, _ in lengths))
        assert r["flops/teacher_generate"] == pytest.approx(sum(teacher.forward(n) for n, t in lengths if t))
        assert r["flops/student_rollout"] == pytest.approx(sum(student.forward(n) for n, t in lengths if not t))
        assert r["flops/student_train"] == pytest.approx(sum(3 * student.forward(n) for n, _ in lengths))
        for who in cum:
            cum[who] += r[f"flops/{who}"]
            assert r[f"flops/{who}_cum"] == pytest.approx(cum[who])
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and first["flops/eval_teacher"] > 0 and first["flops/eval_student"] > 0
