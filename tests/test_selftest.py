"""The teacher self-test (agentopd.teacher.selftest, agentopd.step.selftest): each failure it exists for is caught, and
each test shows the same run going through without the check (teacher.selftest=false), so the check is what catches it.

Real tiny models throughout (conftest's tiny_home: random Qwen3 teachers and students, which is why these runs say
teacher.selftest_oracle=false except where the oracle check is under test). What is injected is the fault itself: a
teacher replica that adds noise to its log-probabilities (a subclass of the real HFTeacher / TeacherWorker), teacher
weights zeroed when the student's engine wakes (what redai-studio/Relax#287 saw a colocated wake do), a teacher whose
weights are all zero (uniform), and a vLLM server that shuffles its prompt log-probabilities: a FAKE of vLLM's
/v1/completions (tests/test_server_teacher.py's, serving the real tiny teacher) since no vLLM runs in this suite.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentopd.config import load_config
from agentopd.pair import conversation
from agentopd.pair_stream import play_conversation
from agentopd.teacher import HFTeacher, TeacherMode
from agentopd.teacher.selftest import entropy_share, judge, recheck

SHORT = [
    "steps=3", "rollout.tasks_per_step=3", "rollout.n=2", "rollout.max_new_tokens=24", "rollout.max_turns=3",
    "eval.num_tasks=2", "eval.every=0", "eval.teacher=false", "run.checkpoint_every=0", "trainer.lr=1e-3",
    "log.tensorboard=false",
]  # fmt: skip
RANDOM = "teacher.selftest_oracle=false"  # the tiny_home teachers are random: no better than the student on the oracle


class NoisyTeacher(HFTeacher):
    """A real HFTeacher whose log-probabilities come back with Gaussian noise (a replica on a flaky host)."""

    sigma = 1.0  # mean |noise| ~0.8 nats a token: past 10% of this probe's signal (~5 nats between the random tiny models)

    def score(self, streams, *, mode=TeacherMode.LOGPROBS):
        out = super().score(streams, mode=mode)
        for sc, s in zip(out, streams):
            sc.logprobs = [x + random.gauss(0, self.sigma) if m else x for x, m in zip(sc.logprobs, s.response_mask)]
        return out


def _probe(home):
    tok = AutoTokenizer.from_pretrained(home / "models" / "sql_db" / "teacher")
    messages, tools, _ = conversation("sql_db")
    return [play_conversation(tok, messages, tools, reasoning=False).tokens]


def test_judge_names_the_noisy_replica_and_token(tiny_home, monkeypatch):
    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))
    probe = _probe(tiny_home)
    ref = tiny_home / "models" / "sql_db" / "teacher"
    vocab = len(AutoTokenizer.from_pretrained(ref))
    steady, noisy = HFTeacher(ref, device="cpu", vocab_size=vocab), NoisyTeacher(ref, device="cpu", vocab_size=vocab)
    student = [s.logprobs for s in HFTeacher(tiny_home / "models" / "sql_db" / "student", device="cpu", vocab_size=vocab).score(probe)]

    def twice(teacher):
        return teacher.score(probe, mode="topk"), teacher.score(probe, mode="topk")

    ok = judge("teacher", probe, [twice(steady), twice(steady)], student, vocab_size=vocab, max_noise=0.1, oracle=[True], check_oracle=False)
    assert ok.refusal() is None and ok.repeat.max == 0 and ok.replica.max == 0 and ok.signal > 0.5
    bad = judge("teacher", probe, [twice(steady), twice(noisy)], student, vocab_size=vocab, max_noise=0.1, oracle=[True], check_oracle=False)
    line = bad.refusal()
    assert line is not None and "\n" not in line, (bad.noise_share, bad.signal)
    assert "replica 1 differs from" in line and "token" in line and "teacher.selftest_max_noise=0.1" in line
    # the random tiny teacher is worse than its flatter student on the oracle: the oracle check says so
    broken = judge("teacher", probe, [twice(steady)], student, vocab_size=vocab, max_noise=0.1, oracle=[True])
    assert "no better than the student on the env's oracle episodes" in broken.refusal()
    # ORACLE_TOLERANCE: a teacher 0.2 nats a token below its student passes (a sound teacher in a foreign format), 0.6 does not
    own = [sc.logprobs for sc in steady.score(probe)]
    for shift, refused in ((0.2, False), (0.6, True)):
        student_above = [[x + shift * m for x, m in zip(row, s.response_mask)] for row, s in zip(own, probe)]
        found = judge("teacher", probe, [twice(steady)], student_above, vocab_size=vocab, max_noise=0.1, oracle=[True])
        assert (found.refusal() is not None) == refused, (shift, found.refusal())
    # the entropy a local teacher returns, and the top-k bound a server's scores give (never below it)
    exact = steady.score(probe, mode="topk")
    bound = [dataclasses.replace(s, entropy=None) for s in exact]
    assert 0 < entropy_share(probe, exact, vocab) <= entropy_share(probe, bound, vocab) < 0.95
    # after a reload, the same weights pass the re-check; zeroed weights do not
    assert recheck("teacher", probe, ok, steady.score(probe), "a reload")[1] is None
    with torch.no_grad():
        for p in steady.model.parameters():
            p.zero_()
    uniform = steady.score(probe, mode="topk")
    assert entropy_share(probe, uniform, vocab) == pytest.approx(1.0, abs=1e-5)
    assert entropy_share(probe, [dataclasses.replace(s, entropy=None) for s in uniform], vocab) == pytest.approx(1.0, abs=1e-5)
    diff, line = recheck("teacher", probe, ok, steady.score(probe), "a reload")
    assert line is not None and "changed after a reload" in line and diff.max > 1


def _zeroed_teacher(home, out):
    model = AutoModelForCausalLM.from_pretrained(home / "models" / "sql_db" / "teacher")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(home / "models" / "sql_db" / "teacher").save_pretrained(out)
    return out


def test_a_refused_teacher_leaves_no_engine_running(tiny_home, tmp_path):
    """The refusal is the run's last word: its engines are closed before the error propagates (they were left open,
    and the interpreter's exit printed asyncio's "Task was destroyed but it is pending!" for the fast engine's loop)."""
    teacher = _zeroed_teacher(tiny_home, tmp_path / "zeroed")
    env = {**os.environ, "AGENTOPD_HOME": str(tiny_home)}
    done = subprocess.run([sys.executable, "-m", "agentopd.cli", "run", "--env", "sql_db", "--run-dir", str(tmp_path / "run"),
                           *SHORT, RANDOM, f"teacher={teacher}", "engine.kind=fast"],
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert done.returncode == 2 and "teacher self-test: teacher 'teacher' is uniform" in done.stderr, done.stderr[-2000:]
    assert "Task was destroyed" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_uniform_teacher_is_refused_before_step_1(cli, tiny_home, tmp_path):
    teacher = _zeroed_teacher(tiny_home, tmp_path / "zeroed")
    result = cli("run", "--env", "sql_db", "--run-dir", tmp_path / "run", *SHORT, RANDOM, f"teacher={teacher}")
    assert result.exit_code == 2, result.output
    assert "teacher self-test: teacher 'teacher' is uniform" in result.output, result.output
    assert re.search(r"\(refused after \d+\.\d s of self-test\)", result.output), result.output  # what the check cost
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert '"loss"' not in metrics and not (tmp_path / "run" / "checkpoints").exists()  # refused before any optimizer step
    off = cli("run", "--env", "sql_db", "--run-dir", tmp_path / "off", *SHORT, f"teacher={teacher}", "teacher.selftest=false")
    assert off.exit_code == 0, off.output  # without the self-test the run trains toward a uniform teacher


def test_teacher_zeroed_by_a_wake_stops_the_run_with_a_checkpoint(cli, tmp_path, monkeypatch):
    from agentopd.backends.local import LocalBackend

    wake = LocalBackend._asleep

    def wake_wipes_the_teacher(self, asleep):  # the engine's wake after the first trained step zeroes the teacher
        woke = self.ctx.engine_sleep and self._sleeping and not asleep
        wake(self, asleep)
        if woke and self._synced >= 1:
            with torch.no_grad():
                for teacher in self.teachers.values():
                    for p in teacher.model.parameters():
                        p.zero_()

    monkeypatch.setattr(LocalBackend, "_asleep", wake_wipes_the_teacher)
    run = tmp_path / "run"
    result = cli("run", "--env", "sql_db", "--run-dir", run, *SHORT, RANDOM, "engine.sleep=true")
    assert result.exit_code == 1, result.output
    assert "teacher self-test: teacher 'teacher' changed after the engine's sleep/wake" in result.output, result.output
    assert "checkpoint at step 1" in result.output
    assert (run / "checkpoints" / "step_000001" / "DONE").exists()
    off = cli("run", "--env", "sql_db", "--run-dir", tmp_path / "off", *SHORT, "engine.sleep=true", "teacher.selftest=false")
    assert off.exit_code == 0, off.output  # without the re-check the run goes on against a wiped teacher


def _shuffling_server(app_model, shuffle: bool):
    """The fake vLLM server of tests/test_server_teacher.py over the real tiny teacher; with `shuffle`, each answer's
    prompt log-probabilities are moved to random positions (a server that mixes up its batch)."""
    from fastapi import Request
    from test_server_teacher import fake_vllm

    app = fake_vllm(app_model)
    if shuffle:
        @app.middleware("http")
        async def mix(request: Request, call_next):
            import json

            from fastapi.responses import JSONResponse

            response = await call_next(request)
            body = json.loads(b"".join([chunk async for chunk in response.body_iterator]))
            entries = body["choices"][0]["prompt_logprobs"]
            values = [v["logprob"] for e in entries[1:] for v in e.values()]
            random.shuffle(values)
            it = iter(values)
            for e in entries[1:]:
                for v in e.values():
                    v["logprob"] = next(it)
            return JSONResponse(body)
    return app


@pytest.mark.parametrize("shuffle", [False, True])
def test_server_teacher_that_shuffles_its_logprobs_is_refused(cli, tiny_home, tmp_path, shuffle):
    from test_server_teacher import serving

    model = AutoModelForCausalLM.from_pretrained(tiny_home / "models" / "sql_db" / "teacher").eval()
    with serving(_shuffling_server(model, shuffle)) as url:
        result = cli("run", "--env", "sql_db", "--run-dir", tmp_path / "run", *SHORT, RANDOM, "steps=1",
                     f"teacher={url}", "rollout.temperature=1.0", "trainer.loss=sampled_k1")  # fmt: skip
    if not shuffle:
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 2, result.output
    assert "teacher self-test: teacher 'teacher': its one replica differs from itself between two scorings" in result.output, result.output


def _server_back_with_noise(home):
    """The fake vLLM server over the real tiny teacher, which restarts (tests/test_server_teacher.py `Restart`) with
    noise on the teacher's weights."""
    from test_server_teacher import Restart, fake_vllm

    ref = home / "models" / "sql_db" / "teacher"
    model, noisy = (AutoModelForCausalLM.from_pretrained(ref).eval() for _ in range(2))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return Restart(fake_vllm(model), fake_vllm(noisy))


@pytest.mark.parametrize("selftest", [True, False])
def test_server_teacher_back_with_other_weights_after_a_restart_stops_the_run(cli, tiny_home, tmp_path, monkeypatch, selftest):
    """The teacher's server goes down after step 1 and comes back with noise on its weights: the client reconnects
    (tests/test_server_teacher.py `Restart`: its first connection dropped, so it sees the failure), the next step's
    re-check scores the probe again and the run stops with a checkpoint; without the self-test it trains on."""
    from agentopd.backends.local import LocalBackend

    server = _server_back_with_noise(tiny_home)
    sync, restarted = LocalBackend.sync_weights, []

    def restart_after_step_1(self):
        sync(self)
        if self._synced == 1 and not restarted:
            restarted.append(server.restart())

    monkeypatch.setattr(LocalBackend, "sync_weights", restart_after_step_1)
    run = tmp_path / "run"
    try:
        result = cli("run", "--env", "sql_db", "--run-dir", run, *SHORT, RANDOM, f"teacher={server.url}", "rollout.temperature=1.0",
                     "trainer.loss=sampled_k1", f"teacher.selftest={str(selftest).lower()}")  # fmt: skip
    finally:
        server.stop()
    assert server.dropped.is_set()
    if not selftest:
        assert result.exit_code == 0, result.output  # the run trains on toward the server's other weights
        return
    assert result.exit_code == 1, result.output
    line = rf"teacher self-test: teacher 'teacher' changed after its reconnect to {server.url} \(after \w+\): its log-prob"
    assert re.search(line, result.output), result.output
    assert "checkpoint at step 2" in result.output  # step 2 trained on the new server's scores; step 3's re-check stops
    assert (run / "checkpoints" / "step_000002" / "DONE").exists()


@pytest.mark.parametrize("every", ["2", "null"])
def test_server_teacher_whose_weights_change_unseen_is_caught_by_the_periodic_recheck(cli, tiny_home, tmp_path, monkeypatch, every):
    """The server's weights change after step 1 with no failed request (a restart between two scorings, never seen
    down): no event reaches the run, so only teacher.selftest_every's re-check sees it. Every 2 steps: step 2's re-check
    stops the run with a checkpoint of step 1; by default a server teacher is re-checked every SERVER_EVERY steps, past
    this 3-step run, which trains on."""
    from test_server_teacher import fake_vllm, serving

    from agentopd.backends.local import LocalBackend
    from agentopd.step.selftest import SERVER_EVERY

    assert SERVER_EVERY > 3
    model = AutoModelForCausalLM.from_pretrained(tiny_home / "models" / "sql_db" / "teacher").eval()
    sync, changed = LocalBackend.sync_weights, []

    def change_after_step_1(self):
        sync(self)
        if self._synced == 1 and not changed:
            torch.manual_seed(0)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            changed.append(True)

    monkeypatch.setattr(LocalBackend, "sync_weights", change_after_step_1)
    run = tmp_path / "run"
    with serving(fake_vllm(model)) as url:
        result = cli("run", "--env", "sql_db", "--run-dir", run, *SHORT, RANDOM, f"teacher={url}", "rollout.temperature=1.0",
                     "trainer.loss=sampled_k1", f"teacher.selftest_every={every}")  # fmt: skip
    assert changed
    if every == "null":
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 1, result.output
    line = r"teacher self-test: teacher 'teacher' changed after 2 steps \(teacher.selftest_every\): its log-prob"
    assert re.search(line, result.output), result.output
    assert (run / "checkpoints" / "step_000001" / "DONE").exists()


def test_the_periodic_recheck_is_a_server_teachers_by_default():
    from types import SimpleNamespace

    from agentopd.step.selftest import SERVER_EVERY, TeacherSelfTest

    parts = SimpleNamespace(shapes={"student": object(), "local": object(), "server": None})
    auto = TeacherSelfTest(None, None, None, None, 0, 1.0, 1.0, check_oracle=True, max_noise=0.1)
    assert (auto.interval("local", parts), auto.interval("server", parts)) == (0, SERVER_EVERY)
    fixed = TeacherSelfTest(None, None, None, None, 0, 1.0, 1.0, check_oracle=True, max_noise=0.1, every=5)
    assert (fixed.interval("local", parts), fixed.interval("server", parts)) == (5, 5)


def test_teacher_temperature_must_follow_the_losses_rule():
    assert load_config("sql_db", overrides=["teacher.temperature=0.5"]).teacher.temperature == 0.5  # the sampler's
    with pytest.raises(ValueError, match=r"teacher.temperature=1.0 disagrees with the loss: trainer.loss=forward_kl"):
        load_config("sql_db", overrides=["teacher.temperature=1.0"])  # the preset samples at 0.5
    with pytest.raises(ValueError, match=r"teacher.temperature=0.7 disagrees with the loss: trainer.loss=sampled_k1 compares"):
        load_config("sql_db", overrides=["teacher.temperature=0.7", "trainer.loss=sampled_k1", "rollout.temperature=1.0"])


@pytest.mark.slow
def test_ray_pool_with_one_noisy_replica_is_refused(ray_cluster, tiny_home, tmp_path, monkeypatch):
    """Two Ray teacher replicas (ray.teacher_replicas=2) of the real tiny teacher; replica 1's actor adds noise."""
    import sys

    import agentopd.runner
    from agentopd.backends.ray import RayBackend
    from agentopd.backends.ray_actors import TeacherWorker
    from agentopd.runner import Runner
    from agentopd.step.selftest import TeacherRefused

    class NoisyTeacherWorker(TeacherWorker):
        def score(self, streams, mode):
            out = super().score(streams, mode)
            for sc, s in zip(out, streams):
                sc.logprobs = [x + random.gauss(0, 1.0) if m else x for x, m in zip(sc.logprobs, s.response_mask)]
            return out

    class OneNoisyReplica(RayBackend):
        def _new_teacher(self, name, replica):
            self.teacher_worker_cls = NoisyTeacherWorker if replica == 1 else TeacherWorker
            return super()._new_teacher(name, replica)

    ray_cluster.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor class travels by value
    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))
    ray_args = ["backend=ray", "ray.rollout_workers=1", "ray.trainer_workers=1", "ray.teacher_replicas=2", "ray.cpus_per_rollout_worker=0",
                "ray.cpus_per_teacher=0", "ray.cpus_per_trainer_worker=0", "trainer.loss=sampled_k1"]  # fmt: skip
    cfg = load_config("sql_db", overrides=[*SHORT, RANDOM, *ray_args])
    steady = Runner(cfg, tmp_path / "steady").run()  # the same pool, both replicas steady: passes
    assert steady.steps == 3 and not steady.interrupted
    monkeypatch.setattr(agentopd.runner, "make_backend", lambda cfg: OneNoisyReplica())
    with pytest.raises(TeacherRefused, match=r"teacher 'teacher': replica 1 differs from .* at stream \d+, token \d+"):
        Runner(cfg, tmp_path / "noisy").run()


@pytest.mark.slow
def test_ray_server_teacher_back_with_other_weights_after_a_restart_stops_the_run(ray_cluster, tiny_home, tmp_path, monkeypatch):
    """The restart above on the Ray backend: the server's client lives in the teacher's Ray actor, whose reconnect the
    backend asks for (TeacherWorker.reconnects) before the next step's re-check."""
    from agentopd.backends.ray import RayBackend
    from agentopd.runner import Runner
    from agentopd.step.selftest import TeacherChanged

    server = _server_back_with_noise(tiny_home)
    sync, restarted = RayBackend.sync_weights, []

    def restart_after_step_1(self):  # the driver's sync after each trained step
        sync(self)
        if not restarted:
            restarted.append(server.restart())

    monkeypatch.setattr(RayBackend, "sync_weights", restart_after_step_1)
    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))
    ray_args = ["backend=ray", "ray.rollout_workers=1", "ray.trainer_workers=1", "ray.cpus_per_rollout_worker=0",
                "ray.cpus_per_teacher=0", "ray.cpus_per_trainer_worker=0", "trainer.loss=sampled_k1", "rollout.temperature=1.0"]  # fmt: skip
    cfg = load_config("sql_db", overrides=[*SHORT, RANDOM, *ray_args, f"teacher={server.url}"])
    try:
        with pytest.raises(TeacherChanged, match=rf"teacher 'teacher' changed after replica 0's reconnect to {server.url} "
                                                 r"\(after \w+\): .* checkpoint at step 2"):  # fmt: skip
            Runner(cfg, tmp_path / "run").run()
    finally:
        server.stop()
    assert server.dropped.is_set() and (tmp_path / "run" / "checkpoints" / "step_000002" / "DONE").exists()
