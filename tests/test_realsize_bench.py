"""benchmarks/realsize.py at toy sizes on the CPU (the real size needs a GPU: gpu_check.py's realsize part): the run
as the README's GPU example writes it, its last step's figures, the checkpoint against the disk plan's figure, and the
profiler's per-phase tables of that step; gpu_check's realsize rows gate the phase seconds, not the checkpoint's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


@pytest.mark.slow
def test_realsize_at_toy_sizes_reports_the_last_steps_phases_and_profiles_them(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "benchmarks/realsize.py", "--tiny", "--profile", "--out", str(out), "--work",
                           str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads((out / "realsize.json").read_text())
    for name in ("rollout_s", "teacher_s", "train_s", "weight_sync_s", "step_s", "rollout_tok_s", "checkpoint_s"):
        assert figures[f"realsize/{name}"] > 0, name
    parts = ("rollout_s", "teacher_s", "train_s", "weight_sync_s")
    assert abs(figures["realsize/step_s"] - sum(figures[f"realsize/{p}"] for p in parts)) < 1e-9
    report = (out / "realsize.md").read_text()
    assert "| 2 |" in report and "checkpoint of step 2:" in report and "the disk plan's figure" in report
    for phase in ("rollout", "teacher", "train"):
        assert (out / f"profile_{phase}.txt").read_text().startswith(f"{phase} phase of step 2:")
    assert not (tmp_path / "work" / "realsize_run").exists()  # its checkpoint and final/ removed (--keep-run keeps them)


@pytest.mark.slow
def test_realsize_against_another_tree_runs_its_example_and_compares_each_phase(tmp_path):
    """--against: the other tree's own `agentopd run` of its example (here this tree, labelled apart; on a CPU after
    this run, on a second GPU beside it: two named here, where the toy runs use the CPU, so the two processes run side
    by side as on a GPU machine), its steps and each phase's mean against this run's; a tree that refuses a key makes
    the report say so and the script exit 1."""
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, "benchmarks/realsize.py", "--tiny", "--steps", "2", "--out", str(out), "--work", str(work),
           "--against", str(ROOT), "--against-commit", "before"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, CUDA_VISIBLE_DEVICES="0,1"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = (out / "realsize.md").read_text()
    halves = sorted(os.sched_getaffinity(0))
    theirs = halves[len(halves) // 2:] if len(halves) > 1 else halves  # each run on half of the cores
    assert f"## against before ({ROOT}, beside this run, on GPU 1, cores {theirs[0]}" in report, report
    assert "teacher.selftest=false" in report and f"this run on GPU 0, cores {halves[0]}" in done.stdout, report
    section = report.split("## against before", 1)[1]
    assert "| 2 |" in section and "| phase | before s | this run s | this / before |" in section, report
    assert [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| ") and " | " in line][-5:] == [
        "| rollout", "| teacher", "| train", "| weight_sync", "| step"], report
    assert json.loads((out / "against.json").read_text())["realsize/step_s"] > 0
    assert (out / "against_metrics.jsonl").exists() and not (work / "against_run").exists()
    refused = subprocess.run([*cmd[:-2], "--against-commit", "old", "--against-keys", "teacher.no_such_key=1"], cwd=ROOT,
                             capture_output=True, text=True, timeout=600, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))  # fmt: skip
    assert refused.returncode == 1 and "its run: exit 2, 0 steps logged: " in refused.stdout, refused.stdout[-2000:]
    assert "unknown key teacher.no_such_key" in refused.stdout and "## against old" in refused.stdout
    assert f"({ROOT}, after this run)" in refused.stdout  # no GPU named: after this run
    stopped = subprocess.run([*cmd, "--against-timeout", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))  # its imports alone take longer
    assert stopped.returncode == 1 and "its run: stopped at --against-timeout 1 s, 0 steps logged" in stopped.stdout


def test_visible_gpus_are_what_cuda_visible_devices_names(monkeypatch):
    import realsize

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert realsize.visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert realsize.visible_gpus() == []


def test_realsize_figures_are_gated_but_the_checkpoints_seconds_are_the_hosts_disk():
    new = gpu_check.recorded({"realsize/train_s": 33.0, "realsize/checkpoint_s": 40.0}, {}, "H200", "abc1234")
    assert new["realsize/train_s"]["H200"]["gate"] and new["realsize/train_s"]["H200"]["better"] == "lower"
    assert not new["realsize/checkpoint_s"]["H200"]["gate"]
    assert "realsize" in gpu_check.PARTS and gpu_check.PARTS[-1] == "tests"


def test_overlap_steps_turn_the_scoring_beside_the_rollout_on_at_those_steps_alone(tmp_path):
    """--overlap-steps: teacher.overlap at the steps named, the plain scoring after the rollout at the others (one run
    measures both); refused without teacher.overlap=true."""
    out = tmp_path / "out"
    cmd = [sys.executable, "benchmarks/realsize.py", "--tiny", "--out", str(out), "--work", str(tmp_path / "work"),
           "--steps", "2", "--overlap-steps", "2"]  # fmt: skip
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "--overlap-steps needs teacher.overlap=true" in refused.stderr
    done = subprocess.run([*cmd, "teacher.overlap=true", "teacher.overlap_min_tokens=1"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in steps if "perf/train_step_s" in r}
    assert "teacher/overlap_s" not in steps[1] and "teacher/overlap_s" in steps[2]
    assert "teacher.overlap:" in (out / "realsize.md").read_text()


@pytest.mark.slow
def test_small_batch_at_toy_sizes_runs_each_arm_in_each_tree_and_profiles_the_defaults(tmp_path):
    """benchmarks/small_batch.py --tiny: the defaults arm and a hand-set arm, each in this tree and in an --against tree
    (here the same tree, labelled apart), their table rows, and the defaults' last train phase under the profiler."""
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "benchmarks/small_batch.py", "--tiny", "--steps", "2", "--profile", "--out",
                           str(out), "--work", str(tmp_path / "work"), "--arms", "trainer.micro_batch_tokens=4096",
                           "--against", str(ROOT), "--against-commit", "before"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = (out / "small_batch.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith(("| defaults@", "| arm1@"))]
    assert [r.split(" | ")[0] for r in rows][0] == "| defaults@before" and len(rows) == 4, report
    assert all("failed" not in r for r in rows) and "`trainer.micro_batch_tokens=4096`" in rows[-1]
    assert (out / "profile_train.txt").read_text().startswith("train phase of step 2:")
