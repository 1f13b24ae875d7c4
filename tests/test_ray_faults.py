"""Faults the Ray backend survives without losing or duplicating data (issue 17), on the session's
local 2-CPU cluster (conftest `ray_cluster`) and the tiny models (conftest `tiny_home`).

Every run here is the same 4-step calculator run (2 rollout workers, a trainer group of 2 gloo
ranks, a checkpoint every 2 steps, sampling at temperature 1). The uninterrupted run is the
reference: a faulty run must log steps 1-4 once each, store each of its 24 training episodes once,
and store them token for token as the reference does (sampling seeds derive from run seed, step,
slot and turn; the plan from seed and step).

- A trainer rank killed (SIGKILL) while step 3 plays: the trainer group restarts from the step-2
  checkpoint by itself and the run replays step 3 and finishes.
- The driver killed (SIGKILL, a separate `agentopd run` process with its own local cluster) while
  step 3 plays: `agentopd run --resume` continues at step 3 and finishes.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
from _faults import loss_steps, stored, train_tokens, when_step_plays

from agentopd.config import load_config
from agentopd.runner import Runner

STEPS, TASKS, N = 4, 3, 2
RUN = [
    f"steps={STEPS}", f"rollout.tasks_per_step={TASKS}", f"rollout.n={N}", "rollout.max_new_tokens=16", "rollout.max_turns=2",
    "rollout.temperature=1.0", "eval.num_tasks=2", "eval.every=0", "eval.teacher=false", "trainer.lr=1e-2",
    "trainer.schedule=constant", "trainer.warmup_steps=0", "trainer.loss=sampled_k1", "run.checkpoint_every=2",
    "log.tensorboard=false", "backend=ray", "ray.rollout_workers=2", "ray.trainer_workers=2", "ray.episodes_per_call=2",
    "teacher.selftest_oracle=false",  # the tiny_home teachers are random: no better than the student on the oracle (conftest)
]  # fmt: skip


@pytest.fixture(scope="module")
def home(tiny_home):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENTOPD_HOME", str(tiny_home))
        yield tiny_home


@pytest.fixture(scope="module")
def reference(ray_cluster, home, tmp_path_factory):
    run = tmp_path_factory.mktemp("ray_faults") / "reference"
    Runner(load_config("calculator", overrides=RUN), run).run()
    assert loss_steps(run) == list(range(1, STEPS + 1))
    return train_tokens(run)


def _same_as_reference(run, reference):
    tokens = train_tokens(run)
    assert len(tokens) == STEPS * TASKS * N and sorted(tokens) == sorted(reference)
    differ = sorted(i for i in tokens if tokens[i] != reference[i])
    assert not differ, f"episodes not token-identical to the uninterrupted run: {differ}"


def test_killed_trainer_rank_restarts_the_group_from_the_last_checkpoint(ray_cluster, reference, tmp_path):
    run = tmp_path / "run"
    runner = Runner(load_config("calculator", overrides=RUN), run)
    killed = []

    def kill_rank_1():
        pid = ray_cluster.get(runner.backend.group.ranks[1].pid.remote())  # idle while step 3 plays
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    watcher = when_step_plays(run, 3, kill_rank_1)
    summary = runner.run()
    watcher.join(timeout=5)
    assert killed, "the test never killed a trainer rank"
    assert not summary.interrupted
    assert loss_steps(run) == [1, 2, 3, 4]  # step 3 logged once, after its replay
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["ray/trainer_restarts"] == 1
    _same_as_reference(run, reference)


def test_driver_killed_then_resumed(ray_cluster, reference, home, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "AGENTOPD_HOME": str(home), "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "agentopd.cli", "run", "--env", "calculator", "--run-dir", str(run), *RUN, "ray.num_cpus=2"]
    driver = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    watcher = when_step_plays(run, 3, lambda: driver.send_signal(signal.SIGKILL))
    driver.wait(timeout=600)
    watcher.join(timeout=5)
    assert driver.returncode == -signal.SIGKILL, driver.stderr.read().decode()[-3000:]
    assert (run / "checkpoints" / "step_000002" / "DONE").exists()
    assert not (run / "checkpoints" / "step_000004").exists()
    assert stored(run, 3) > 0 and loss_steps(run) == [1, 2]

    summary = Runner(load_config("calculator", config_file=run / "config.yaml"), run).run(resume=True)
    assert not summary.interrupted
    assert loss_steps(run) == [1, 2, 3, 4]
    _same_as_reference(run, reference)
