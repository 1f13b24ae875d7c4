"""What teacher.selftest_max_noise's default rests on: how large the OPD signal is on a run's self-test probe, how
large the disagreements a legitimate replica can have are, and what noise share injected noise gives.

    python benchmarks/selftest_noise.py RUN_DIR [--out benchmarks/results/selftest.md]

RUN_DIR is a finished `agentopd run` on the embedded models (its config.yaml names them: student=builtin,
teacher=builtin under its $AGENTOPD_HOME). The probe is the run's own: the env's oracle episodes (ORACLE_TASKS, played
through the agent loop as the self-test plays them) and the first PROBE_ROLLOUTS episodes of step 1 from its
trajectories.db. On it, at the run's scoring temperature:
- the teacher (fp32) twice: its repeat noise;
- the same teacher in bf16 (a replica on other hardware or precision, slime#714's gap): replica noise it would show;
- the student (fp32): the signal, mean |teacher - student|;
- Gaussian noise of growing sigma on the teacher's log-probabilities: the noise share each gives;
and from the run's metrics.jsonl, the self-test's seconds beside step 1's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from agentopd.config import load_config
    from agentopd.corpus import oracle_conversation
    from agentopd.splits import make_env_for_split, without_split
    from agentopd.models import resolve_model
    from agentopd.pair_stream import play_conversation
    from agentopd.policy import score_temperature
    from agentopd.step.selftest import ORACLE_TASKS, PROBE_ROLLOUTS
    from agentopd.store import Store
    from agentopd.teacher import HFTeacher, TeacherMode
    from agentopd.teacher.selftest import Diff, entropy_share

    cfg = load_config(None, config_file=args.run_dir / "config.yaml")
    env = cfg.env.name
    kwargs = without_split(cfg.env.kwargs)  # the embedded models are cached per env kwargs
    student_ref = resolve_model(cfg.student.path, env, "student", env_kwargs=kwargs)
    teacher_ref = resolve_model(cfg.teacher.path, env, "teacher", env_kwargs=kwargs)
    tok = AutoTokenizer.from_pretrained(student_ref)
    temperature = score_temperature(cfg)

    made = make_env_for_split(env, "train", **kwargs)
    oracle = []
    for task in made.unwrapped.tasks[:ORACLE_TASKS]:
        messages, tools = oracle_conversation(made, task.id)
        oracle.append(play_conversation(tok, [dict(m) for m in messages], tools, reasoning=False).tokens)
    made.close()
    rollouts = [ep.tokens for _, ep in Store(args.run_dir / "trajectories.db").iter_episodes(step=1, split="train")]
    probe = oracle + [s for s in rollouts if sum(s.response_mask)][:PROBE_ROLLOUTS]

    def scorer(ref, dtype):
        return HFTeacher(ref, device="cpu", dtype=dtype, temperature=temperature, vocab_size=len(tok))

    teacher = scorer(teacher_ref, torch.float32)
    t0 = time.perf_counter()
    first = teacher.score(probe, mode=TeacherMode.TOPK)
    score_s = time.perf_counter() - t0
    second = teacher.score(probe, mode=TeacherMode.TOPK)
    half = scorer(teacher_ref, torch.bfloat16).score(probe)
    student = scorer(student_ref, torch.float32).score(probe)
    lp = [s.logprobs for s in first]
    signal = Diff.of(probe, lp, [s.logprobs for s in student])
    repeat = Diff.of(probe, lp, [s.logprobs for s in second])
    bf16 = Diff.of(probe, lp, [s.logprobs for s in half])
    tokens = sum(sum(s.response_mask) for s in probe)
    rows = [("fp32 teacher, scored again (repeat)", repeat), ("bf16 copy of the teacher (replica)", bf16)]
    rng = random.Random(0)
    for sigma in (0.01, 0.03, 0.1, 0.3):
        noisy = [[x + rng.gauss(0, sigma) if m else x for x, m in zip(row, s.response_mask)] for row, s in zip(lp, probe)]
        rows.append((f"Gaussian noise, sigma {sigma}", Diff.of(probe, lp, noisy)))

    records = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines()]
    step1 = next(r for r in records if "loss" in r)
    step_keys = ("perf/rollout_s", "perf/teacher_s", "perf/train_step_s", "perf/weight_sync_s")
    step_s = sum(step1.get(k, 0.0) for k in step_keys)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"# Teacher self-test: noise against the OPD signal ({time.strftime('%Y-%m-%d')}, {commit})",
        "",
        f"`python benchmarks/selftest_noise.py {args.run_dir}` on {platform.machine()} with {os.cpu_count()} cores (contended: "
        f"other jobs shared them, load {os.getloadavg()[0]:.1f}); env {env}, the embedded pair, scoring temperature {temperature}.",
        "",
        f"Probe: {len(oracle)} oracle episodes + {len(probe) - len(oracle)} of step 1's rollouts, {tokens} student tokens; "
        f"one fp32 TOPK scoring of it {score_s:.2f} s.",
        "",
        f"OPD signal (mean |teacher - student| log-prob): **{signal.mean:.3f}** nats a token (largest {signal.max:.2f}); "
        f"teacher entropy {entropy_share(probe, first, len(tok)):.1%} of ln(vocabulary).",
        "",
        "| disagreement | mean abs diff | max abs diff | noise share (mean / signal) |",
        "|---|---|---|---|",
        *(f"| {name} | {d.mean:.2e} | {d.max:.2e} | {d.mean / signal.mean:.2%} |" for name, d in rows),
        "",
        f"The run's self-test (step 1, metrics.jsonl): teacher/selftest_s {step1.get('teacher/selftest_s', float('nan')):.2f} s "
        f"beside step 1's {step_s:.2f} s ({' + '.join(step_keys)}), "
        f"signal {step1.get('teacher/selftest_signal', float('nan')):.3f}, noise share {step1.get('teacher/selftest_noise_share', float('nan')):.2%}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
