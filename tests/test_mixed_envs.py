"""Mixed environments and multi-teacher routing (agentopd.plan, agentopd.routing) on the local backend: config
forms, per-step task plans by weight, routing by env or data source, an unroutable task failing
before the run, and a short calculator + sql_db run through the CLI."""

import json
import sqlite3
from collections import Counter

import pytest
from typer.testing import CliRunner

from agentopd.cli import app
from agentopd.config import load_config
from agentopd.plan import Mixture
from agentopd.routing import Router
from agentopd.runner import Runner

SHORT = [
    "steps=2", "rollout.tasks_per_step=4", "rollout.n=2", "rollout.max_new_tokens=16", "rollout.max_turns=2",
    "eval.num_tasks=2", "eval.every=0", "run.checkpoint_every=0", "log.tensorboard=false",
    "trainer.lr=5e-2",
    "teacher.selftest_oracle=false",  # the tiny_home teachers are random: no better than the student on the oracle (conftest)
]  # fmt: skip


@pytest.fixture
def home(tiny_home, monkeypatch):
    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))
    return tiny_home


def test_env_list_becomes_weighted_sources_and_round_trips(tmp_path):
    cfg = load_config("calculator,sql_db", overrides=["envs.sql_db.max_turns=3", "envs.calculator.weight=3"])
    assert cfg.env.name == "calculator,sql_db"
    assert {k: (e.name, e.weight) for k, e in cfg.mix.envs.items()} == {"calculator": ("calculator", 3.0), "sql_db": ("sql_db", 1.0)}
    assert cfg.mix.envs["sql_db"].kwargs["max_turns"] == 3
    cfg.to_yaml(tmp_path / "c.yaml")
    assert load_config(None, config_file=tmp_path / "c.yaml") == cfg
    # `envs:` in a file, two sources of one env told apart by name
    (tmp_path / "two.yaml").write_text("envs:\n  easy: {name: calculator, weight: 1}\n  hard: {name: calculator, weight: 2, max_turns: 2}\n")
    two = load_config(None, config_file=tmp_path / "two.yaml")
    assert two.env.name == "easy,hard" and two.mix.envs["hard"].kwargs["max_turns"] == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["envs.calculator.nope=1"], "unknown key envs.calculator.nope"),
        (["envs.calculator.weight=0"], "envs.calculator.weight"),
        (["env.max_turns=2"], "takes env kwargs per source"),
        (["teacher_key=source"], "mix.teacher_key"),
    ],
)
def test_bad_mixed_config_names_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config("calculator,sql_db", overrides=overrides)


def test_plan_follows_weights_and_is_a_function_of_seed_and_step():
    cfg = load_config("calculator,sql_db", overrides=["envs.calculator.weight=3"])
    mixture = Mixture.from_config(cfg)
    plan = mixture.plan(5, tasks_per_step=8, n=2, seed=0)
    assert Counter(p.source for p in plan) == {"calculator": 12, "sql_db": 4}  # 6 and 2 tasks, 2 samples each
    assert len({p.spec.episode_id for p in plan}) == 16
    assert plan == mixture.plan(5, tasks_per_step=8, n=2, seed=0)
    assert plan != mixture.plan(6, tasks_per_step=8, n=2, seed=0)
    # a single env plans exactly as the local runner always did
    single = Mixture.from_config(load_config("calculator"))
    import random

    ids = [t.id for t in single.tasks("calculator")]
    expected = random.Random(0 * 1_000_003 + 3).sample(ids, 4)
    assert [p.spec.task_id for p in single.plan(3, tasks_per_step=4, n=1, seed=0)] == expected


def test_eval_plan_is_a_representative_fixed_sample():
    """The run's evals play a seeded sample of the eval split, the set `agentopd eval --num-tasks N` plays,
    whatever the run's seed. (They played the first N: sql_db's eval split is grouped by template, so its
    first 100 tasks covered 7 of its 13 templates and no join task at all.)"""
    from agentopd.evaluate import eval_task_ids

    mixture = Mixture.from_config(load_config("sql_db"))
    tasks = mixture.tasks("sql_db", "eval")
    plan = mixture.eval_plan(0, num_tasks=100, seed=3)
    assert [p.spec.task_id for p in plan] == eval_task_ids(tasks, 100)
    assert [p.spec.task_id for p in mixture.eval_plan(40, num_tasks=100, seed=0)] == [p.spec.task_id for p in plan]
    sizes = Counter(t.id.split(":")[0] for t in tasks)
    played = Counter(p.spec.task_id.split(":")[0] for p in plan)
    assert all(played[name] > 0 for name, size in sizes.items() if size >= 10)  # every common template, joins included


def test_routing_by_env_and_by_data_source():
    cfg = load_config("calculator,sql_db", overrides=["teachers.calculator=/m/a", "teachers.sql_db=/m/b"])
    mixture = Mixture.from_config(cfg)
    router = Router.from_config(cfg, mixture)
    plan = mixture.plan(1, tasks_per_step=6, n=1, seed=0)
    assert all(router.teacher_of(p) == p.source for p in plan)
    # data_source: sql_db tasks carry data_source "sql_db"; calculator tasks have none and use their source name
    cfg = load_config("calculator,sql_db", overrides=["teachers.calculator=/m/a", "teachers.sql_db=/m/b", "teacher_key=data_source"])
    assert all(Router.from_config(cfg, mixture).teacher_of(p) == p.source for p in plan)


def test_a_task_without_a_teacher_fails_before_the_run(home, tmp_path):
    cfg = load_config("calculator,sql_db", overrides=[*SHORT, "teachers.calculator=builtin:calculator"])
    with pytest.raises(ValueError, match=r"routes to teacher 'sql_db'.*add teachers.sql_db="):
        Runner(cfg, tmp_path / "run").run()
    assert not (tmp_path / "run" / "trajectories.db").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_mixed_run_out_of_the_box(home, tmp_path):
    """No models given: each env's built-in teacher, routed by env, and the mixed built-in student, trained on the
    presets' full-vocabulary forward KL, each episode toward its own teacher's lm_head."""
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", "--env", "calculator,sql_db", "--run-dir", str(run), *SHORT])
    assert result.exit_code == 0, result.output
    assert "calculator,sql_db: held-out success" in result.output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    for key in ("kl/mean", "kl/mean/calculator", "kl/mean/sql_db", "success_rate/calculator", "success_rate/sql_db",
                "eval/calculator/success_rate", "eval/sql_db/success_rate", "tool/calculate/calls", "tool/sql_query/calls"):  # fmt: skip
        assert key in last, key
    assert "eval/teacher_success_rate" in records[0] and "eval/teacher/sql_db/success_rate" in records[0]
    assert "train/distill_loss" in last  # a full-vocabulary loss ran (sampled_k1 has none)
    config = (run / "config.yaml").read_text()
    assert "envs:" in config and "calculator:" in config and "loss: forward_kl" in config
    db = sqlite3.connect(run / "trajectories.db")
    rows = db.execute("select env, teacher, count(*) from episodes where split='train' group by 1, 2").fetchall()
    assert rows == [("calculator", "calculator", 8), ("sql_db", "sql_db", 8)]


@pytest.mark.slow
def test_mixed_builtin_student_is_trained_on_every_env(tmp_path):
    from agentopd.bootstrap import TINY_SPEC
    from agentopd.bootstrap import mixed_student

    path = mixed_student(["sql_db", "calculator"], spec=TINY_SPEC, home=tmp_path)
    report = json.loads((path.parent / "report.json").read_text())
    assert report["envs"] == ["calculator", "sql_db"] and set(report["student"]["success"]) == {"calculator", "sql_db"}
    assert report["demonstrations"] == 2 * TINY_SPEC.demonstrations
    assert (tmp_path / "models" / "calculator" / "teacher" / "config.json").exists()
    assert mixed_student(["calculator", "sql_db"], spec=TINY_SPEC, home=tmp_path) == path  # cached
