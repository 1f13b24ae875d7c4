"""Cross-tokenizer vs same-tokenizer distillation on the embedded sql_db pair, same steps, several seeds (issue 31).

    python benchmarks/crosstok_compare.py --steps 40 --seeds 0 1 2 --out benchmarks/results/crosstok.md \
        -- [dotted overrides applied to every run, e.g. eval.num_tasks=50 rollout.tasks_per_step=16]

Two arms from the same embedded student ($AGENTOPD_HOME, built on first use): `teacher=builtin`
(the same tokenizer) trained with `trainer.loss=sampled_k1`, and `teacher=builtin:cross` (its own BPE
of twice the vocabulary, agentopd.bootstrap.cross_spec) with `trainer.loss=xtok_k1`, the same
sampled-token k1 over aligned spans (one-token spans give sampled_k1 exactly); `--arms cross_full` adds
`trainer.loss=xtok_full` (mapped top-k KL at 1:1 span starts, ULD elsewhere). Per run: held-out
success (greedy, eval.num_tasks) before and after, the gain, the teacher's success (its bootstrap report)
and the share of the student-teacher gap the gain closes, and teacher seconds per step (alignment
included for the cross arm). Prints a markdown table (and writes it with --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

ARMS = {"same": ("builtin", "sampled_k1"), "cross": ("builtin:cross", "xtok_k1"), "cross_full": ("builtin:cross", "xtok_full")}


def teacher_success(ref: str, env: str) -> float:
    from agentopd.bootstrap import bootstrap

    models = bootstrap(env, cross=ref == "builtin:cross")
    return float(models.report.get("teacher", {}).get("success", float("nan")))  # a test home's reports have none


def one_run(env: str, arm: str, seed: int, steps: int, overrides: list[str], out: Path) -> dict:
    from agentopd.config import load_config
    from agentopd.runner import Runner

    teacher, loss = ARMS[arm]
    cfg = load_config(env, overrides=[f"steps={steps}", f"teacher={teacher}", f"trainer.loss={loss}", f"run.seed={seed}",
                                      "eval.every=0", "eval.teacher=false", "log.tensorboard=false", "run.checkpoint_every=0",
                                      *overrides])  # fmt: skip
    t0 = time.perf_counter()
    Runner(cfg, out).run()
    seconds = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/success_rate" in r]
    teacher_s = [r["perf/teacher_s"] for r in rows if "perf/teacher_s" in r]
    extra = {k: statistics.mean(r[k] for r in rows if k in r) for k in ("xtok/aligned_share", "xtok/one_to_one_share")
             if any(k in r for r in rows)}  # fmt: skip
    return {"before": evals[0]["eval/success_rate"], "after": evals[-1]["eval/success_rate"], "seconds": seconds,
            "teacher_s": statistics.mean(teacher_s) if teacher_s else float("nan"), **extra}  # fmt: skip


def table(results: dict[str, list[dict]], teachers: dict[str, float], steps: int) -> str:
    lines = ["| arm | teacher success | seed | before | after | gain | gap closed | teacher s/step | aligned | 1:1 | run s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm, runs in results.items():
        for r in runs:
            gap = teachers[arm] - r["before"]
            closed = (r["after"] - r["before"]) / gap if gap > 0 else float("nan")
            lines.append(f"| {arm} | {teachers[arm]:.0%} | {r['seed']} | {r['before']:.0%} | {r['after']:.0%} | "
                         f"{r['after'] - r['before']:+.0%} | {closed:.0%} | {r['teacher_s']:.2f} | "
                         f"{r.get('xtok/aligned_share', 1.0):.0%} | {r.get('xtok/one_to_one_share', 1.0):.0%} | {r['seconds']:.0f} |")  # fmt: skip
    lines.append("")
    for arm, runs in results.items():
        gains = [r["after"] - r["before"] for r in runs]
        sd = statistics.stdev(gains) if len(gains) > 1 else 0.0
        lines.append(f"- {arm}: mean gain {statistics.mean(gains):+.1%} (sd {sd:.1%}) over {len(gains)} seed(s), {steps} steps; "
                     f"teacher {statistics.mean(r['teacher_s'] for r in runs):.2f} s/step")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", default="sql_db")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=["same", "cross"], choices=list(ARMS))
    ap.add_argument("--out", type=Path)
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every run")
    args = ap.parse_args()
    teachers = {arm: teacher_success(ARMS[arm][0], args.env) for arm in args.arms}
    results: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for arm in args.arms:
                r = one_run(args.env, arm, seed, args.steps, args.overrides, Path(tmp) / f"{arm}-{seed}")
                results[arm].append({"seed": seed, **r})
                print(json.dumps({"arm": arm, "seed": seed, **r}), flush=True)
    text = (f"{args.env}, {args.steps} steps, overrides {args.overrides}; {platform.node()} ({os.cpu_count()} CPUs)\n\n"
            + table(results, teachers, args.steps))  # fmt: skip
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
