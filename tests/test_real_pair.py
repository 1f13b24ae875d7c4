"""benchmarks/real_pair.py without the real models: its runs' commands load as configs, a finished run is not run
again, a stopped one is continued with --resume (a fake `agentopd run` stands in; a launch the memory plan refused is tried again), and the report is written from
the results alone."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from agentopd.config import load_config

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "real_pair.py"

# A stand-in for `agentopd run`: writes metrics.jsonl (an eval at steps 0 and 3), a checkpoint at step 2, and stops
# there with exit 1 on its first launch (no --resume); a launch with --resume finishes: step 3, its eval and final/.
FAKE = r"""
import json, sys, time
from pathlib import Path
argv = sys.argv[1:]
run_dir = Path(argv[argv.index("--run-dir") + 1])
resume = "--resume" in argv
refused = run_dir.parent / "refused_once"
if not refused.exists():  # the first launch: the memory plan refuses it (others hold memory)
    refused.write_text("")
    print("ValueError: this run does not fit this machine's memory: the train phase needs 1.0 GiB")
    sys.exit(2)
run_dir.mkdir(parents=True, exist_ok=True)
(run_dir / "launches").open("a").write(" ".join(argv) + "\n")
metrics = run_dir / "metrics.jsonl"
def write(step, **kw):
    with metrics.open("a") as f:
        f.write(json.dumps({"step": step, **kw}) + "\n")
    time.sleep(1.2)
step_rec = lambda s: dict({"train/student_tokens": 100.0, "flops/teacher": 1e12, "flops/student": 5e11, "perf/rollout_s": 1.0,
                           "perf/teacher_s": 0.5, "perf/train_step_s": 2.0, "teacher/scored_tokens": 150.0, "kl/turn_0": 0.5 / s, "kl/turn_1": 0.2})
if not resume:
    write(0, **{"eval/success_rate": 0.1})
    write(1, **step_rec(1))
    write(2, **step_rec(2))
    ck = run_dir / "checkpoints" / "step_000002"
    ck.mkdir(parents=True)
    (ck / "DONE").write_text("2")
    sys.exit(1)
write(3, **step_rec(3), **{"eval/success_rate": 0.4})
(run_dir / "final").mkdir()
"""


@pytest.fixture
def rp(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("real_pair", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "LOCK", str(tmp_path / "lock"))
    return mod


def _args(rp, tmp_path, **kw):
    import argparse

    base = dict(env="calculator", arms=list(rp.ARMS), seeds=[0, 1], steps=30, eval_every=10, out=tmp_path / "out", measure=False, overrides=[])
    return argparse.Namespace(**(base | kw))


def test_every_arm_loads_as_a_config(rp, tmp_path):
    specs = rp.plan(_args(rp, tmp_path))
    assert [(s["arm"], s["seed"]) for s in specs] == [(a, seed) for seed in (0, 1) for a in rp.ARMS]
    for s in specs:
        assert s["command"][:3] == ["agentopd", "run", "--env"]
        cfg = load_config("calculator", overrides=s["command"][6:])
        assert cfg.run.steps == 30 and cfg.run.seed == s["seed"] and cfg.run.checkpoint_every == 10 and cfg.trainer.lr == 2e-5
        assert cfg.teacher.chat_template == "student" and str(cfg.trainer.loss) == "reverse_kl"
        expected = {"sft": ("sft", 0, 0.0), "opd": ("opd", 0, 0.0), "sft_then_opd": ("opd", 10, 0.0), "opd_mixed": ("opd", 0, 0.5)}[s["arm"]]
        assert (str(cfg.run.objective), cfg.recipe.sft_steps, cfg.recipe.teacher_fraction) == expected
    measured = rp.plan(_args(rp, tmp_path, measure=True, seeds=[0]))
    assert all("run.steps=2" in s["command"] and "/measure/" in s["run_dir"] for s in measured)


def test_the_cross_tokenizer_arms_load_as_configs(rp, tmp_path):
    specs = rp.plan(_args(rp, tmp_path, arms=list(rp.XTOK_ARMS), seeds=[0]))
    for s in specs:
        cfg = load_config("calculator", overrides=s["command"][6:])
        assert str(cfg.student.path).endswith("smollm2-135m") and str(cfg.teacher.path).endswith("qwen2.5-coder-1.5b")
        assert cfg.teacher.chat_template is None  # each model in its own template
        assert (str(cfg.run.objective), str(cfg.trainer.loss)) == {"xtok_sft": ("sft", "reverse_kl"), "xtok_opd": ("opd", "xtok_k1")}[s["arm"]]


def test_a_stopped_run_continues_and_a_finished_one_is_not_run_again(rp, tmp_path):
    fake = tmp_path / "fake_run.py"
    fake.write_text(FAKE)
    spec = rp.plan(_args(rp, tmp_path, arms=["opd"], seeds=[0], steps=3, eval_every=0))[0]
    spec["command"] = [sys.executable, str(fake), *spec["command"][2:]]
    assert rp.play(spec, keep_weights=False, wait_s=0) is None  # refused once, tried again: stopped at step 2 with a checkpoint
    assert (Path(spec["run_dir"]).parent / "refused_once").exists()
    result = rp.play(spec, keep_weights=False)  # continued: --resume
    run_dir = Path(spec["run_dir"])
    launches = (run_dir / "launches").read_text().splitlines()
    assert len(launches) == 2 and "--resume" not in launches[0] and launches[1].endswith("--resume")
    assert [p["step"] for p in result["curve"]] == [0, 3] and result["curve"][-1]["success"] == 0.4
    assert result["curve"][-1]["teacher_flops"] == 3e12 and result["student_tokens"] == 300
    assert result["phases"]["perf/train_step_s"] == 2.0 and "2" in json.dumps(result["step_walls"])
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "final").exists()  # the weights removed once done
    assert rp.play(spec, keep_weights=False) == result  # finished: read back, not run
    assert len((run_dir / "launches").read_text().splitlines()) == 2

    zero = tmp_path / "zero.jsonl"
    zero.write_text(json.dumps({"model": "m", "env": "calculator", "success": 0.5, "tasks": 100, "tool_calls_per_turn": 0.5,
                                "parse_errors_per_turn": 0.0, "tool_error_rate": 0.0, "stop_reasons": {"answer": 100}, "seconds": 9}) + "\n")
    md = tmp_path / "real_pair.md"
    args = _args(rp, tmp_path, arms=["opd"], report=md, zero_shot=zero)
    md.write_text(f"# old\n{rp.NOTES[0]}\nthe reading\n{rp.NOTES[1]}\nold tables\n")
    rp.report(args)
    text = md.read_text()
    assert "the reading" in text and "old tables" not in text  # the hand-written notes survive a new report
    assert "| m | calculator | 50% | 100 |" in text and "| opd | 0 | 10% | 40% |" in text and "fake_run.py --env calculator --run-dir" in text
    assert "| opd | 0 | 0.500 -> 0.167 | 0.200 -> 0.200 |" in text  # per-turn KL, first and last fifth of the steps
    assert json.loads(md.with_suffix(".json").read_text())["runs"][0]["arm"] == "opd"


def test_a_run_that_can_never_fit_the_machine_is_not_tried_again(rp, tmp_path, capsys):
    """The retry is for memory that other work holds: a run whose plan needs more than all of the machine's memory
    (the 0.5B <- 1.5B mixed arm on 24 GiB) fails at once instead of waiting 60 x 120 s."""
    fake = tmp_path / "never_fits.py"
    fake.write_text("import pathlib, sys\npathlib.Path(sys.argv[0]).with_suffix('.n').open('a').write('x')\n"
                    "print(\"ValueError: this run does not fit this machine's memory: the train phase needs 1000000.0 GiB\")\n"
                    "sys.exit(2)\n")
    spec = rp.plan(_args(rp, tmp_path, arms=["opd"], seeds=[0], steps=3, eval_every=0))[0]
    spec["command"] = [sys.executable, str(fake), *spec["command"][2:]]
    assert rp.play(spec, keep_weights=False, wait_s=0, tries=3) is None
    assert fake.with_suffix(".n").read_text() == "x"  # launched once
    assert "FAILED" in capsys.readouterr().out
    assert rp.could_fit("the train phase needs 1.0 GiB") and not rp.could_fit("the train phase needs 1000000.0 GiB")


def test_the_peak_is_the_largest_phase_where_time_saw_only_the_last(rp):
    """A run resets its high-water mark per phase: /usr/bin/time -v then reports the last phase's peak (19.2 GB for
    the mixed arm whose train phase held 19.43 GiB = 20.9 GB)."""
    real_pair = rp
    records = [{"step": 1, "mem/train_host_peak_gib": 19.43, "mem/rollout_host_peak_gib": 11.3, "mem/train_host_plan_gib": 30.0}]
    assert real_pair.peak_gb([19_162_684], records) == pytest.approx(19.43 * 2**30 / 1e9)
    assert real_pair.peak_gb([23_000_000], records) == 23.0
    assert real_pair.peak_gb([], []) is None


def test_a_new_machine_restores_the_finished_runs_the_report_keeps(rp, tmp_path):
    """The study's folder lives outside the repo and a new machine starts without it: the finished runs kept in the
    committed json come back as result files, so play() reads them instead of running them again; a run whose arm
    changed since (another command) is not restored; the report restores every one it kept."""
    args = _args(rp, tmp_path, arms=["sft", "opd"], seeds=[0], steps=20)
    sft, opd = rp.plan(args)
    elsewhere = lambda spec: " ".join(spec["command"]).replace(str(args.out), "/root/real_pair")  # run there, not here
    kept = {"sft": {"arm": "sft", "curve": [{"step": 20, "success": 0.6}], "command": elsewhere(sft)},
            "opd": {"arm": "opd", "curve": [{"step": 20, "success": 0.3}], "command": elsewhere(opd) + " trainer.lr=1e-3"}}
    measured = {"arm": "opd", "curve": [], "command": elsewhere(rp.plan(_args(rp, tmp_path, arms=["opd"], measure=True))[0])}
    bundle = tmp_path / "real_pair.json"
    bundle.write_text(json.dumps({"env": "calculator", "zero_shot": [], "measure": [measured], "runs": list(kept.values())}))

    assert rp.restore(bundle, "math", args.out, [sft, opd]) == []  # another env's report
    assert rp.restore(bundle, "calculator", args.out, [sft, opd]) == [Path(sft["run_dir"]).name]
    assert rp.play(sft, keep_weights=False) == kept["sft"]  # read back, not run (no `agentopd run` here would finish)
    assert not Path(opd["result"]).exists()  # its command differs: it runs anew
    assert rp.restore(bundle, "calculator", args.out, [sft, opd]) == []  # once there, kept as is

    restored = rp.restore(bundle, "calculator", args.out)  # the report: everything it kept
    assert sorted(restored) == sorted([Path(opd["run_dir"]).name, "calculator-opd-s0-2steps"])
    assert json.loads(Path(opd["result"]).read_text()) == kept["opd"]
    assert (args.out / "measure" / "results" / "calculator-opd-s0-2steps.json").exists()


def test_each_pair_is_read_at_equal_teacher_flops_against_its_own_teachers_spend(rp):
    """The cross-tokenizer arms spend another teacher's FLOPs on another student: the same-tokenizer arms are read at
    their own budget (here 4e12), not at the smallest spend of every arm (the xtok arm's 1e12)."""
    def run(arm, flops, success):
        curve = [{"step": 0, "tokens": 0, "teacher_flops": 0.0, "success": 0.0},
                 {"step": 20, "tokens": 100, "teacher_flops": flops, "success": success}]
        return {"arm": arm, "seed": 0, "curve": curve, "student_tokens": 100, "step_s": 1.0, "step_walls": {"1": 60.0}}

    lines = rp.arms_table([run("sft", 4e12, 0.6), run("opd", 8e12, 0.4), run("xtok_sft", 1e12, 0.1)], ["sft", "opd", "xtok_sft"])
    text = "\n".join(lines)
    assert "the same-tokenizer pair (B = 4.00e+12" in text and "the cross-tokenizer pair (XPAIR) (B = 1.00e+12" in text
    same = lines[lines.index(next(x for x in lines if "same-tokenizer" in x)) :]
    assert next(x for x in same if x.startswith("| sft |")).endswith("60% |")  # sft at 1 B = its own final figure
    assert next(x for x in same if x.startswith("| opd |")).endswith("20% |")  # opd at half its spend: 20%
