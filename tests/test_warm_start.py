"""recipe.auto_warm_start (agentopd.warm_start): the embedded default's choice from its step-0 evals — the rule on
hand-made eval results, then runs through the CLI on the tiny models (their random teacher solves nothing, so a run
there is not cold: the choice itself is forced in one test to check that it reaches the steps and config.yaml)."""

import json
import sqlite3

import pytest
import yaml

from agentopd import runner as runner_module
from agentopd.config import load_config
from agentopd.evaluate import EvalResult
from agentopd.warm_start import (
    COLD_SHARE,
    FORMAT_ERRORS,
    WarmStart,
    applies,
    choose_warm_start,
)

SHORT = [
    "rollout.tasks_per_step=4", "rollout.n=1", "rollout.max_new_tokens=24", "rollout.max_turns=3",
    "eval.num_tasks=2", "eval.every=0", "run.checkpoint_every=0", "trainer.lr=1e-3",
    "teacher.selftest_oracle=false",  # the tiny_home teachers are random: no better than the student on the oracle (conftest)
]  # fmt: skip


def _eval(success: float, parse_errors: float = 0.0) -> EvalResult:
    return EvalResult("sql_db", "eval", 100, 1, success, success, success, 2.0, 0.0, parse_errors)


def test_a_cold_student_gets_a_third_of_the_run_as_sft():
    cfg = load_config("sql_db", overrides=["steps=150", "recipe.auto_warm_start=true"])
    choice = choose_warm_start(cfg, _eval(0.01, 0.3), _eval(0.86))
    assert choice == WarmStart(steps=50, student=0.01, teacher=0.86, parse_errors=0.3, total=150)
    assert "steps 1-50 of 150 train on the teacher's episodes" in choice.line() and "parse errors in 30%" in choice.line()


@pytest.mark.parametrize(
    "student, parse_errors, teacher, steps, why",
    [
        (0.08, 0.02, 0.70, 0, "at least 5% of the teacher's success"),  # the README's sql_db pair: plain OPD
        (0.05, 0.04, 0.75, 0, "at least 5%"),  # the weakest sql_db student a fresh home built (569d44b)
        (0.39, 0.12, 0.81, 0, "at least 5%"),  # stock_lookup's: format errors, but it solves tasks
        (0.01, 0.0, 0.89, 0, "well-formed tool calls"),  # calculator's: plain OPD took it to 61%, the warm start to 54%
        (0.01, 0.10, 0.89, 100, ""),
        (0.0, 0.5, 0.51, 100, ""),
        (0.0, 0.5, 0.0, 0, "at least 5%"),  # a teacher that solves nothing has no episodes worth copying
    ],
)
def test_cold_is_far_below_the_teacher_without_the_format(student, parse_errors, teacher, steps, why):
    cfg = load_config("sql_db", overrides=["recipe.auto_warm_start=true"])  # 300 steps
    choice = choose_warm_start(cfg, _eval(student, parse_errors), _eval(teacher))
    assert choice.steps == steps
    assert (student < COLD_SHARE * teacher and parse_errors >= FORMAT_ERRORS) == bool(steps)
    if not steps:
        assert "plain on-policy distillation" in choice.line() and why in choice.line()


@pytest.mark.parametrize(
    "overrides",
    [
        ["recipe.auto_warm_start=false"],
        ["recipe.sft_steps=10"],
        ["recipe.teacher_fraction=0.5"],
        ["objective=sft"],
        ["student=/models/S"],
        ["eval.teacher=false"],
        ["steps=2"],
        ["trainer.loss=sampled_k1", "teacher=http://localhost:8000", "eval.teacher=false", "rollout.temperature=1.0"],
    ],
)
def test_the_rule_applies_to_the_embedded_default_alone(overrides):
    cfg = load_config("sql_db", overrides=["recipe.auto_warm_start=true", *overrides])
    assert not applies(cfg)
    assert choose_warm_start(cfg, _eval(0.0), _eval(0.9)) is None


def test_a_mixed_run_is_left_as_it_is():
    assert not applies(load_config("calculator,sql_db", overrides=["recipe.auto_warm_start=true"]))
    assert not applies(load_config("sql_db"))  # off by default


def test_a_run_prints_its_choice(cli, tmp_path):
    run = tmp_path / "run"
    result = cli("run", "--env", "calculator", "--run-dir", run, "steps=3", "recipe.auto_warm_start=true", *SHORT)
    assert result.exit_code == 0, result.output
    assert "warm start: none" in result.output  # the tiny teacher solves nothing: not cold
    assert yaml.safe_load((run / "config.yaml").read_text())["recipe"]["sft_steps"] == 0
    result = cli("run", "--env", "calculator", "--run-dir", tmp_path / "off", "steps=3", *SHORT)  # the default
    assert result.exit_code == 0, result.output
    assert "warm start" not in result.output


def test_a_chosen_warm_start_trains_on_the_teachers_episodes_and_is_kept_for_a_resume(cli, tmp_path, monkeypatch):
    def cold(cfg, student, teacher):
        return WarmStart(2, student.success_rate, 0.9, student.parse_error_rate, cfg.run.steps)

    monkeypatch.setattr(runner_module, "choose_warm_start", cold)
    run = tmp_path / "run"
    result = cli("run", "--env", "calculator", "--run-dir", run, "steps=3", "recipe.auto_warm_start=true", *SHORT)
    assert result.exit_code == 0, result.output
    assert "steps 1-2 of 3 train on the teacher's episodes" in result.output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [("train/distill_loss" in r) for r in records if "loss" in r] == [False, False, True]
    db = sqlite3.connect(run / "trajectories.db")
    scored = db.execute("select step, count(teacher_logprobs) from episodes where split='train' group by step").fetchall()
    assert scored == [(1, 0), (2, 0), (3, 4)]  # the teacher played steps 1-2 (not scored), then scored the student
    assert yaml.safe_load((run / "config.yaml").read_text())["recipe"]["sft_steps"] == 2  # what --resume reads
