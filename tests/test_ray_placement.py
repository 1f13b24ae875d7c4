"""Placement of the Ray backend (agentopd.backends.placement): the README's Ray lines fit a 2-CPU
cluster with no `ray.*` resource overrides, and a request the cluster cannot hold fails within
seconds with a message naming what was asked and what the cluster has (issue 17: the README's
`--env calculator,sql_db backend=ray` used to hang forever on 2 cores with every actor at 1 CPU)."""

import json
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from agentopd.backends.placement import Cluster, PlacementError, place
from agentopd.cli import app
from agentopd.config import load_config

TWO_CPUS = Cluster(cpus=2, gpus=0, free_cpus=2, free_gpus=0, node_cpus=2, node_gpus=0)
TEACHERS = ["calculator", "sql_db"]


def _place(*overrides, cluster=TWO_CPUS):
    return place(load_config("calculator,sql_db", overrides=list(overrides)).ray, TEACHERS, cluster)


def test_default_roles_share_two_cpus():
    placement = _place()  # 2 rollout workers, one replica of each of 2 teachers, 1 trainer rank
    assert [(r.name, r.count, r.cpus) for r in placement.roles] == [
        ("rollout", 2, 0.4), ("teacher/calculator", 1, 0.4), ("teacher/sql_db", 1, 0.4), ("trainer", 1, 0.4),
    ]  # fmt: skip
    assert placement.cpus <= 2
    readme_3 = _place("ray.rollout_workers=4", "ray.trainer_workers=2")  # the README's third Ray line: 8 actors
    assert {r.cpus for r in readme_3.roles} == {0.25} and readme_3.cpus == 2


def test_explicit_sizes_are_kept_and_the_rest_share_what_is_left():
    placement = _place("ray.cpus_per_trainer_worker=1")
    assert placement.role("trainer").cpus == 1 and placement.role("rollout").cpus == 0.25  # (2 - 1) / 4 actors
    with pytest.raises(PlacementError, match=r"asks for .*2 rollout workers x 1 CPU.* = 4 CPU, 0 GPU; the cluster has 2 CPU"):
        _place("ray.cpus_per_rollout_worker=1", "ray.cpus_per_teacher=1", "ray.cpus_per_trainer_worker=0")
    with pytest.raises(PlacementError, match=r"1 trainer rank x 0.4 CPU \+ 1 GPU.*1 GPU asked, 0 free"):
        _place("ray.gpus_per_trainer_worker=1")


def test_impossible_request_names_the_shortfall():
    with pytest.raises(PlacementError) as e:
        _place("ray.trainer_workers=8")
    msg = str(e.value)
    assert "12 actors" in msg and "8 trainer ranks" in msg and "2 rollout workers" in msg
    assert "0.25 CPU each (3 CPU)" in msg and "2 CPU and 0 GPU free" in msg


@pytest.fixture
def home(tiny_home, monkeypatch):
    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))
    return tiny_home


SHORT = ["steps=2", "rollout.tasks_per_step=4", "rollout.max_new_tokens=16", "rollout.max_turns=2",
         "eval.num_tasks=2", "eval.every=0", "log.tensorboard=false", "rollout.max_context=2048",
         "teacher.selftest_oracle=false"]  # fmt: skip  # the tiny_home teachers are random (conftest)


def test_readme_line_runs_on_two_cpus_without_ray_overrides(ray_cluster, home, tmp_path):
    """`agentopd run --env calculator,sql_db backend=ray` (shortened by steps/task overrides only)."""
    result = CliRunner().invoke(app, ["run", "--env", "calculator,sql_db", "--run-dir", str(tmp_path / "run"), "backend=ray", *SHORT])
    assert result.exit_code == 0, result.output
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert ray_cluster.available_resources().get("CPU") == 2  # the reservation was given back


def test_impossible_request_fails_within_seconds(ray_cluster, home, tmp_path):
    t0 = time.perf_counter()
    result = CliRunner().invoke(app, ["run", "--env", "calculator,sql_db", "--run-dir", str(tmp_path / "run"), "backend=ray",
                                      "ray.trainer_workers=8", *SHORT])  # fmt: skip
    seconds = time.perf_counter() - t0
    assert result.exit_code != 0
    text = result.output + repr(result.exception)
    assert "8 trainer ranks" in text and "2 CPU and 0 GPU free" in text, text
    assert seconds < 30, seconds


def test_reservation_not_ready_in_time_fails_and_gives_everything_back(ray_cluster, home, tmp_path):
    """Enough CPUs in all, but the reservation cannot be placed (STRICT_SPREAD wants one node per
    actor; the cluster has one node): the run stops after ray.placement_timeout_s, says why, and
    leaves the cluster's CPUs free."""
    t0 = time.perf_counter()
    result = CliRunner().invoke(app, ["run", "--env", "calculator,sql_db", "--run-dir", str(tmp_path / "run"), "backend=ray",
                                      "ray.placement_strategy=STRICT_SPREAD", "ray.placement_timeout_s=3", *SHORT])  # fmt: skip
    seconds = time.perf_counter() - t0
    assert result.exit_code != 0
    text = result.output + repr(result.exception)
    assert "could not be placed within ray.placement_timeout_s=3 s (strategy STRICT_SPREAD)" in text, text
    assert "2 rollout workers x 0.4 CPU" in text
    assert seconds < 30, seconds
    assert ray_cluster.available_resources().get("CPU") == 2


def _roles(trainers, rollout, teachers, names=("default",)):
    """The roles of a run's config (gpu_roles: as place() makes them, GPU shares only): (count, GPU share) of trainer
    ranks, rollout workers and each teacher's replicas."""
    from agentopd.backends.placement import gpu_roles

    (t, tg), (r, rg), (q, qg) = trainers, rollout, teachers
    cfg = load_config("sql_db", overrides=[f"ray.trainer_workers={t}", f"ray.gpus_per_trainer_worker={tg}", f"ray.rollout_workers={r}",
                                           f"ray.gpus_per_rollout_worker={rg}", f"ray.teacher_replicas={q}", f"ray.gpus_per_teacher={qg}"])  # fmt: skip
    return gpu_roles(cfg.ray, list(names))


LAYOUTS = {  # the GPU index gpu_index gives each actor, role by role (benchmarks/scale_gpu.py's layouts)
    "2gpu": (((1, 1.0), (1, 0.5), (1, 0.5)), {"trainer": [0], "rollout": [1], "teacher/default": [1]}),
    # rollout workers and teacher replicas paired on GPUs 2 and 3 (bundle by bundle, not both workers on GPU 2)
    "4gpu": (((2, 1.0), (2, 0.5), (2, 0.5)), {"trainer": [0, 1], "rollout": [2, 3], "teacher/default": [2, 3]}),
    "8gpu": (((4, 1.0), (4, 0.5), (4, 0.5)), {"trainer": [0, 1, 2, 3], "rollout": [4, 5, 6, 7], "teacher/default": [4, 5, 6, 7]}),
    # ranks of 0.75 GPU (benchmarks/results/ray_gpu.md): a GPU each, the quarters filling what they leave
    "0.75": (((2, 0.75), (1, 0.25), (1, 0.25)), {"trainer": [0, 1], "rollout": [0], "teacher/default": [1]}),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_index_pairs_rollout_workers_with_teacher_replicas(layout):
    from agentopd.backends.placement import gpu_index

    shares, want = LAYOUTS[layout]
    got = gpu_index(_roles(*shares))
    assert {role: [got[role, i] for i in range(len(gpus))] for role, gpus in want.items()} == want


def test_two_teachers_take_turns_after_each_rollout_worker():
    from agentopd.backends.placement import bundle_order, gpu_index

    roles = _roles((1, 1.0), (2, 0.25), (2, 0.25), names=("calculator", "sql_db"))
    order = [(r.name, i) for r, i in bundle_order(roles)]
    assert order == [("trainer", 0), ("rollout", 0), ("teacher/calculator", 0), ("teacher/sql_db", 0),
                     ("rollout", 1), ("teacher/calculator", 1), ("teacher/sql_db", 1)]  # fmt: skip
    gpus = gpu_index(roles)
    assert [gpus[a] for a in order] == [0, 1, 1, 1, 1, 2, 2]  # a quarter each: GPU 1 holds the first four


def test_a_server_teacher_takes_no_gpu_and_moves_no_other_actor():
    """A teacher behind a server (`teachers.sql_db=http://...`) is scored over HTTP: its Ray replicas hold no model, so
    they reserve no GPU share, and every other actor sits where the memory plan (which leaves server teachers out of
    gpu_roles) puts it."""
    from agentopd.backends.placement import gpu_index, gpu_roles

    cfg = load_config("calculator,sql_db", overrides=["ray.rollout_workers=1", "ray.gpus_per_trainer_worker=1",
                                                      "ray.gpus_per_rollout_worker=0.5", "ray.gpus_per_teacher=0.5"])  # fmt: skip
    two_gpus = Cluster(cpus=2, gpus=2, free_cpus=2, free_gpus=2, node_cpus=2, node_gpus=2)
    placement = place(cfg.ray, TEACHERS, two_gpus, servers={"sql_db"})
    assert placement.role("teacher/sql_db").gpus == 0 and "a server's clients: no GPU" in placement.role("teacher/sql_db").label
    assert placement.role("teacher/calculator").gpus == 0.5 and placement.gpus == 2  # trainer 1 + rollout 0.5 + teacher 0.5
    ray_gpus = gpu_index(placement.roles)
    planned = gpu_index(gpu_roles(cfg.ray, ["calculator"]))  # the memory plan: local teachers only
    assert ray_gpus[("teacher/sql_db", 0)] == -1
    assert {k: v for k, v in ray_gpus.items() if k[0] != "teacher/sql_db"} == planned
    with pytest.raises(PlacementError, match=r"2.5 GPU asked, 2 free"):  # the same teacher loaded locally does not fit
        place(cfg.ray, TEACHERS, two_gpus)


PROBE = """
import json, sys
import ray
from agentopd.backends.placement import Placement, Reservation, Role

ray.init(num_cpus=2, num_gpus=int(sys.argv[1]), include_dashboard=False, log_to_driver=False)


@ray.remote
class Probe:
    def gpus(self):
        return [int(g) for g in ray.get_gpu_ids()]


roles = [Role(name, count, 0.0, share, name) for name, count, share in json.loads(sys.argv[2])]
reservation = Reservation.make(ray, Placement(roles), timeout_s=60)
probes = {f"{r.name} {i}": Probe.options(**reservation.options(r.name, i)).remote() for r in roles for i in range(r.count)}
print(json.dumps({k: ray.get(p.gpus.remote()) for k, p in probes.items()}))
"""


@pytest.mark.ray
@pytest.mark.parametrize("layout", ["4gpu", "0.75"])
def test_ray_hands_out_the_gpus_gpu_index_says(layout):
    """A real Ray cluster of logical GPUs (this machine has none; Ray hands out GPU ids all the same) reserves the
    layout's bundles and places an actor in each: every actor gets the GPU that gpu_index (the memory plan's
    placement) names for it."""
    from agentopd.backends.placement import gpu_index

    pytest.importorskip("ray")
    shares, _ = LAYOUTS[layout]
    roles = _roles(*shares)
    env = {**__import__("os").environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    gpus = max(gpu_index(roles).values()) + 1
    done = subprocess.run([sys.executable, "-c", PROBE, str(gpus), json.dumps([(r.name, r.count, r.gpus) for r in roles])],
                          capture_output=True, text=True, timeout=240, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {f"{name} {i}": [g] for (name, i), g in gpu_index(roles).items()}
