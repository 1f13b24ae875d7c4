"""`ray.weight_sync=broadcast` on the session's local 2-CPU cluster (conftest `ray_cluster`): trainer rank 0 and
the rollout workers form a weight group of their own (gloo here, NCCL on GPUs; agentopd.backends.weight_sync).

A 4-step run with 2 rollout workers and a trainer group of 2 ranks (the full weights are gathered across
both) keeps every engine on the trainer's weights: the sampler's logprobs equal the trainer's at every step
(`train/logprob_diff_sampler`), also after a rollout worker is killed while step 2 plays — its replacement
joins a new weight group and gets the step-1 weights before it plays again. The fast engines also free their
KV pools while the trainer runs (`ray.engine_sleep`) and allocate them again for the next rollout.
"""

import json
import sqlite3

import pytest
from _faults import kill_rollout_worker_during

from agentopd.config import load_config
from agentopd.runner import Runner

STEPS, TASKS, N = 4, 4, 2
RUN = [
    f"steps={STEPS}", f"rollout.tasks_per_step={TASKS}", f"rollout.n={N}", "rollout.max_new_tokens=16", "rollout.max_turns=2",
    "eval.num_tasks=2", "eval.every=0", "eval.teacher=false", "run.checkpoint_every=0", "trainer.lr=5e-2",
    "log.tensorboard=false", "trainer.loss=sampled_k1", "rollout.max_context=2048", "backend=ray",
    "ray.rollout_workers=2", "ray.trainer_workers=2", "ray.episodes_per_call=2", "ray.weight_sync=broadcast",
    "ray.engine_sleep=true", "engine.kind=fast",
    "teacher.selftest_oracle=false",  # the tiny_home teachers are random: no better than the student on the oracle (conftest)
]  # fmt: skip


@pytest.fixture
def home(tiny_home, monkeypatch):
    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))
    return tiny_home


def test_broadcast_sync_keeps_every_engine_on_the_trainers_weights_through_a_replaced_worker(ray_cluster, home, tmp_path):
    run_dir = tmp_path / "run"
    runner = Runner(load_config("calculator", overrides=RUN), run_dir)
    thread, killed = kill_rollout_worker_during(ray_cluster, runner, run_dir, step=2)
    summary = runner.run()
    thread.join(timeout=5)
    assert killed, "the test never killed an actor"
    assert not summary.interrupted
    assert runner.backend.weight_sync == "broadcast"
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["ray/rollout_restarts"] >= 1
    assert all(r["train/logprob_diff_sampler"] < 1e-4 for r in records), [r["train/logprob_diff_sampler"] for r in records]
    assert all(r["perf/weight_broadcast_s"] > 0 for r in records[:-1])  # the last step's weights are not pushed
    assert all(r["perf/engine_sleep_s"] > 0 for r in records)  # KV pools freed for every step's training
    db = sqlite3.connect(run_dir / "trajectories.db")
    ids = db.execute("select id from episodes where split='train'").fetchall()
    assert len(ids) == len(set(ids)) == STEPS * TASKS * N


def test_ipc_without_gpus_is_refused_when_the_config_loads():
    with pytest.raises(ValueError, match=r"ray.weight_sync=ipc .* needs ray.gpus_per_rollout_worker > 0"):
        load_config("calculator", overrides=["backend=ray", "ray.weight_sync=ipc"])


def test_two_trainer_ranks_that_could_share_a_gpu_are_refused_when_the_config_loads():
    gpus = ["backend=ray", "ray.trainer_workers=2"]
    with pytest.raises(ValueError, match=r"NCCL cannot run a group with two ranks of one GPU"):
        load_config("calculator", overrides=[*gpus, "ray.gpus_per_trainer_worker=0.5"])
    assert load_config("calculator", overrides=[*gpus, "ray.gpus_per_trainer_worker=0.75"]).ray.trainer_workers == 2


def test_engine_sleep_with_async_is_refused_when_the_config_loads():
    with pytest.raises(ValueError, match=r"ray.engine_sleep with async.enabled=true"):
        load_config("calculator", overrides=["backend=ray", "ray.engine_sleep=true", "async.enabled=true"])


def test_the_other_backends_sleep_key_is_refused_not_ignored():
    with pytest.raises(ValueError, match=r"engine.sleep=true on run.backend=ray: .* with ray.engine_sleep=true"):
        load_config("calculator", overrides=["backend=ray", "engine.sleep=true"])
    with pytest.raises(ValueError, match=r"ray.engine_sleep=true on run.backend=local: .* with engine.sleep=true"):
        load_config("calculator", overrides=["ray.engine_sleep=true"])
    assert load_config("calculator", overrides=["backend=ray", "ray.engine_sleep=true"]).ray.engine_sleep  # each its own: fine
    assert load_config("calculator", overrides=["engine.sleep=true"]).engine.sleep is True
