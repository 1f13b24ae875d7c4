"""benchmarks/quality_gpu.py's whole path on the CPU (`--tiny`: the test-size pair, 2 steps): a call builds the pair,
runs the arms and bundles their results in one JSON; a later call given that bundle on a fresh machine runs nothing
again; the report is written from the bundle alone."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _tiny import one_thread  # noqa: F401  (tiny models on 2 cores: one torch thread)

from agentopd.bootstrap import TINY_SPEC, ensure_tokenizer

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "quality_gpu.py"


def _call(*args) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", *map(str, args)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _machine(tmp_path: Path, name: str) -> Path:
    """A fresh work folder, as a GPU machine starts with, its shared tokenizer prebuilt at test size (seconds)."""
    work = tmp_path / name
    ensure_tokenizer(TINY_SPEC, home=work / "home")
    return work


def _check_bundle(bundle: dict, methods: list[str]) -> None:
    assert bundle["size"] == "test" and "embedded.size=test" in bundle["overrides"] and len(bundle["pairs"]) == 1
    assert bundle["pairs"][0]["size"] == "test" and bundle["pairs"][0]["student"]["parameters"] > 0
    assert sorted(r["method"] for r in bundle["results"].values()) == sorted(methods)
    for result in bundle["results"].values():
        assert result["pair"] == 0 and result["curve"][-1]["step"] == 2 and result["seed"] == 0


def _main(monkeypatch, *args) -> None:
    """The script's main() in this process (no interpreter to start: seconds saved on 2 cores)."""
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("quality_gpu", SCRIPT)
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--tiny", *map(str, args)])
    module.main()


def test_a_call_bundles_its_arms_and_the_next_continues(tmp_path, monkeypatch, capsys):
    """...and a warm machine's next call (the same work folder) reuses the pair it built."""
    out = tmp_path / "out"
    monkeypatch.setenv("AGENTOPD_COMMIT", "c0ffee1")  # a device machine's tree has no .git: the commit comes with the call
    printed = _call("--methods", "opd", "--out", out, "--work", _machine(tmp_path, "call1"))
    assert "1 results" in printed
    bundle = json.loads((out / "quality_gpu.json").read_text())
    _check_bundle(bundle, ["opd"])
    assert bundle["pairs"][0]["commit"] == "c0ffee1" and len(bundle["pairs"][0]["date"]) == len("2026-11-28")

    _main(monkeypatch, "--methods", "opd", "--out", tmp_path / "out2", "--resume", out / "quality_gpu.json",
          "--work", tmp_path / "call2")  # fmt: skip
    assert "every arm of seed(s) [0] is in the bundle" in capsys.readouterr().out  # nothing run, no pair built
    assert json.loads((tmp_path / "out2" / "quality_gpu.json").read_text()) == bundle

    # the next call on the same (warm) machine: the cached pair is the bundle's, not a second one
    _main(monkeypatch, "--methods", "opd", "--seed", "1", "--out", tmp_path / "out3", "--resume",
          tmp_path / "call1" / "quality_gpu.json", "--work", tmp_path / "call1")  # the last call's bundle, kept in --work
    assert "the pair is the bundle's last one" in capsys.readouterr().out
    warm = json.loads((tmp_path / "out3" / "quality_gpu.json").read_text())
    assert len(warm["pairs"]) == 1 and sorted((r["seed"], r["pair"]) for r in warm["results"].values()) == [(0, 0), (1, 0)]

    report = tmp_path / "quality_gpu.md"
    _main(monkeypatch, "--resume", out / "quality_gpu.json", "--report", report)
    text = report.read_text()
    assert "embedded.size=test" in text and "## sql_db" in text and "| opd | 1 |" in text
    assert f"| 0 | {bundle['pairs'][0]['date']}, c0ffee1 |" in text  # each pair names when and at which commit it was built


@pytest.mark.slow
def test_every_default_arm_runs(tmp_path):
    from importlib.util import module_from_spec, spec_from_file_location

    out = tmp_path / "out"
    _call("--jobs", 2, "--out", out, "--work", _machine(tmp_path, "call"))
    spec = spec_from_file_location("quality_gpu", SCRIPT)
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    bundle = json.loads((out / "quality_gpu.json").read_text())
    _check_bundle(bundle, list(module.ARMS))
    # a privileged arm among them: the pair's reading of the privileged context checked first
    context = bundle["pairs"][0]["context"]
    assert context["kind"] == "solution" and set(context["models"]) == {"builtin student", "builtin teacher"}


def test_merge_adds_another_calls_pairs_and_runs(tmp_path, monkeypatch, capsys):
    """A call that met a fresh machine brings back the checkout's bundle plus its own pair and runs; merged into the
    last call's bundle, each pair is kept once, each run points at its pair's place, a run both hold keeps the first
    result, and bundles of other runs are refused by name."""
    shared = {"env": "sql_db", "size": "test", "steps": 2, "eval_every": 1, "privileged": "solution", "overrides": ["embedded.size=test"]}
    p0, p1, p2 = ({"built_s": 1.0 + i, "commit": f"c{i}"} for i in range(3))
    run = lambda method, pair, success: {"method": method, "seed": 0, "pair": pair, "curve": [{"step": 2, "success": success}]}  # noqa: E731
    last = {**shared, "pairs": [p0, p1], "results": {"a": run("sft", 0, 0.1), "b": run("opd", 1, 0.2)}}
    fresh = {**shared, "pairs": [p0, p2], "results": {"a": run("sft", 0, 0.1), "b": run("opd", 1, 0.3), "c": run("opd_mixed", 1, 0.4)}}
    into, other = tmp_path / "into.json", tmp_path / "other.json"
    into.write_text(json.dumps(last))
    other.write_text(json.dumps(fresh))
    _main(monkeypatch, "--resume", into, "--merge", other)
    printed = capsys.readouterr().out
    merged = json.loads(into.read_text())
    assert merged["pairs"] == [p0, p1, p2]
    assert merged["results"] == {"a": run("sft", 0, 0.1), "b": run("opd", 1, 0.2), "c": run("opd_mixed", 2, 0.4)}
    assert "added c (pair 2)" in printed and f"kept b of pair 1, not {other}'s of pair 2" in printed

    other.write_text(json.dumps({**fresh, "steps": 300}))
    with pytest.raises(SystemExit, match=r"--merge .*other.json: its runs differ in steps \(steps=300\)"):
        _main(monkeypatch, "--resume", into, "--merge", other)
    assert json.loads(into.read_text()) == merged  # a refused merge leaves the bundle as it was
