"""The Ray backend's orchestration ceiling: what the driver costs per episode when generation and
scoring cost nothing.

    python benchmarks/ray_orchestration.py                       # 4 rollout actors, 1k and 10k episodes per step
    python benchmarks/ray_orchestration.py --actors 2 8 --episodes 250 1000 2500 10000 --out benchmarks/results/ray_orchestration.md

BENCHMARK STAND-INS (this file only, never in the product): `InstantEngine` answers every prompt at
once with a fixed final answer (one turn, no tool call) and `InstantTeacher` returns a constant
logprob per token, so a step's time is the orchestration alone: the real runner (plan, store
writes as each work item arrives, teacher routing, store updates), the real RayBackend (work items,
`ray.wait`/`ray.get`, teacher pools) and the real rollout actors (env reset/step, chat templates,
token streams). The trainer is not timed (it is real, and idle here).

Measured per step: wall time of the rollout and teacher phases, the driver process's CPU time per
episode (`time.process_time`, Ray's driver threads included) and the actors' episode rate; then the
store alone: episodes written per second (`Store.add`, one transaction per work item as the runner
does) and teacher updates per second.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import os
import platform
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentopd.backends.ray import RayBackend  # noqa: E402
from agentopd.backends.ray_actors import RolloutWorker, TeacherWorker, _role_ctx  # noqa: E402
from agentopd.engines.base import FinishReason, GenerateRequest, GenerateResult  # noqa: E402


# ---- benchmark stand-ins ---------------------------------------------------------------------
class InstantEngine:
    """BENCHMARK STAND-IN: a fixed one-turn final answer, returned at once (no model)."""

    def __init__(self, tokenizer):
        self.answer = tokenizer.encode("The answer is 42.", add_special_tokens=False)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        ids = [*self.answer, request.params.stop_token_ids[0]]
        return GenerateResult(ids, [-0.1] * len(ids), FinishReason.STOP)

    def release(self, episode_id: str) -> None:
        pass

    async def update_weights(self, state_dict) -> None:
        pass

    async def close(self) -> None:
        pass


class InstantRolloutWorker(RolloutWorker):
    """A real rollout actor (envs, templates, token streams) around the stand-in engine."""

    def __init__(self, ctx, gpus, threads, weights=None, version=0):
        from transformers import AutoTokenizer

        from agentopd.backends.stages import Players

        self.ctx = _role_ctx(ctx, gpus, threads)
        tokenizer = AutoTokenizer.from_pretrained(ctx.student_ref)
        self.players = Players(self.ctx, tokenizer, student_engine=InstantEngine(tokenizer))
        self.version = 0


class InstantTeacherWorker(TeacherWorker):
    """BENCHMARK STAND-IN: a teacher actor that scores every response token -0.5 at once (no model)."""

    def __init__(self, ctx, name, gpus, threads):
        pass

    def score(self, streams, mode):
        from agentopd.teacher import TeacherScores

        return [TeacherScores([-0.5 if m else 0.0 for m in s.response_mask]) for s in streams]


class InstantBackend(RayBackend):
    rollout_worker_cls = InstantRolloutWorker
    teacher_worker_cls = InstantTeacherWorker


# ---- the measurement -------------------------------------------------------------------------
def tiny_home(path: Path) -> Path:
    spec = importlib.util.spec_from_file_location("agentopd_test_conftest", ROOT / "tests" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    return conftest.build_tiny_home(path)


def measure(actors: int, episodes_per_step: list[int], steps: int, run_dir: Path, per_call: int, profile: bool = False) -> list[dict]:
    import agentopd.runner as runner_module
    from agentopd.config import load_config
    from agentopd.step.score import score

    n = 10  # calculator has 1,000 training tasks: 10,000 episodes a step at most
    overrides = [
        "backend=ray", f"ray.rollout_workers={actors}", "ray.trainer_workers=1", "ray.cpus_per_rollout_worker=0",
        "ray.cpus_per_teacher=0", "ray.cpus_per_trainer_worker=0", f"ray.episodes_per_call={per_call}",
        f"rollout.n={n}", "rollout.tasks_per_step=8", "rollout.max_turns=2", "eval.every=0", "log.tensorboard=false",
        "trainer.loss=sampled_k1",
        "teacher.selftest=false",  # the stand-in teacher has no model to self-test
    ]  # fmt: skip
    cfg = load_config("calculator", overrides=overrides)
    runner_module.make_backend = lambda cfg: InstantBackend()  # the stand-ins (module docstring)
    runner = runner_module.Runner(cfg, run_dir)
    t = time.perf_counter()
    runner._setup(resume_after=None)
    setup_s = time.perf_counter() - t
    rows = []
    try:
        plan = [(100, False)] + [(e, True) for e in episodes_per_step for _ in range(steps)]  # a small warm-up step first
        for step, (eps, timed) in enumerate(plan, start=1):
            runner.cfg.rollout.tasks_per_step = eps // n
            prof = cProfile.Profile() if profile and timed and step == len(plan) else None
            if prof:
                prof.enable()
            c0, t0 = time.process_time(), time.perf_counter()
            played = runner.play(step)  # the play stage (agentopd.step.play)
            episodes = played.episodes
            c1, t1 = time.process_time(), time.perf_counter()
            score(played, runner.parts)  # the score stage
            c2, t2 = time.process_time(), time.perf_counter()
            if prof:
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            assert len(episodes) == eps, (len(episodes), eps)
            if timed:
                rows.append({"actors": actors, "episodes": eps, "rollout_s": t1 - t0, "teacher_s": t2 - t1,
                             "driver_cpu_ms_per_ep": 1e3 * (c2 - c0) / eps, "rollout_cpu_ms_per_ep": 1e3 * (c1 - c0) / eps,
                             "teacher_cpu_ms_per_ep": 1e3 * (c2 - c1) / eps, "setup_s": setup_s})  # fmt: skip
                print(rows[-1], flush=True)
    finally:
        runner.backend.close()
    return rows


def store_rate(run_dir: Path, n: int) -> dict:
    """Episodes rewritten into a fresh store from the benchmark's own episodes: per episode and per item."""
    from agentopd.store import Store

    src = Store(run_dir / "trajectories.db", readonly=True)
    eps = [(i, ep) for i, ep in src.iter_episodes(split="train")][:n]
    out = {}
    for batch in (1, 8, 64):
        store = Store(run_dir.parent / f"rate-{batch}.db")
        t, c = time.perf_counter(), time.process_time()
        for k in range(0, len(eps), batch):
            with store.batch():
                for i, ep in eps[k : k + batch]:
                    store.add(ep, i)
        out[f"add_per_s_batch_{batch}"] = len(eps) / (time.perf_counter() - t)
        out[f"add_per_cpu_s_batch_{batch}"] = len(eps) / (time.process_time() - c)
        t, c = time.perf_counter(), time.process_time()
        for k in range(0, len(eps), batch):
            with store.batch():
                for i, ep in eps[k : k + batch]:
                    store.set_teacher_logprobs(i, [-0.5] * len(ep.tokens.response_mask), ep.tokens)
        out[f"teacher_per_s_batch_{batch}"] = len(eps) / (time.perf_counter() - t)
        out[f"teacher_per_cpu_s_batch_{batch}"] = len(eps) / (time.process_time() - c)
        store.close()
    out["episodes"] = len(eps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--actors", type=int, nargs="+", default=[4])
    ap.add_argument("--episodes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--steps", type=int, default=1, help="timed steps per size (after one small warm-up step)")
    ap.add_argument("--per-call", type=int, default=8, help="ray.episodes_per_call")
    ap.add_argument("--cpus", type=int, default=None, help="CPUs of the local Ray cluster (default: all)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile", action="store_true", help="print the driver's profile of the last step")
    args = ap.parse_args()

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    tmp = Path(tempfile.mkdtemp(prefix="ray_orch_"))
    os.environ["AGENTOPD_HOME"] = str(tiny_home(tmp / "home"))
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    rows = []
    for a in args.actors:
        rows += measure(a, args.episodes, args.steps, tmp / f"run-{a}", args.per_call, args.profile)
    store = store_rate(tmp / f"run-{args.actors[-1]}", 2000)
    ray.shutdown()
    load = os.getloadavg()
    lines = [
        f"`python benchmarks/ray_orchestration.py {' '.join(sys.argv[1:])}` — {platform.machine()}, {os.cpu_count()} cores, "
        f"load average {load[0]:.1f} at the end; instant engine and teacher (benchmark stand-ins); ray.episodes_per_call={args.per_call}",
        "",
        "| rollout actors | episodes/step | rollout phase s | teacher phase s | episodes/s (rollout) | driver CPU ms/episode (rollout + teacher) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['actors']} | {r['episodes']} | {r['rollout_s']:.2f} | {r['teacher_s']:.2f} | {r['episodes'] / r['rollout_s']:.0f} | "
                     f"{r['driver_cpu_ms_per_ep']:.3f} ({r['rollout_cpu_ms_per_ep']:.3f} + {r['teacher_cpu_ms_per_ep']:.3f}) |")  # fmt: skip
    lines += ["", f"Store, {store['episodes']} of these episodes rewritten into a fresh trajectories.db (episodes per wall second / per CPU second of this process):", "",
              "| episodes per transaction | add | teacher logprobs |", "| --- | --- | --- |"]  # fmt: skip
    for b in (1, 8, 64):
        lines.append(f"| {b} | {store[f'add_per_s_batch_{b}']:.0f} / {store[f'add_per_cpu_s_batch_{b}']:.0f} | "
                     f"{store[f'teacher_per_s_batch_{b}']:.0f} / {store[f'teacher_per_cpu_s_batch_{b}']:.0f} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
