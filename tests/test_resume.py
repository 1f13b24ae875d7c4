"""Resume and interruption (issue 12's defects 1, 4, 7) and a teacher/student pair that differs by
padding rows (defect 3), each through the real runner on the tiny built-in models (conftest
`tiny_home`: made in a second, not trained).

- A run continued after its last finished checkpoint plays, token for token, the episodes an
  uninterrupted run plays (sampling seeds derive from run seed, step, slot and turn; the engine's
  private seed stream is not involved), and TensorBoard keeps each step once.
- A second Ctrl-C that lands after a step's optimizer update checkpoints *that* step: its update
  is in the weights and must not be replayed.
"""

import json
import sqlite3

import pytest
from typer.testing import CliRunner

from agentopd.cli import app

SHORT = [
    "rollout.tasks_per_step=3", "rollout.n=2", "rollout.max_new_tokens=24", "rollout.max_turns=3", "rollout.temperature=1.0",
    "eval.num_tasks=2", "eval.every=0", "eval.teacher=false", "trainer.lr=1e-2", "trainer.schedule=constant",
    "trainer.warmup_steps=0", "run.checkpoint_every=2",
    "teacher.selftest_oracle=false",  # the tiny_home teachers are random: no better than the student on the oracle (conftest)
]  # fmt: skip


def _train_tokens(run) -> dict[str, str]:
    db = sqlite3.connect(run / "trajectories.db")
    return dict(db.execute("select id, token_ids from episodes where split='train' order by id"))


def _tb_steps(run, tag="loss") -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


@pytest.fixture(scope="module")
def two_runs(tiny_home, tmp_path_factory):
    """An uninterrupted 4-step run, and one killed after logging step 3 but before its checkpoint
    finished (its DONE marker removed), then continued with --resume: step 3 is played and logged again."""
    tmp = tmp_path_factory.mktemp("resume")
    straight, resumed = tmp / "straight", tmp / "resumed"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENTOPD_HOME", str(tiny_home))
        runner = CliRunner()
        cli = lambda *args: runner.invoke(app, [str(a) for a in args], catch_exceptions=False)  # noqa: E731
        assert cli("run", "--env", "sql_db", "--run-dir", straight, *SHORT, "steps=4").exit_code == 0
        assert cli("run", "--env", "sql_db", "--run-dir", resumed, *SHORT, "steps=3").exit_code == 0
        (resumed / "checkpoints" / "step_000003" / "DONE").unlink()
        result = cli("run", "--env", "sql_db", "--run-dir", resumed, "--resume", "steps=4")
    assert result.exit_code == 0, result.output
    assert "continuing at step 3" in result.output
    return straight, resumed


def test_resumed_run_plays_the_uninterrupted_runs_episodes_token_for_token(two_runs):
    """Defect 4: the engine's private seed stream restarted on resume, so steps 3-4 sampled differently."""
    a, b = (_train_tokens(run) for run in two_runs)
    assert sorted(a) == sorted(b) and len(a) == 4 * 3 * 2
    differ = [i for i in a if a[i] != b[i]]
    assert not differ, f"episodes not token-identical after resume: {differ}"


def test_resumed_run_logs_each_step_once_in_tensorboard_and_metrics(two_runs):
    """Defect 7: metrics.jsonl was truncated on resume, tb/ kept the replayed step twice."""
    _, resumed = two_runs
    assert _tb_steps(resumed) == [1, 2, 3, 4]
    records = [json.loads(x) for x in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]


def test_resumed_run_continues_the_cumulative_flops(two_runs):
    """flops/*_cum of a resumed run are read back from the steps its metrics.jsonl kept (agentopd.flops)."""
    straight, resumed = ([json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x] for run in two_runs)
    for key in ("flops/student_cum", "flops/teacher_cum"):
        assert [r[key] for r in resumed] == pytest.approx([r[key] for r in straight])


def test_second_ctrl_c_after_the_update_checkpoints_that_step(tiny_home, tmp_path, monkeypatch):
    """Ctrl-C twice, the second landing while step 2's new weights go to the engine (after its
    optimizer step): the checkpoint is step 2's, holding 2 trainer steps, and resume goes on at 3."""
    from agentopd.backends.local import LocalBackend
    from agentopd.config import load_config
    from agentopd.runner import Runner

    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))
    calls = {"n": 0}
    sync = LocalBackend.sync_weights

    def interrupted_sync(self):
        calls["n"] += 1
        if calls["n"] == 2:  # after step 2's train_step
            raise KeyboardInterrupt
        sync(self)

    monkeypatch.setattr(LocalBackend, "sync_weights", interrupted_sync)
    cfg = load_config("sql_db", overrides=[*SHORT, "steps=4", "run.checkpoint_every=0"])
    summary = Runner(cfg, tmp_path / "run").run()
    assert summary.interrupted
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*") if (p / "DONE").exists())
    assert ckpts == ["step_000002"]
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_000002" / "meta.json").read_text())
    assert meta["step"] == meta["extra"]["step"] == 2  # the label is the trainer's own step count
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]  # the interrupted step's metrics are kept

    monkeypatch.setattr(LocalBackend, "sync_weights", sync)
    cfg = load_config("sql_db", config_file=tmp_path / "run" / "config.yaml")
    Runner(cfg, tmp_path / "run").run(resume=True)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]


def test_padded_vocabulary_pair_trains_with_a_full_vocabulary_loss(cli, tiny_home, tmp_path):
    """Teacher and student whose vocabularies differ only by padding rows (as Qwen's 151,936 vs
    152,064): check_compatible accepts them, and the full-vocabulary loss compares the shared rows."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tiny_home / "models" / "sql_db" / "teacher"
    teacher = AutoModelForCausalLM.from_pretrained(src)
    rows = teacher.config.vocab_size
    teacher.resize_token_embeddings(rows + 64, mean_resizing=False)  # 64 padding rows
    with torch.no_grad():
        teacher.get_output_embeddings().weight[rows:].normal_()
    teacher.save_pretrained(tmp_path / "teacher")
    AutoTokenizer.from_pretrained(src).save_pretrained(tmp_path / "teacher")
    student = tiny_home / "models" / "sql_db" / "student"
    for loss in ("forward_kl", "jsd"):
        run = tmp_path / f"run-{loss}"
        result = cli("run", "--env", "sql_db", "--run-dir", run, *SHORT, "steps=1", f"trainer.loss={loss}",
                     f"student={student}", f"teacher={tmp_path / 'teacher'}")  # fmt: skip
        assert result.exit_code == 0, result.output
        record = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x][-1]
        assert record["loss"] > 0 and record["grad_norm"] > 0
