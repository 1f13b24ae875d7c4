"""benchmarks/scale_gpu.py's whole path on the CPU (`--tiny`: the toy shapes, layout 2gpu as CPU actors of a local
Ray cluster): the plan per GPU, a sync run timed from the end of its first step with a rollout worker killed
mid-step that still logs each step once and stores each training episode once, scored; one markdown and one JSON
hold it all (what a GPU call brings back). One run: a second, fault-free one cost ~40 s of CI for no path of the
script the fault run does not take (a fault-free run: tests/test_ray_backend.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "scale_gpu.py"


@pytest.mark.slow
@pytest.mark.ray
def test_scale_benchmark_runs_sync_and_a_rollout_fault_at_toy_sizes(tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--fault", "rollout", "--out", str(tmp_path),
                           "--timeout", "240"], capture_output=True, text=True, timeout=600, env=env, cwd=SCRIPT.parents[1])  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scale_gpu.json", "scale_gpu.md", "scale_gpu_log.txt"]
    bundle = json.loads((tmp_path / "scale_gpu.json").read_text())
    (fault,) = bundle["runs"]
    assert (fault["mode"], fault["fault"]) == ("sync", "rollout")
    # stopped once step 3 is logged (its checkpoint and export are not measured), or done by then
    assert fault["exit"] in ("stopped after its last step", "0"), fault["exit"]
    assert fault["summary"]["steps"] == 3 and fault["summary"]["episodes_per_s_per_gpu"] > 0
    assert "fits" in fault["plan"]  # planned for the layout's two GPUs
    assert {a["role"] for a in fault["child"]["actors"]} == {"trainer", "rollout", "teacher"}
    assert fault["child"]["fault"]["step"] == 2 and fault["wrong"] == []
    assert fault["records"][-1]["ray/rollout_restarts"] == 1
    report = (tmp_path / "scale_gpu.md").read_text()
    assert "nothing lost or duplicated" in report and "no nvidia-smi here" in report


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--tiny", "--layout", "4gpu"], "--tiny runs the 2gpu layout alone"),
        (["--tiny", "--scaling"], "--tiny runs the 2gpu layout alone"),
        (["--layout", "3gpu", "--tokenizer", "x"], "unknown layout(s) 3gpu; choose among 1gpu, 2gpu, 4gpu, 8gpu, 4gpu-apart, 8gpu-apart"),
    ],
)
def test_a_layout_that_would_not_run_as_asked_is_refused_by_name(tmp_path, argv, says):
    """Before anything is built or started: a --tiny command once ran the 2gpu layout when asked for 4gpu, silently."""
    done = subprocess.run([sys.executable, str(SCRIPT), *argv, "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and says in done.stderr, done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_a_run_is_waited_for_up_to_the_steps_its_config_applies(monkeypatch):
    """A user's run.steps override comes after the benchmark's own: the run plays that many steps, and is not stopped
    as done at the benchmark's count."""
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("scale_gpu", SCRIPT)
    scale_gpu = module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "scale_gpu", scale_gpu)  # its dataclasses look their module up there
    spec.loader.exec_module(scale_gpu)
    assert scale_gpu._steps(["student=s", "run.steps=4", "rollout.n=8", "run.steps=6"]) == 6
    assert scale_gpu._steps(["run.steps=4"]) == 4
