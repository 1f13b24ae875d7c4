"""benchmarks/gpu_check.py's verdicts, on the CPU (the check itself needs a GPU): a figure against its recorded
baseline, and against the same parts run in another commit's tree in the same call (`--against`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_check  # noqa: E402

BASELINE = {
    "opd/rollout_s": {"H100": {"value": 0.705, "better": "lower", "commit": "fce7c5f", "date": "2026-11-27"}},
    "opd/rollout_tok_s": {"H100": {"value": 15183.0, "better": "higher", "commit": "fce7c5f", "date": "2026-11-27"}},
    "opd/weight_sync_s": {"H100": {"value": 0.0104, "better": "lower", "commit": "2af619f", "date": "2026-11-27",
                                   "gate": False}},
}  # fmt: skip


def _row(rows, name):
    (row,) = [r for r in rows if r.startswith(f"| {name} |")]
    return row


def test_a_figure_more_than_ten_percent_worse_than_its_recorded_baseline_fails():
    rows, ok = gpu_check.compare({"opd/rollout_s": 0.856, "opd/rollout_tok_s": 14000.0, "opd/weight_sync_s": 0.02},
                                 BASELINE, "H100")  # fmt: skip
    assert not ok
    assert _row(rows, "opd/rollout_s").endswith("| FAIL |")  # 1.21x the time
    assert _row(rows, "opd/rollout_tok_s").endswith("| ok |")  # 0.92x the rate: within 10%
    assert _row(rows, "opd/weight_sync_s").endswith("| worse (not gated) |")
    rows, ok = gpu_check.compare({"opd/rollout_s": 0.72, "opd/rollout_tok_s": 15000.0, "opd/weight_sync_s": 0.01},
                                 BASELINE, "H100")  # fmt: skip
    assert ok


def test_the_same_call_baseline_judges_a_figure_the_host_moved():
    """The host slows both trees alike: 0.856 s against the recorded 0.705 fails, against the old tree's 0.85 s in
    the same call it holds, and the row keeps the recorded comparison beside it."""
    now = {"opd/rollout_s": 0.856, "opd/rollout_tok_s": 12353.0}
    baseline = {k: v for k, v in BASELINE.items() if k in now}
    rows, ok = gpu_check.compare(now, baseline, "H100", against={"opd/rollout_s": 0.85, "opd/rollout_tok_s": 12400.0},
                                 against_commit="ea9f3b9")  # fmt: skip
    row = _row(rows, "opd/rollout_s")
    assert row.endswith("| ok |") and "same call, ea9f3b9" in row and "recorded 0.705 (fce7c5f): 1.21" in row
    assert "| 0.85 |" in row  # the baseline column holds the same-call figure
    assert ok
    # a real slowdown shows against the same-call baseline too
    rows, ok = gpu_check.compare(now, baseline, "H100", against={"opd/rollout_s": 0.70, "opd/rollout_tok_s": 15100.0},
                                 against_commit="ea9f3b9")  # fmt: skip
    assert not ok and _row(rows, "opd/rollout_s").endswith("| FAIL |")


def test_the_host_bound_parts_run_in_the_default_against_tree_and_the_rest_against_their_records():
    tree = Path("/some/tree")
    assert [p for p in gpu_check.PARTS if gpu_check.runs_against(p, tree, default=True)] == ["engine", "opd", "loop"]
    assert [p for p in gpu_check.PARTS if gpu_check.runs_against(p, tree, default=False)] == [
        "engine", "trainer", "loss", "opd", "loop", "realsize"]  # an explicit --against: every part but the tests
    assert not any(gpu_check.runs_against(p, None, default=True) for p in gpu_check.PARTS)


def test_the_last_passing_commit_is_recorded_by_a_passing_check_and_is_the_default_to_prepare():
    last = {"opd": {"H200": {"commit": "aaa1111", "date": "2026-11-29"}},
            "trainer": {"H200": {"commit": "fff9999", "date": "2026-12-01"}}}  # not host-bound: not the default
    assert gpu_check.last_passing(last) == "aaa1111"
    failed = gpu_check.passed(last, ["opd", "loop", "tests"], "H100", "bbb2222", ok=False)
    assert failed == last
    now = gpu_check.passed(last, ["opd", "loop", "tests"], "H100", "bbb2222", ok=True)
    assert now["opd"]["H100"]["commit"] == now["loop"]["H100"]["commit"] == "bbb2222" and "tests" not in now
    assert now["opd"]["H200"] == last["opd"]["H200"]  # another card's record stays
    now["opd"]["H100"]["date"] = "2026-12-02"
    assert gpu_check.last_passing(now) == "bbb2222"
    with pytest.raises(SystemExit, match="records no passing check of engine, opd or loop"):
        gpu_check.last_passing({"trainer": last["trainer"]})
    recorded = json.loads((Path(gpu_check.BASELINE)).read_text())["last_pass"]
    assert gpu_check.last_passing(recorded)  # the repository's file names one


@pytest.mark.skipif(subprocess.run(["git", "-C", str(gpu_check.ROOT), "rev-parse", "HEAD"], capture_output=True, check=False).returncode,
                    reason="not a git checkout")
def test_prepare_against_writes_a_commits_tree_that_a_later_check_finds(tmp_path):
    dest = tmp_path / "against"
    commit = gpu_check.prepare_against("HEAD", dest)
    assert (dest / "benchmarks" / "gpu_check.py").exists() and (dest / "agentopd" / "runner.py").exists()
    assert gpu_check.default_against(dest) == (dest, commit)
    assert gpu_check.default_against(tmp_path / "nothing") == (None, "")
    with pytest.raises(SystemExit, match="--prepare-against nosuchref: not a commit of this checkout"):
        gpu_check.prepare_against("nosuchref", dest)


# gpu_opd.py's steps 2-8 (train seconds, tokens) on one H200 in one call, 2026-11-30: dde3275's tree, then d348585's
# (the trainer's layers compiled dynamic from the first call); steps of 6-9 s recompiled the layers
DDE3275 = [(6.814, 27600), (0.367, 28796), (6.672, 26606), (0.369, 29895), (0.395, 30508), (0.241, 27907), (0.406, 32073)]
D348585 = [(8.263, 27600), (0.400, 28306), (0.246, 26606), (0.385, 29324), (0.389, 30508), (0.225, 27922), (0.432, 32232)]


def test_the_opd_train_figure_counts_the_steady_steps_per_token():
    """opd/train_steady_s: the steps under 3x the fastest (no recompiling), their seconds per token, at the median
    step's tokens: a recompiling step moves it not at all, and a run of the same steps is judged alike."""
    def steps(pairs):
        return [{"perf/train_step_s": s, "train/tokens": t} for s, t in pairs]

    before, after = gpu_check.steady_train_s(steps(DDE3275)), gpu_check.steady_train_s(steps(D348585))
    steady = [p for p in DDE3275 if p[0] < 1]
    assert before == pytest.approx(sum(s for s, _ in steady) / sum(t for _, t in steady) * 28796)
    assert before == pytest.approx(0.343, abs=0.001) and after == pytest.approx(0.336, abs=0.001)
    rows, ok = gpu_check.compare({"opd/train_steady_s": after}, {}, "H200", against={"opd/train_steady_s": before},
                                 against_commit="dde3275")  # fmt: skip
    assert ok and _row(rows, "opd/train_steady_s").endswith("| ok |")
    assert "(lower is better)" in _row(rows, "opd/train_steady_s")
    assert not gpu_check.compare({"opd/train_steady_s": before * 1.15}, {}, "H200", against={"opd/train_steady_s": before})[1]
    # one more recompiling step, or none: the same figure
    assert gpu_check.steady_train_s(steps(D348585[:1] + D348585)) == pytest.approx(after, rel=0.02)
    assert gpu_check.steady_train_s(steps(D348585[1:])) == pytest.approx(after, rel=0.02)
