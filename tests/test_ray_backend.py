"""The Ray backend on a local 2-CPU cluster (one cluster for the session: conftest `ray_cluster`).

A short calculator + sql_db run with 2 rollout workers, 2 teachers routed by env and a trainer
group of 2 gloo ranks completes, logs the local backend's metric keys plus per-teacher KL, and
its KL falls; a rollout actor killed mid-run is replaced and the run still stores exactly the
episodes asked for, each once. Models: conftest `tiny_home` (made in a second, not trained).
"""

import json
import re
import sqlite3

import pytest
from _faults import kill_rollout_worker_during
from typer.testing import CliRunner

from agentopd.cli import app
from agentopd.config import load_config
from agentopd.runner import Runner

STEPS, TASKS, N = 8, 4, 2
SHORT = [
    f"steps={STEPS}", f"rollout.tasks_per_step={TASKS}", f"rollout.n={N}", "rollout.max_new_tokens=16",
    "rollout.max_turns=2", "eval.num_tasks=2", "eval.every=0", "run.checkpoint_every=0", "trainer.lr=5e-2",
    "log.tensorboard=false", "trainer.loss=sampled_k1", "rollout.max_context=2048",
    "teacher.selftest_oracle=false",  # the tiny_home teachers are random: no better than the student on the oracle (conftest)
]  # fmt: skip
RAY = [
    "backend=ray", "ray.rollout_workers=2", "ray.trainer_workers=2", "ray.cpus_per_rollout_worker=0",
    "ray.cpus_per_teacher=0", "ray.cpus_per_trainer_worker=0", "ray.episodes_per_call=4",
]  # fmt: skip
TEACHERS = ["teachers.calculator=builtin:calculator", "teachers.sql_db=builtin:sql_db", "teacher_key=env"]
RAY_ONLY = {"perf/weight_gather_s", "perf/weight_push_s", "ray/rollout_restarts", "ray/teacher_restarts", "ray/trainer_restarts"}


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train_ids(run):
    db = sqlite3.connect(run / "trajectories.db")
    return db.execute("select id, step, env, teacher from episodes where split='train'").fetchall()


@pytest.fixture
def home(tiny_home, monkeypatch):
    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))
    return tiny_home


def test_mixed_run_two_teachers_two_ranks(ray_cluster, home, tmp_path):
    cli = CliRunner()
    ray_run, local_run = tmp_path / "ray", tmp_path / "local"
    result = cli.invoke(app, ["run", "--env", "calculator,sql_db", "--run-dir", str(ray_run), *SHORT, *TEACHERS, *RAY])
    assert result.exit_code == 0, result.output
    local = cli.invoke(app, ["run", "--env", "calculator,sql_db", "--run-dir", str(local_run), *SHORT, *TEACHERS, "steps=1"])
    assert local.exit_code == 0, local.output

    records = [r for r in _records(ray_run) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # kl/turn_<k> exists for the turns the step's episodes reached, which varies run to run
    turn_k = re.compile(r"kl/turn_[1-9]\d*$")
    local_first = next(r for r in _records(local_run) if "loss" in r)
    # the teacher self-test's metrics come with step 1 only (and a re-check's with a step after an event): the same keys
    # on both backends, two teachers each (agentopd.step.selftest)
    selftest = {k for k in local_first if k.startswith("teacher/selftest_")}
    assert {"teacher/selftest_signal/calculator", "teacher/selftest_signal/sql_db"} <= selftest
    assert selftest == {k for k in records[0] if k.startswith("teacher/selftest_")}
    # a CPU run measures its own process's resident memory per phase on the local backend only (agentopd.step.phases):
    # on Ray the models live in actors
    host_mem = re.compile(r"mem/\w+_host_(peak|plan)_gib$")
    assert any(host_mem.match(k) for k in local_first) and not any(host_mem.match(k) for r in records for k in r)
    local_keys = {k for k in local_first if not turn_k.match(k) and k not in selftest and not host_mem.match(k)}
    ray_keys = {k for k in records[-1] if not turn_k.match(k) and not k.startswith("teacher/selftest_")}
    assert "kl/turn_0" in local_keys and "kl/turn_0" in ray_keys
    assert local_keys <= ray_keys, local_keys - ray_keys
    assert ray_keys - local_keys <= RAY_ONLY | {"eval/success_rate", "eval/mean_turns", "eval/tool_error_rate",
                                                "eval/parse_error_rate", "eval/calculator/success_rate",
                                                "eval/sql_db/success_rate"}  # fmt: skip
    assert {"kl/mean/calculator", "kl/mean/sql_db"} <= local_keys
    kl = [r["kl/mean"] for r in records]
    assert sum(kl[-3:]) / 3 < 0.6 * kl[0], kl  # KL falls (cosine lr: 5e-2 down to 5e-3)
    assert all(r["train/logprob_diff_sampler"] < 1e-4 for r in records)  # engines hold the trained weights

    rows = _train_ids(ray_run)
    assert len(rows) == len({r[0] for r in rows}) == STEPS * TASKS * N
    assert all(env == teacher for _, _, env, teacher in rows)  # routed by env
    assert {env for _, _, env, _ in rows} == {"calculator", "sql_db"}
    assert (ray_run / "final" / "config.json").exists()


def test_killed_rollout_actor_is_replaced_and_nothing_duplicates(ray_cluster, home, tmp_path):
    run_dir, steps = tmp_path / "run", 4
    cfg = load_config("calculator,sql_db", overrides=[*SHORT, *RAY, f"steps={steps}", "ray.trainer_workers=1"])
    runner = Runner(cfg, run_dir)
    thread, killed = kill_rollout_worker_during(ray_cluster, runner, run_dir, step=2)
    summary = runner.run()
    thread.join(timeout=5)
    assert killed, "the test never killed an actor"
    assert not summary.interrupted
    records = [r for r in _records(run_dir) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert records[-1]["ray/rollout_restarts"] >= 1
    rows = _train_ids(run_dir)
    assert len(rows) == len({r[0] for r in rows}) == steps * TASKS * N
    assert sorted({r[1] for r in rows}) == list(range(1, steps + 1))


def test_weight_version_is_the_trainer_step_a_skipped_step_included(ray_cluster, home, tmp_path):
    """Defect 6 (issue 12): the version rose on every train call, also when the trainer skipped the
    step for lack of student tokens, so versions (and staleness) drifted from trainer.step."""
    one_each = ["backend=ray", "ray.rollout_workers=1", "ray.trainer_workers=1", "ray.cpus_per_rollout_worker=0",
                "ray.cpus_per_teacher=0", "ray.cpus_per_trainer_worker=0"]  # fmt: skip
    runner = Runner(load_config("calculator", overrides=[*SHORT, "steps=2", *one_each]), tmp_path / "run")
    runner._setup(resume_after=None)
    try:
        backend = runner.backend
        assert backend.policy_version == 0
        backend.train([], None)  # nothing to learn from: the trainer skips the step
        assert backend.policy_version == 0
        runner._step(1)
        assert backend.policy_version == 1
        assert {ep.policy_version for _, ep in runner.store.iter_episodes(step=1)} == {0}  # sampled by step 0's weights
    finally:
        backend.close()


def test_engine_timings_of_a_worker_killed_after_its_play_are_left_out(ray_cluster, home, tmp_path):
    """rollout/engine_*: the backend asks each worker for its plays' engine timings after it collected them; a worker
    killed in between (test_killed_rollout_actor_is_replaced_and_nothing_duplicates hit it) costs only its share."""
    from agentopd.backends.ray import _Item
    from agentopd.backends.stages import STUDENT

    runner = Runner(load_config("calculator", overrides=[*SHORT, "steps=1", *RAY, "ray.trainer_workers=1"]), tmp_path / "run")
    runner._setup(resume_after=None)
    backend = runner.backend
    try:
        alive, dead = backend.workers
        ray_cluster.kill(dead, no_restart=True)
        items = [_Item([], None, STUDENT, k, actor=a, tag=f"t{k}") for k, a in enumerate((alive, dead))]
        assert backend._take_timings(items) == {}  # neither played: nothing kept, and no RayActorError from `dead`
    finally:
        backend.close()


@pytest.mark.parametrize("loss", ["xtok_k1", "xtok_full"])
def test_cross_tokenizer_teacher_on_ray(ray_cluster, home, tmp_path, loss):
    """trainer.loss=xtok_k1 / xtok_full with a teacher of another tokenizer on the Ray backend: the driver aligns each episode and
    the teacher actor scores the teacher-side stream (agentopd.crosstok.score), as on the local backend."""
    from test_crosstok_run import add_cross_teacher

    add_cross_teacher(home)
    run = tmp_path / loss
    result = CliRunner().invoke(app, ["run", "--env", "sql_db", "--run-dir", str(run), *SHORT, *RAY, "steps=2",
                                      "teacher=builtin:cross", f"trainer.loss={loss}", "trainer.lr=1e-3"])
    assert result.exit_code == 0, result.output
    steps = [r for r in _records(run) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["xtok/aligned_share"] == 1.0 and 0 < r["xtok/one_to_one_share"] < 1.0 and "xtok/kl_turn/0" in r
        if loss == "xtok_full":
            assert 0 < r["xtok/mapped_share"] and r["train/distill_loss"] > 0
    assert len(_train_ids(run)) == 2 * TASKS * N


def test_full_vocabulary_loss_on_ray_keeps_the_hidden_rows_out_of_the_driver(ray_cluster, home, tmp_path):
    """trainer.loss=forward_kl (the teachers' hidden rows and lm_heads) on two ranks and two teachers: the driver holds
    references to the rows (HiddenRef) that the ranks fetch, and each teacher's head is fetched once for the run."""
    import math

    from agentopd.backends.ray_actors import HiddenRef

    overrides = [*SHORT, "trainer.loss=forward_kl", *TEACHERS, *RAY, "steps=2"]
    runner = Runner(load_config("calculator,sql_db", overrides=overrides), tmp_path / "run")
    runner._setup(resume_after=None)
    backend, seen = runner.backend, []
    score = backend.score

    def watch(by_teacher, mode):
        out = score(by_teacher, mode)
        seen.extend(s.hidden for scores in out.values() for s in scores)
        return out

    backend.score = watch
    try:
        metrics = [runner._step(1), runner._step(2)]
        heads = dict(backend._heads)
    finally:
        backend.close()
    assert seen and all(isinstance(h, HiddenRef) and h.rows > 0 for h in seen)
    assert all(math.isfinite(m["loss"]) and m["loss"] > 0 and m["train/student_tokens"] > 0 for m in metrics)
    assert set(heads) == {"calculator", "sql_db"}


def test_the_teachers_eval_engine_is_closed_on_every_rollout_worker_after_its_eval(ray_cluster, home, tmp_path):
    """eval.teacher on Ray: the rollout workers build an engine on the teacher for the step-0 eval and close it once
    that eval is played (as the local backend does), instead of holding it beside the teacher's scoring all run."""
    from agentopd.runner import RunSummary

    overrides = [*SHORT, *RAY, "steps=1", "ray.trainer_workers=1", "eval.teacher=true"]
    runner = Runner(load_config("sql_db", overrides=overrides), tmp_path / "run")
    runner._setup(resume_after=None)
    try:
        def engines():
            return [sorted(ray_cluster.get(w.__ray_call__.remote(lambda self: list(self.players.engines))))
                    for w in runner.backend.workers]  # fmt: skip

        assert engines() == [["student"], ["student"]]
        runner._eval(0, with_teacher=True, summary=RunSummary(tmp_path / "run", steps=1))
        assert runner.evals.teacher is not None and runner.evals.teacher.n > 0  # the teacher played its eval
        assert engines() == [["student"], ["student"]]  # and its engines are gone
    finally:
        runner.backend.close()
