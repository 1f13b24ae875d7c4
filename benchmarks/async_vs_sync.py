"""Async vs sync on the Ray backend: the same small run twice, wall time and final success side by side.

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/async_vs_sync.py --env calculator --steps 10
    # -> a markdown table on stdout (and --out FILE)

Both runs use one local Ray cluster (`--cpus`), the env's built-in models ($AGENTOPD_HOME), the same
seed, data order and budget; the async run sets `async.enabled=true async.max_staleness=1`, so the
rollouts of step k+1 run while step k is scored and trained. Reported per mode: wall time of the
run (set-up excluded: from the first step to the last), mean staleness, the share of episodes scored ahead
(`async/scored_ahead`), final training-batch success, held-out success before and after and at each eval, and the
first and last KL.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path


def one_run(env: str, steps: int, overrides: list[str], out: Path) -> dict:
    from agentopd.config import load_config
    from agentopd.runner import Runner

    cfg = load_config(env, overrides=[f"steps={steps}", "backend=ray", "log.tensorboard=false", "run.checkpoint_every=0", *overrides])
    t0 = time.perf_counter()
    summary = Runner(cfg, out).run()
    total = time.perf_counter() - t0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "loss" in r]
    return {
        "total_s": total,
        "loop_s": _loop_seconds(out),
        "staleness": sum(r.get("async/staleness_mean", 0.0) for r in steps_) / len(steps_),
        "train_success_last3": sum(r["success_rate"] for r in steps_[-3:]) / 3,
        "eval_before": summary.evals[0]["eval/success_rate"],
        "eval_after": summary.evals[-1]["eval/success_rate"],
        "kl_first": steps_[0]["kl/mean"],
        "kl_last": steps_[-1]["kl/mean"],
        "curve": [(e["step"], e["eval/success_rate"]) for e in summary.evals],
        "scored_ahead": sum(r.get("async/scored_ahead", 0.0) for r in steps_) / len(steps_),
    }


def _loop_seconds(out: Path) -> float:
    """From the first training episode stored to the last one (the training loop, without set-up and evals)."""
    import sqlite3

    db = sqlite3.connect(out / "trajectories.db")
    lo, hi = db.execute("select min(created_at), max(created_at) from episodes where split='train'").fetchone()
    return hi - lo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="calculator")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("overrides", nargs="*", help="extra dotted overrides for both runs")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    common = ["ray.rollout_workers=2", "ray.trainer_workers=1", "ray.cpus_per_rollout_worker=0", "ray.cpus_per_teacher=0",
              "ray.cpus_per_trainer_worker=0", *args.overrides]  # fmt: skip
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, extra in (("sync", []), ("async (max_staleness=1)", ["async.enabled=true", "async.max_staleness=1"])):
            rows[mode] = one_run(args.env, args.steps, [*common, *extra], Path(tmp) / mode.split()[0])
    ray.shutdown()
    lines = [
        f"env `{args.env}`, {args.steps} steps, overrides `{' '.join(common)}`; local Ray cluster of {args.cpus} CPUs on "
        f"{platform.machine()} ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end); AGENTOPD_HOME={os.environ.get('AGENTOPD_HOME', '~/.cache/agentopd')}",
        "",
        "| mode | training loop wall time (s) | whole run (s) | mean staleness | scored ahead | train success (last 3 steps) | held-out success before -> after | KL first -> last step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, r in rows.items():
        lines.append(f"| {mode} | {r['loop_s']:.1f} | {r['total_s']:.1f} | {r['staleness']:.2f} | {r['scored_ahead']:.2f} | {r['train_success_last3']:.0%} | "
                     f"{r['eval_before']:.0%} -> {r['eval_after']:.0%} | {r['kl_first']:.3f} -> {r['kl_last']:.3f} |")  # fmt: skip
    lines += ["", "Held-out success at each eval (step: success):", ""]
    lines += [f"- {mode}: " + ", ".join(f"{step}: {rate:.0%}" for step, rate in r["curve"]) for mode, r in rows.items()]
    sync, asy = rows["sync"], rows["async (max_staleness=1)"]
    lines += ["", f"async / sync training-loop wall time: {asy['loop_s'] / sync['loop_s']:.2f}"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
