"""Async mode on the Ray backend: the next step's rollouts run while the current step trains,
every episode records the policy version that played it, staleness stays within the bound, and
episodes past the bound are re-generated (or dropped). The local backend refuses async mode."""

import json
import sqlite3

import pytest

from agentopd.config import load_config
from agentopd.backends.base import TrainerRestarted
from agentopd.runner import Runner, RunSummary

STEPS = 4
BASE = [
    f"steps={STEPS}", "rollout.tasks_per_step=4", "rollout.n=2", "rollout.max_new_tokens=16", "rollout.max_turns=2",
    "eval.num_tasks=2", "eval.every=0", "eval.teacher=false", "run.checkpoint_every=0", "trainer.lr=5e-2",
    "log.tensorboard=false", "backend=ray", "ray.rollout_workers=2", "ray.trainer_workers=1",
    "ray.cpus_per_rollout_worker=0", "ray.cpus_per_teacher=0", "ray.cpus_per_trainer_worker=0", "async.enabled=true",
    "trainer.loss=sampled_k1",
    "teacher.selftest_oracle=false",  # the tiny_home teachers are random: no better than the student on the oracle (conftest)
]  # fmt: skip


def _run(tmp_path, overrides):
    cfg = load_config("calculator", overrides=[*BASE, *overrides])
    Runner(cfg, tmp_path / "run").run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    db = sqlite3.connect(tmp_path / "run" / "trajectories.db")
    rows = db.execute("select id, step, policy_version from episodes where split='train'").fetchall()
    return [r for r in records if "loss" in r], rows


@pytest.fixture
def home(tiny_home, monkeypatch):
    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))
    return tiny_home


def test_async_overlaps_with_bounded_staleness(ray_cluster, home, tmp_path):
    records, rows = _run(tmp_path, ["async.max_staleness=1"])
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert 0 <= r["async/staleness_mean"] <= r["async/staleness_max"] <= 1
        assert r["async/dropped"] == 0
    # step k+1 was submitted before step k trained: from step 2 on its episodes are one version old
    assert all(r["async/staleness_max"] == 1 for r in records[1:])
    assert len(rows) == len({r[0] for r in rows}) == STEPS * 4 * 2
    for _, step, version in rows:
        assert step - 2 <= version <= step - 1  # played by the weights after step-2 or step-1 updates


def test_stale_episodes_are_regenerated(ray_cluster, home, tmp_path):
    """Step 3's rollouts submitted before any training (version 0) are two versions old when step 3
    trains (version 2 > async.max_staleness=1): they are played again with the current weights, and
    the regenerated rows replace the stale ones."""
    cfg = load_config("calculator", overrides=[*BASE, "async.max_staleness=1", "async.stale=regenerate", "steps=3"])
    runner = Runner(cfg, tmp_path / "run")
    runner._setup(resume_after=None)
    try:
        runner.play.pending[3] = runner.play.submit(3)
        records = [runner._step(step) for step in (1, 2, 3)]
    finally:
        runner.backend.close()
    assert [r["async/regenerated"] for r in records] == [0.0, 0.0, 8.0]
    rows = [(i, ep.step, ep.policy_version) for i, ep in runner.store.iter_episodes(split="train")]
    assert len(rows) == len({r[0] for r in rows}) == 3 * 4 * 2  # regenerated rows replaced the stale ones
    assert {v for _, step, v in rows if step == 3} == {2}  # what step 3 trained on is on-policy


def test_local_backend_refuses_async(home, tmp_path):
    with pytest.raises(ValueError, match="async.enabled=true needs run.backend=ray"):  # at load: before any run folder
        load_config("calculator", overrides=["async.enabled=true", "steps=1"])


def _rescored(runner, last_step):
    """Every stored training episode up to `last_step`: the teacher logprobs the run stored, and what its teacher gives
    the same stream asked now (`score`, no scoring ahead)."""
    from agentopd.store import row_to_episode

    out = []
    for row in runner.store.iter_rows("split = 'train' and step <= ?", [last_step]):
        ep = row_to_episode(row)
        name = next(iter(runner.router.refs)) if runner.router.single else row["teacher"]
        fresh = runner.backend.score({name: [ep.tokens]}, runner.parts.mode)[name][0]
        out.append((row["id"], ep.teacher_logprobs, fresh.logprobs))
    return out


def _same_scores(pairs):
    assert pairs
    for episode, stored, fresh in pairs:
        assert stored is not None and len(stored) == len(fresh), episode
        assert max(abs(a - b) for a, b in zip(stored, fresh)) < 1e-4, episode


def test_each_step_is_scored_ahead_by_its_teachers(ray_cluster, home, tmp_path):
    """async.score_ahead (on by default): every work item goes to its episodes' teachers (two, routed by env) as an
    ObjectRef when submitted, so the driver never calls `score`; the scores (full-vocabulary loss: the hidden rows stay
    in the object store) are the ones the teacher gives the same streams. Half the tasks are the teachers' to play
    (recipe.teacher_fraction): a step is three rollouts, each scored ahead."""
    overrides = [*BASE, "async.max_staleness=1", "steps=3", "trainer.loss=forward_kl", "teacher_key=env",
                 "teachers.calculator=builtin:calculator", "teachers.sql_db=builtin:sql_db",
                 "recipe.teacher_fraction=0.5"]  # fmt: skip
    runner = Runner(load_config("calculator,sql_db", overrides=overrides), tmp_path / "run")
    runner._setup(resume_after=None)
    backend, calls = runner.backend, []
    score = backend.score
    backend.score = lambda by_teacher, mode: calls.append(by_teacher) or score(by_teacher, mode)
    try:
        records = [runner._step(step) for step in (1, 2, 3)]
        assert calls == []  # every score came ahead
        backend.score = score
        pairs = _rescored(runner, 3)
        # the trainer group went back to step 2 while step 3's rollouts were in flight (and scored ahead): let go
        runner.play.pending[3] = runner.play.submit(3)
        assert backend._ahead and backend._in_flight
        assert runner._rewind(TrainerRestarted(2, "a test"), RunSummary(tmp_path / "run", 3)) == 3
        assert not backend._ahead and not backend._in_flight and not runner.play.pending
    finally:
        backend.close()
    assert [r["async/scored_ahead"] for r in records] == [1.0, 1.0, 1.0]
    assert [r["recipe/teacher_episodes"] for r in records] == [4.0, 4.0, 4.0]
    assert len(pairs) == 3 * 4 * 2
    _same_scores(pairs)
    assert all(r["train/student_tokens"] > 0 for r in records)


def _kill(ray, actor):
    """Kill `actor` and return once it is dead (ray.kill only asks): what is sent to it from now on fails."""
    from ray.exceptions import RayActorError

    ray.kill(actor, no_restart=True)
    with pytest.raises(RayActorError):
        ray.get(actor.__ray_ready__.remote(), timeout=30)


def test_scoring_ahead_survives_a_dead_teacher_and_a_dead_rollout_worker(ray_cluster, home, tmp_path):
    """The teacher replica dies before step 1's scoring starts: the calls sent to it (steps 1 and 2, submitted ahead)
    fail, it is replaced once, and both steps are scored by the replacement. Then a rollout worker dies: its work items
    of step 3 are played again, their scores ahead are void (the teacher waited on the dead actor's episodes) and the
    driver scores them; the other worker's arrive ahead. Nothing is lost or stored twice, every score is the teacher's."""
    cfg = load_config("calculator", overrides=[*BASE, "async.max_staleness=1", "steps=3", "ray.episodes_per_call=2"])
    runner = Runner(cfg, tmp_path / "run")
    runner._setup(resume_after=None)
    backend = runner.backend
    try:
        (pool,) = backend.teachers.values()
        _kill(ray_cluster, pool[0])
        records = [runner._step(1)]
        _kill(ray_cluster, backend.workers[0])
        records += [runner._step(2), runner._step(3)]
        pairs = _rescored(runner, 3)
    finally:
        backend.close()
    assert [r["async/scored_ahead"] for r in records[:2]] == [0.0, 0.0]
    assert 0.0 < records[2]["async/scored_ahead"] < 1.0
    assert records[-1]["ray/teacher_restarts"] == 1 and records[-1]["ray/rollout_restarts"] >= 1
    rows = [i for i, _, _ in pairs]
    assert len(rows) == len(set(rows)) == 3 * 4 * 2
    _same_scores(pairs)


def test_score_ahead_off_scores_on_the_driver(ray_cluster, home, tmp_path):
    records, rows = _run(tmp_path, ["async.max_staleness=1", "async.score_ahead=false", "steps=2"])
    assert [r["async/scored_ahead"] for r in records] == [0.0, 0.0]
    assert len(rows) == 2 * 4 * 2
