"""On-policy distillation vs sequence-level KD (SFT on the teacher's episodes), same budget.

    python benchmarks/opd_vs_sft.py --env sql_db --env calculator --steps 40 --eval-every 10 \
        --out benchmarks/results/opd_vs_sft.md [dotted overrides applied to every run ...]

For each env, two runs from the same built-in student and teacher ($AGENTOPD_HOME, built on first
use), the env's preset, the same seed, tasks per step and steps: `objective=opd` (the student plays,
the teacher scores every student token) and `objective=sft` (the teacher plays the same tasks, the
student is trained on the teacher's tokens). Reported per eval: the cumulative number of tokens the
student was trained on (its budget) and held-out success (greedy, the preset's eval tasks), plus
the teacher's success for reference. Prints a markdown table (and writes it with --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from quality import learning_curve  # benchmarks/quality.py, beside this script


def one_run(env: str, objective: str, steps: int, eval_every: int, overrides: list[str], out: Path) -> dict:
    from agentopd.config import load_config
    from agentopd.runner import Runner

    cfg = load_config(env, overrides=[f"steps={steps}", f"objective={objective}", f"eval.every={eval_every}",
                                      "log.tensorboard=false", "run.checkpoint_every=0",
                                      "recipe.auto_warm_start=false", *overrides])  # fmt: skip  # plain OPD against SFT
    t0 = time.perf_counter()
    summary = Runner(cfg, out).run()
    seconds = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    curve, teacher = learning_curve(rows, summary.evals)
    return {"curve": curve, "teacher": teacher, "seconds": seconds}


def table(results: dict[str, dict[str, dict]]) -> str:
    lines = []
    for env, by_obj in results.items():
        opd, sft = by_obj["opd"], by_obj["sft"]
        teacher = opd["teacher"] if opd["teacher"] is not None else sft["teacher"]
        lines += [f"### {env} (teacher: {teacher:.0%})" if teacher is not None else f"### {env}", "",
                  "| step | OPD student tokens | OPD success | SFT student tokens | SFT success |", "|---|---|---|---|---|"]  # fmt: skip
        for a, b in zip(opd["curve"], sft["curve"]):
            lines.append(f"| {a['step']} | {a['tokens']:,} | {a['success']:.0%} | {b['tokens']:,} | {b['success']:.0%} |")
        lines += ["", f"Wall time: OPD {opd['seconds']:.0f} s, SFT {sft['seconds']:.0f} s.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", action="append", help="repeat for several envs (default: sql_db and calculator)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--out", type=Path)
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. eval.num_tasks=50")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # the built-in models are tiny: one thread is fastest (as the CLI does)
    envs = args.env or ["sql_db", "calculator"]
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for env in envs:
            results[env] = {}
            for objective in ("opd", "sft"):
                results[env][objective] = one_run(env, objective, args.steps, args.eval_every, args.overrides, Path(tmp) / f"{env}-{objective}")
                print(json.dumps({"env": env, "objective": objective, **results[env][objective]}), flush=True)
    command = " ".join(["python benchmarks/opd_vs_sft.py", *(f"--env {e}" for e in envs), f"--steps {args.steps}",
                        f"--eval-every {args.eval_every}", *args.overrides])  # fmt: skip
    head = (f"# OPD vs SFT on the teacher's episodes (same tasks, steps and seed)\n\n`{command}`\n\n"
            f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}.\n\n")  # fmt: skip
    text = head + table(results)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
