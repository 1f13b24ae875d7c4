"""Disk in the plan and safe checkpoint writes (issue 52): the disk plan's checkpoint size against what a checkpoint
really writes; a run whose checkpoints cannot fit its disk refused before any model loads (a small fake budget,
`run.disk_gib`); a checkpoint write that fails (a real ENOSPC from the kernel: the checkpoint's data file made a link
to /dev/full) said in one line, its partial files removed, the last good checkpoint kept and resumed from; a write
killed mid-way (SIGKILL) leaves nothing a resume takes; run.keep_checkpoints removes the older finished ones."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agentopd.disk_plan import checkpoint_bytes, checkpoint_counts, checkpoint_steps, export_bytes
from agentopd.rundir import RunDir, write_checkpoint
from agentopd.shape import ModelShape

SHORT = [
    "rollout.tasks_per_step=2", "rollout.n=2", "rollout.max_new_tokens=16", "rollout.max_turns=2", "eval.num_tasks=2",
    "eval.every=0", "eval.teacher=false", "trainer.warmup_steps=0",
    "teacher.selftest_oracle=false",  # the tiny_home teachers are random: no better than the student on the oracle (conftest)
]  # fmt: skip


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


@pytest.mark.parametrize("tied", [True, False])
def test_checkpoint_bytes_are_what_a_checkpoint_writes(tmp_path, tied):
    """The plan's size of a checkpoint (fp32 weights, a tied table twice, AdamW's two moments, DCP's records) and of
    final/'s weights, against the files a trained student really writes."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from agentopd.batch import TrainSample
    from agentopd.trainer import Trainer, TrainerConfig

    cfg = Qwen3Config(vocab_size=3000, hidden_size=128, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, tie_word_embeddings=tied)  # fmt: skip
    trainer = Trainer(Qwen3ForCausalLM(cfg), TrainerConfig(loss="sft", lr=1e-3))
    trainer.train_step([TrainSample(token_ids=list(range(1, 41)), prompt_len=8, response_mask=[1] * 32, old_logprobs=[0.0] * 32)])
    path = tmp_path / "checkpoints" / "step_000001"
    write_checkpoint(path, 1, lambda tmp: trainer.save_checkpoint(tmp, extra={"step": 1}))
    trainer.export(tmp_path / "final")
    shape = ModelShape.of_model(trainer.hf)
    assert shape.params == sum(p.numel() for p in trainer.hf.parameters())
    assert _bytes(path) == pytest.approx(checkpoint_bytes(shape), rel=0.01)
    weights = (tmp_path / "final" / "model.safetensors").stat().st_size
    assert weights == pytest.approx(export_bytes(shape) - 32 * 2**20, rel=0.01)


def test_checkpoints_counted_at_the_peak():
    assert checkpoint_steps(200, 20) == list(range(20, 201, 20))
    assert checkpoint_steps(3, 20) == [3] and checkpoint_steps(5, 2) == [2, 4, 5] and checkpoint_steps(6, 2, start=4) == [6]
    assert checkpoint_counts(10, keep=0) == (10, 10)  # all kept
    assert checkpoint_counts(10, keep=2) == (3, 2)  # the new one complete beside the two kept, then the oldest goes
    assert checkpoint_counts(10, keep=1) == (2, 1)
    assert checkpoint_counts(1, keep=2) == (1, 1)
    assert checkpoint_counts(5, keep=2, existing=2) == (1, 0)  # a resumed run: its two are there already


def test_run_whose_checkpoints_do_not_fit_its_disk_is_refused_before_any_model_loads(cli, tmp_path):
    run = tmp_path / "run"
    result = cli("run", "--env", "sql_db", "--run-dir", run, *SHORT, "steps=4", "run.checkpoint_every=1", "run.disk_gib=0.0001")
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert "this run's checkpoints do not fit its disk" in line and "4 checkpoint(s)" in line, result.output
    assert "run.disk_gib allows 0.1 MiB: short by" in line and "run.keep_checkpoints=1" in line, result.output
    assert not run.exists()  # refused at validation: no run directory
    result = cli("plan-memory", "--env", "sql_db", "steps=4", "run.checkpoint_every=1", "run.disk_gib=0.0001")
    assert result.exit_code == 2 and "disk: " in result.output and "DOES NOT FIT" in result.output, result.output
    result = cli("plan-memory", "--env", "sql_db", "steps=4", "run.checkpoint_every=1", "run.keep_checkpoints=1", "run.disk_gib=1")
    assert result.exit_code == 0 and "(2 of 4 checkpoint(s) of" in result.output and ": fits" in result.output, result.output


def _plan(writes: int, keep: int, existing: int = 0, budget: bool = False):
    from agentopd.disk_plan import DiskPlan

    return DiskPlan(folder=Path("/ckpt"), free_gib=18.5, budget=budget, checkpoint_gib=20.4, writes=writes, keep=keep,
                    export_gib=0.0, existing=existing)


def test_a_refusal_offers_only_what_lowers_the_peak():
    """A 1.7B resume on an H200's 64 GiB disk (2026-12-01) was refused as it should be, one checkpoint of 20.4 GiB
    against 18.5 free, and told to set run.keep_checkpoints=1, which writes that same checkpoint: a refusal names the
    keys that lower its peak, and for a resume (which reads its run directory) room on that disk or the directory moved."""
    resume = _plan(writes=1, keep=2, existing=1)
    assert resume.remedies() == ("make room under /ckpt (the run's older checkpoints can go) or move the run directory "
                                 "whole to a larger disk and --resume it there")  # fmt: skip
    many = _plan(writes=10, keep=0).remedies()  # all kept: either key lowers the peak
    assert many.startswith("change run.keep_checkpoints=1") and "run.checkpoint_every" in many
    assert many.endswith("--run-dir on a larger disk")
    kept_two = _plan(writes=10, keep=2).remedies()
    assert "run.keep_checkpoints=1" in kept_two and "run.checkpoint_every" in kept_two
    assert _plan(writes=10, keep=1).remedies() == "change run.checkpoint_every (fewer checkpoints), --run-dir on a larger disk"
    assert _plan(writes=1, keep=2).remedies() == "change --run-dir on a larger disk"
    budgeted = _plan(writes=3, keep=2, budget=True).remedies()
    assert budgeted.startswith("change run.keep_checkpoints=1") and "run.disk_gib (the space the run may fill), --run-dir" in budgeted
    resumed = _plan(writes=3, keep=2, existing=2, budget=True).remedies()  # the kept two there: one more at the peak either way
    assert resumed.startswith("change run.disk_gib (the space the run may fill), or make room under /ckpt")


def test_a_resume_whose_checkpoint_cannot_fit_is_refused_before_its_models_load(cli, tmp_path):
    run = tmp_path / "run"
    assert cli("run", "--env", "sql_db", "--run-dir", run, *SHORT, "steps=1").exit_code == 0
    result = cli("run", "--env", "sql_db", "--run-dir", run, "--resume", "run.steps=2", "run.disk_gib=0.0001")
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert "this run's checkpoints do not fit its disk" in line and "(1 checkpoint(s) of" in line, result.output
    assert "run.keep_checkpoints" not in line and "or move the run directory whole to a larger disk and --resume it there" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001"]  # refused: nothing lost


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_checkpoint_the_disk_refuses_is_one_line_and_the_last_good_one_resumes(cli, tmp_path, monkeypatch):
    """Step 4's checkpoint meets a full disk (its DCP data file links to /dev/full: every write to it fails with the
    kernel's ENOSPC, as a disk that filled does): one line, exit 1, nothing of step 4 on disk, step 2 resumes."""
    from agentopd.trainer import Trainer

    save = Trainer.save_checkpoint

    def onto_a_full_disk(self, directory, extra=None):
        if extra["step"] == 4:
            (Path(directory) / "dcp").mkdir(parents=True)
            os.symlink("/dev/full", Path(directory) / "dcp" / "__0_0.distcp")
        save(self, directory, extra)

    monkeypatch.setattr(Trainer, "save_checkpoint", onto_a_full_disk)
    run = tmp_path / "run"
    result = cli("run", "--env", "sql_db", "--run-dir", run, *SHORT, "steps=4", "run.checkpoint_every=2")
    assert result.exit_code == 1, result.output
    errors = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert errors[0].startswith("error: checkpoint of step 4 not written: No space left on device"), result.output
    assert "nothing of it was kept, the last good checkpoint is step_000002 (--resume continues from it)" in errors[0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]
    monkeypatch.setattr(Trainer, "save_checkpoint", save)
    result = cli("run", "--env", "sql_db", "--run-dir", run, "--resume")
    assert result.exit_code == 0 and "continuing at step 3" in result.output, result.output
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert RunDir(run).latest_checkpoint().name == "step_000004"


KILLED = """
import os, signal, sys
from pathlib import Path
from agentopd.rundir import write_checkpoint

def write(tmp):
    (tmp / "dcp").mkdir()
    (tmp / "dcp" / "__0_0.distcp").write_bytes(b"x" * 4096)
    os.kill(os.getpid(), signal.SIGKILL)  # killed mid-write

write_checkpoint(Path(sys.argv[1]), 3, write)
"""


def test_a_write_killed_midway_leaves_nothing_a_resume_takes(tmp_path):
    rd = RunDir(tmp_path / "run")
    write_checkpoint(rd.checkpoint(2), 2, lambda tmp: (tmp / "meta.json").write_text("{}"))
    done = subprocess.run([sys.executable, "-c", KILLED, str(rd.checkpoint(3))], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert rd.latest_checkpoint() == rd.checkpoint(2) and not rd.checkpoint(3).exists()
    left = [p.name for p in rd.checkpoints.iterdir()]
    assert sorted(left) == [".writing-step_000003", "step_000002"]  # hidden: no resume takes it ...
    assert [p.name for p in rd.prune_checkpoints(keep=0)] == [".writing-step_000003"]  # ... and the next write removes it
    assert [p.name for p in rd.checkpoints.iterdir()] == ["step_000002"]


def test_a_finished_checkpoint_moved_aside_by_a_killed_rewrite_comes_back(tmp_path):
    """Killed between moving step 2's finished checkpoint aside and renaming its rewrite in: the next prune puts the
    finished one back under its name and drops the unfinished rewrite."""
    rd = RunDir(tmp_path / "run")
    write_checkpoint(rd.checkpoint(2), 2, lambda tmp: (tmp / "meta.json").write_text('{"step": 2}'))
    os.replace(rd.checkpoint(2), rd.checkpoints / ".replaced-step_000002")
    (rd.checkpoints / ".writing-step_000002").mkdir()
    assert rd.latest_checkpoint() is None
    assert [p.name for p in rd.prune_checkpoints(keep=0)] == [".writing-step_000002"]
    assert rd.latest_checkpoint() == rd.checkpoint(2) and [p.name for p in rd.checkpoints.iterdir()] == ["step_000002"]


def test_a_failed_rewrite_of_a_step_keeps_its_finished_checkpoint(tmp_path):
    rd = RunDir(tmp_path / "run")
    write_checkpoint(rd.checkpoint(2), 2, lambda tmp: (tmp / "meta.json").write_text('{"step": 2}'))

    def fails(tmp):
        (tmp / "meta.json").write_text("partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_checkpoint(rd.checkpoint(2), 2, fails)
    assert [p.name for p in rd.checkpoints.iterdir()] == ["step_000002"]
    assert (rd.checkpoint(2) / "meta.json").read_text() == '{"step": 2}' and rd.latest_checkpoint() == rd.checkpoint(2)
    write_checkpoint(rd.checkpoint(2), 2, lambda tmp: (tmp / "meta.json").write_text('{"step": 2, "again": true}'))
    assert json.loads((rd.checkpoint(2) / "meta.json").read_text())["again"] and len(list(rd.checkpoints.iterdir())) == 1


def test_keep_checkpoints_removes_the_older_finished_ones(cli, tmp_path):
    run = tmp_path / "run"
    result = cli("run", "--env", "sql_db", "--run-dir", run, *SHORT, "steps=4", "run.checkpoint_every=1", "run.keep_checkpoints=2")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000003", "step_000004"]


def test_write_error_finds_the_operating_systems_error_inside_dcps():
    from torch.distributed.checkpoint.api import CheckpointException

    from agentopd.disk_plan import write_error

    full = CheckpointException("save", {0: (OSError(28, "No space left on device"), [])})
    assert write_error(full) == "No space left on device"
    assert write_error(RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")) == (
        "RuntimeError: [enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")
    wrapped = RuntimeError("the rank failed")
    wrapped.__cause__ = CheckpointException("save", {0: (ValueError("bad\ntraceback"), [])})
    assert write_error(wrapped) == "ValueError: bad"
