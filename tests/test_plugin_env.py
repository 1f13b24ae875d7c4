"""A user's own environment runs the main job (issue 18): the split contract (agentopd.splits),
the embedded default built for a plugin env from its oracle, and a user env's errors reported as
one line with exit code 2.

The plugins are tests/fixtures/plugin_pkg (`reverse_words`, the README's complete example) and
tests/fixtures/broken_plugin_pkg (`faulty_env` raises from its own code where `fail_in` says),
pip-installed into a private folder (conftest `plugin_site`); the CLI runs in a subprocess with
that folder on PYTHONPATH. Models: TINY_SPEC bootstraps (seconds) and conftest `tiny_home`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

AGENTOPD = Path(sys.executable).parent / "agentopd"
QUICK = [
    "steps=2", "rollout.tasks_per_step=4", "rollout.max_new_tokens=24", "eval.num_tasks=4", "eval.every=0",
    "run.checkpoint_every=1",
    "teacher.selftest=false",  # TINY_SPEC's teachers take 6 SFT steps: near uniform, which the self-test refuses
]  # fmt: skip


def _cli(plugin_site: Path, home: Path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(plugin_site), os.environ.get("PYTHONPATH")])),
           "AGENTOPD_HOME": str(home), "COLUMNS": "250", "NO_COLOR": "1"}  # fmt: skip

    def run(*args) -> subprocess.CompletedProcess:
        return subprocess.run([str(AGENTOPD), *map(str, args)], capture_output=True, text=True, env=env, timeout=600)

    return run


# --- the split contract --------------------------------------------------------------------------
def test_an_env_without_split_gets_a_fixed_held_out_share(demo_plugin):
    from agentopd.registry import make_env
    from agentopd.splits import HELD_OUT_SHARE, make_env_for_split, split_tasks

    every = [t.id for t in make_env("reverse_words").tasks]
    train = [t.id for t in make_env_for_split("reverse_words", "train").tasks]
    held = [t.id for t in make_env_for_split("reverse_words", "eval").tasks]
    assert len(held) == int(len(every) * HELD_OUT_SHARE) and sorted(train + held) == sorted(every)
    assert not set(train) & set(held)
    assert [t.id for t in make_env_for_split("reverse_words", "eval").tasks] == held  # the same every time
    assert [t.id for t in make_env_for_split("reverse_words", "all").tasks] == every
    tasks = make_env("reverse_words").tasks  # the held-out share does not depend on the tasks' order
    assert {t.id for t in split_tasks(tasks[::-1], "eval", "reverse_words")} == set(held)


def test_an_env_with_its_own_split_serves_it():
    from agentopd.splits import make_env_for_split, takes_split
    from agentopd.registry import env_factory

    assert takes_split(env_factory("calculator"))
    assert make_env_for_split("calculator", "eval", num_tasks=5).tasks[0].id != make_env_for_split("calculator", "train", num_tasks=5).tasks[0].id


def test_too_few_tasks_to_hold_out_is_a_clear_error(demo_plugin):
    from agentopd.splits import make_env_for_split

    with pytest.raises(ValueError, match="has 1 task\\(s\\): at least 2 are needed to hold one out"):
        make_env_for_split("faulty_env", "eval", num_tasks=1)


def test_check_env_checks_the_split(plugin_site, tmp_path):
    cli = _cli(plugin_site, tmp_path)
    ok = cli("check-env", "reverse_words", "--fuzz-steps", "50")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "1600 train / 400 eval tasks, disjoint (20% of its tasks held out" in ok.stdout
    bad = cli("check-env", "faulty_env", "env.num_tasks=1", "--fuzz-steps", "20")
    assert bad.returncode == 1
    assert "no held-out tasks for evaluation" in bad.stdout and "split" in bad.stderr


# --- errors from a user's env --------------------------------------------------------------------
@pytest.mark.parametrize(
    "fail_in, expected",
    [
        ("init", "error: env 'faulty_env': FaultyEnv(fail_in='init', num_tasks=10, max_turns=3) failed: KeyError: 'missing_setting'"),
        ("reset", "error: env 'faulty_env': reset(task "),
        ("step", "error: env 'faulty_env': step failed: AttributeError: 'NoneType' object has no attribute 'cursor'"),
        ("grade", "failed: IndexError: list index out of range in my grader"),
    ],
)
def test_a_user_envs_error_is_one_line_and_exit_code_2(plugin_site, tiny_home, tmp_path, fail_in, expected):
    cli = _cli(plugin_site, tiny_home)
    models = tiny_home / "models" / "sql_db"
    done = cli("run", "--env", "faulty_env", "--run-dir", tmp_path / "run", f"env.fail_in={fail_in}", *QUICK,
               f"student={models / 'student'}", f"teacher={models / 'teacher'}", "trainer.loss=sampled_k1")  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], done.stderr
    if fail_in == "reset":
        assert "ZeroDivisionError: division by zero in my reset" in errors[0]


def test_an_env_without_an_oracle_has_no_embedded_default(plugin_site, tmp_path):
    done = _cli(plugin_site, tmp_path)("run", "--env", "faulty_env", "env.fail_in=oracle", *QUICK)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "error: env 'faulty_env' has no oracle (its oracle(task) raises NotImplementedError" in done.stderr
    assert "trains its teacher on the env's reference solutions" in done.stderr
    assert "student=PATH teacher=PATH" in done.stderr


# --- the main job on a plugin env, embedded default ----------------------------------------------
def test_plugin_env_runs_the_main_job_on_the_embedded_default(demo_plugin, plugin_site, tmp_path):
    """Bootstrap (TINY_SPEC, cached as a first `agentopd run` would build it), a short OPD run,
    zero drift, and the viewer lists the run."""
    from fastapi.testclient import TestClient

    from agentopd.bootstrap import TINY_SPEC, bootstrap, tokenizer_dir
    from agentopd.viewer import create_app

    home = tmp_path / "home"
    models = bootstrap("reverse_words", spec=TINY_SPEC, home=home)
    assert models.report["env_version"] == "0.1.0" and models.report["env_kwargs"]["word_length"] == 5
    assert (tokenizer_dir(("sql_db", "calculator", "math", "reverse_words"), home) / "tokenizer.json").is_file()
    assert bootstrap("reverse_words", spec=TINY_SPEC, home=home).report == models.report  # cached

    cli = _cli(plugin_site, home)
    runs = tmp_path / "runs"
    done = cli("run", "--env", "reverse_words", "--run-dir", runs / "rev", *QUICK)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "student before" in done.stdout and "teacher" in done.stdout
    records = [json.loads(x) for x in (runs / "rev" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert "tool/reverse_text/calls" in records[-1]
    drift = cli("check-tokens", runs / "rev")
    assert drift.returncode == 0 and " 0 drifted" in drift.stdout, drift.stdout + drift.stderr
    listed = TestClient(create_app(runs)).get("/api/runs").json()
    assert [r["name"] for r in listed] == ["rev"]
