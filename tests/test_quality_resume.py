"""benchmarks/quality.py's runs survive the end of a GPU call: `stop_runs()` stops a run as Ctrl-C does (it finishes its
step and checkpoints it), and the next `launch` of the same spec continues it from that checkpoint to the same
result file: every step trained once, the eval points all there, the seconds of both parts added up."""

import json
import threading
import time
from argparse import Namespace
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

import pytest
from _faults import loss_steps

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "quality.py"


def _steps(run_dir: Path) -> list[int]:
    return loss_steps(run_dir) if (run_dir / "metrics.jsonl").exists() else []


@pytest.mark.slow
def test_a_stopped_run_continues_from_its_checkpoint(tiny_home, tmp_path, monkeypatch):
    spec_ = spec_from_file_location("quality", SCRIPT)
    quality = module_from_spec(spec_)
    spec_.loader.exec_module(quality)
    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))  # the workers' built-in models
    args = Namespace(env=["sql_db"], methods=["opd"], seeds=1, steps=120, eval_every=40, intervene_below=-1.0,
                     support_below=0.3, privileged="solution", work=tmp_path,
                     overrides=["rollout.tasks_per_step=2", "rollout.max_new_tokens=16", "rollout.max_turns=2",
                                "eval.num_tasks=2", "run.device=cpu",
                                    "teacher.selftest_oracle=false"])  # fmt: skip  # tiny_home's teacher is random
    (spec,) = quality.plan_runs(args)
    run_dir = Path(spec["run_dir"])
    first: list = []
    worker = threading.Thread(target=lambda: first.append(quality.launch(spec)))
    worker.start()
    deadline = time.monotonic() + 240
    while len(_steps(run_dir)) < 3 and time.monotonic() < deadline and worker.is_alive():
        time.sleep(0.5)
    quality.stop_runs()
    worker.join(timeout=240)
    assert first == [None], "the run finished before it was stopped"
    stopped_at = len(loss_steps(run_dir))
    assert 3 <= stopped_at < 120 and (run_dir / "checkpoints" / f"step_{stopped_at:06d}" / "DONE").exists()
    assert not Path(spec["result"]).exists()
    first_part = float((run_dir / quality.SECONDS).read_text())

    quality._stopping.clear()  # a new call
    result = quality.launch(spec)
    assert result is not None and json.loads(Path(spec["result"]).read_text()) == result
    assert loss_steps(run_dir) == list(range(1, 121))  # each step trained and logged once
    assert [p["step"] for p in result["curve"]] == [0, 40, 80, 120]
    assert "resumed from" in Path(spec["run_dir"] + ".log").read_text()
    assert result["seconds"] > first_part > 0  # both parts' seconds


def test_a_failed_run_prints_the_end_of_its_log(tmp_path, capsys):
    """A GPU call returns only what it printed and its $OUT: the log of a failed run stays on the machine, so the
    failure's reason has to be in the printout."""
    spec_ = spec_from_file_location("quality", SCRIPT)
    quality = module_from_spec(spec_)
    spec_.loader.exec_module(quality)
    args = Namespace(env=["sql_db"], methods=["opd"], seeds=1, steps=2, eval_every=1, intervene_below=-1.0,
                     support_below=0.3, privileged="solution", work=tmp_path,
                     overrides=[f"student={tmp_path / 'no_such_model'}"])  # fmt: skip
    (spec,) = quality.plan_runs(args)
    assert quality.launch(spec) is None
    printed = capsys.readouterr().out
    assert "FAILED" in printed and "no_such_model" in printed.split("its last lines:")[-1]  # the worker's own error, not only the log's path
