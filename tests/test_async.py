"""Async mode on the Ray backend: the next step's rollouts run while the current step trains,
every episode records the policy version that played it, staleness stays within the bound, and
episodes past the bound are re-generated (or dropped). The local backend refuses async mode."""

import json
import sqlite3

import pytest

from agentopd.config import load_config
from agentopd.runner import Runner

STEPS = 4
BASE = [
    f"steps={STEPS}", "rollout.tasks_per_step=4", "rollout.n=2", "rollout.max_new_tokens=16", "rollout.max_turns=2",
    "eval.num_tasks=2", "eval.every=0", "eval.teacher=false", "run.checkpoint_every=0", "trainer.lr=5e-2",
    "log.tensorboard=false", "backend=ray", "ray.rollout_workers=2", "ray.trainer_workers=1",
    "ray.cpus_per_rollout_worker=0", "ray.cpus_per_teacher=0", "ray.cpus_per_trainer_worker=0", "async.enabled=true",
    "trainer.loss=sampled_k1",
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
        runner._pending[3] = runner._submit(3)
        records = [runner._step(step) for step in (1, 2, 3)]
    finally:
        runner.backend.close()
    assert [r["async/regenerated"] for r in records] == [0.0, 0.0, 8.0]
    rows = [(i, ep.step, ep.policy_version) for i, ep in runner.store.iter_episodes(split="train")]
    assert len(rows) == len({r[0] for r in rows}) == 3 * 4 * 2  # regenerated rows replaced the stale ones
    assert {v for _, step, v in rows if step == 3} == {2}  # what step 3 trained on is on-policy


def test_local_backend_refuses_async(home, tmp_path):
    cfg = load_config("calculator", overrides=["async.enabled=true", "steps=1"])
    with pytest.raises(ValueError, match="async.enabled=true needs run.backend=ray"):
        Runner(cfg, tmp_path / "run").run()
