"""Where on-policy distillation wins: OPD, its recipes, SFT on teacher episodes and GRPO, seeded.

    python benchmarks/quality.py --env sql_db_explore --env sql_db --seeds 3 --steps 150 --eval-every 25 \
        --jobs 8 --out benchmarks/results/quality.md [dotted overrides for every run ...]

Every method starts from the env's built-in student with the env's preset, the same tasks per step,
steps and seeds, so each trains on about the same number of tokens (its student-token budget):

    opd               the student plays, the teacher scores every student token (trainer.loss of the preset)
    opd_mixed         GKD's lambda: half of each step's tasks played by the teacher, the same loss
    sft_then_opd      SFT warm start on teacher episodes for the first third of the steps, then OPD
    sft_late_opd      SFT for the first two thirds of the steps, then OPD: against `sft` of the same steps, "SFT
                      towards its plateau, then OPD or more SFT" (at two thirds SFT is near its plateau, not at
                      it: the gpu pair's sql_db SFT stood at 67% at step 200 of 300 and ended at 81%)
    opd_intervene     the teacher replays student turns it finds unlikely (recipe.intervene_below)
    opd_turn_weights  turns outside the teacher's support count less (recipe.turn_support_below)
    sft               cross-entropy on the teacher's episodes of the same tasks (sequence-level KD)
    grpo              the env reward alone: groups of 4 episodes per task, a quarter of the tasks
    opd_self_privileged  privileged self-distillation: the teacher is a frozen copy of the student that reads the
                      env's privileged context (--privileged: solution | schema) in its prompt (teacher=self)
    opd_privileged    the built-in teacher, reading the same privileged context
    opd_horizon       truncated horizon: training episodes played to k turns, k from 2 to rollout.max_turns

Reported per env and method, as mean +- std over the seeds: held-out success at every eval point,
the student tokens trained on, the teacher tokens scored and generated, the teacher's and the student's
FLOPs (agentopd.flops: the run's `flops/teacher_cum`, `flops/student_cum`), wall time; held-out success at
equal teacher FLOPs (each curve interpolated at shares of the smallest final teacher budget among the methods
that use the teacher, a teacher far cheaper than the rest, such as the student's own copy, left out of that
choice); at the last eval, success per task template and the recovery rate (success among
episodes with a tool error). Each run is a subprocess (`--jobs` at once, one torch thread each) that writes
its result JSON under `--work`; a result already there is reused, so an interrupted sweep continues where it
was (a result written before the FLOPs were logged has none: "-" in those columns, left out of that plot). A run
stopped mid-way (Ctrl-C, or `stop_runs()` at the end of a GPU call: each finishes its step and checkpoints it)
continues from its checkpoint at the next launch; its seconds add up across the launches.
Writes the markdown (--out) and a PNG next to it: success against student tokens (top row) and against
teacher FLOPs (bottom row).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

METHODS = ("opd", "opd_mixed", "sft_then_opd", "sft_late_opd", "opd_intervene", "opd_turn_weights", "sft", "grpo",
           "opd_self_privileged", "opd_privileged", "opd_horizon")  # fmt: skip


def method_overrides(method: str, steps: int, tasks_per_step: int, intervene_below: float, support_below: float,
                     privileged: str = "solution", max_turns: int = 4) -> list[str]:  # fmt: skip
    # each arm is exactly its recipe: the embedded default's own choice from its step-0 evals (agentopd.warm_start) is off
    return ["recipe.auto_warm_start=false"] + {
        "opd": ["objective=opd"],
        "opd_mixed": ["objective=opd", "recipe.teacher_fraction=0.5"],
        "sft_then_opd": ["objective=opd", f"recipe.sft_steps={max(1, steps // 3)}"],
        "sft_late_opd": ["objective=opd", f"recipe.sft_steps={max(1, 2 * steps // 3)}"],
        "opd_intervene": ["objective=opd", f"recipe.intervene_below={intervene_below}"],
        "opd_turn_weights": ["objective=opd", f"recipe.turn_support_below={support_below}"],
        "sft": ["objective=sft"],
        "grpo": ["objective=grpo", "rollout.n=4", f"rollout.tasks_per_step={max(1, tasks_per_step // 4)}"],
        "opd_self_privileged": ["objective=opd", "teacher=self", f"teacher.privileged={privileged}"],
        "opd_privileged": ["objective=opd", f"teacher.privileged={privileged}"],
        "opd_horizon": ["objective=opd", f"recipe.horizon_turns=[{min(2, max_turns)},{max_turns}]"],
    }[method]


# ---- one run (a worker process) ------------------------------------------------------------
def run_one(spec: dict) -> dict:
    import torch

    from agentopd.config import load_config
    from agentopd.rundir import RunDir
    from agentopd.runner import Runner

    torch.set_num_threads(1)  # the built-in models are tiny: one thread each, many runs at once
    cfg = load_config(spec["env"], overrides=spec["overrides"])
    run_dir = Path(spec["run_dir"])
    resume = RunDir(run_dir).latest_checkpoint() is not None  # a run stopped by stop_runs() (the end of a GPU call)
    if not resume and run_dir.exists():  # stopped before its first step: nothing to continue
        shutil.rmtree(run_dir)
    spent = run_dir / SECONDS
    t0 = time.perf_counter()
    summary = Runner(cfg, run_dir).run(resume=resume)
    seconds = time.perf_counter() - t0 + (float(spent.read_text()) if resume and spent.exists() else 0.0)
    spent.write_text(f"{seconds:.1f}")
    if summary.interrupted:
        raise SystemExit(STOPPED)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve, teacher = learning_curve(records, summary.evals)
    intervene = [r["intervene/rate"] for r in records if "intervene/rate" in r]
    return {
        **{k: spec[k] for k in ("env", "method", "seed")},
        "curve": curve,
        "teacher_success": teacher,
        "seconds": seconds,
        "intervene_rate": statistics.fmean(intervene) if intervene else None,
        # one teacher forward over every token of a scored sequence; the assistant tokens of what it played
        "teacher_scored": sum(r.get("teacher/scored_tokens", 0.0) + r.get("teacher/guide_scored_tokens", 0.0) for r in records),
        "teacher_generated": sum(r.get("teacher/generated_tokens", 0.0) for r in records),
        **last_eval_diagnosis(run_dir, cfg),
    }


def learning_curve(records: list[dict], evals: list[dict]) -> tuple[list[dict], float | None]:
    """Per eval: its step, the student tokens trained on by then (cumulative train/student_tokens of the
    run's metrics.jsonl records), the teacher's and the student's FLOPs spent by then (flops/teacher,
    flops/student summed: the evals' own left out) and held-out success; and the teacher's success, where
    it was evaluated."""
    by_step = {e["step"]: e for e in evals}
    tokens, teacher_flops, student_flops, curve = 0.0, 0.0, 0.0, []
    for r in records:
        tokens += r.get("train/student_tokens", 0.0)
        teacher_flops += r.get("flops/teacher", 0.0)
        student_flops += r.get("flops/student", 0.0)
        if r["step"] in by_step and (not curve or curve[-1]["step"] != r["step"]):
            curve.append({"step": r["step"], "tokens": int(tokens), "teacher_flops": teacher_flops, "student_flops": student_flops,
                          "success": by_step[r["step"]]["eval/success_rate"]})  # fmt: skip
    teacher = next((e["eval/teacher_success_rate"] for e in evals if "eval/teacher_success_rate" in e), None)
    return curve, teacher


def last_eval_diagnosis(run_dir: Path, cfg) -> dict:
    """At the last eval: success per task template (the task's `template`, else its id before ':'), and
    success among the episodes that hit a tool error (did the student recover?)."""
    from agentopd.plan import Mixture
    from agentopd.store import Store

    mixture = Mixture.from_config(cfg)
    (source,) = mixture.sources
    store = Store(run_dir / "trajectories.db", readonly=True)
    per_template: dict[str, list[bool]] = defaultdict(list)
    after_error: list[bool] = []
    for _, ep in store.iter_episodes(step=cfg.run.steps, split="eval"):
        task = mixture.task(source, ep.task_id, "eval")
        template = (task.data or {}).get("template") if task else None
        per_template[template or ep.task_id.split(":")[0]].append(bool(ep.success))
        if any(sum(turn.tool_call_errors.values()) for turn in ep.turns):
            after_error.append(bool(ep.success))
    store.close()
    return {
        "per_template": {k: sum(v) / len(v) for k, v in sorted(per_template.items())},
        "error_episodes": len(after_error),
        "recovered": sum(after_error) / len(after_error) if after_error else None,
    }


# ---- the sweep -----------------------------------------------------------------------------
def plan_runs(args: argparse.Namespace) -> list[dict]:
    """One spec per (env, method, seed) run: its overrides, its run directory and its result JSON under `args.work`."""
    from agentopd.config import load_config

    work = args.work
    specs = []
    for env in args.env:
        base = load_config(env, overrides=[f"steps={args.steps}", *args.overrides])
        tasks = base.rollout.tasks_per_step
        for method in args.methods:
            for seed in range(args.seeds):
                kind = f"-{args.privileged}" if "privileged" in method else ""  # a result is reused only for the same run
                name = f"{env}-{method}{kind}-s{seed}-{args.steps}steps"
                # the teacher's greedy eval is the same in every run: played once per env (opd, seed 0)
                teacher_eval = f"eval.teacher={str(method == 'opd' and seed == 0).lower()}"
                overrides = [f"steps={args.steps}", f"eval.every={args.eval_every}", f"run.seed={seed}", "log.tensorboard=false",
                             "run.checkpoint_every=0", teacher_eval, *args.overrides,
                             *method_overrides(method, args.steps, tasks, args.intervene_below, args.support_below,
                                               args.privileged, base.rollout.max_turns)]  # fmt: skip
                specs.append({"env": env, "method": method, "seed": seed, "overrides": overrides,
                              "run_dir": str(work / "runs" / name), "result": str(work / "results" / f"{name}.json")})  # fmt: skip
    return specs


STOPPED = 3  # a worker's exit code: its run was stopped with a checkpoint, and the next launch continues it
SECONDS = "quality_seconds"  # a run's seconds so far, across the launches that played it
_running: set[subprocess.Popen] = set()
_stopping = threading.Event()


def stop_runs() -> None:
    """Stop every run now playing as Ctrl-C does (each finishes its step and checkpoints it) and launch no more: a GPU
    call about to end keeps its runs' progress, which the next call's launch continues (`run(resume=True)`) where the
    run directories are still there (a machine still warm keeps --work)."""
    _stopping.set()
    for proc in list(_running):
        proc.send_signal(signal.SIGINT)


def launch(spec: dict, report_only: bool = False) -> dict | None:
    """A run's result: the one already under --work, else the run played in a worker process, continued from its
    checkpoint where an earlier launch was stopped (None when it failed or was stopped, or with `report_only`)."""
    out = Path(spec["result"])
    if out.exists():
        return json.loads(out.read_text())
    if report_only:
        print(f"missing {out.name}: not run (--report-only)", flush=True)
        return None
    log = Path(spec["run_dir"] + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if _stopping.is_set():
        return None
    with log.open("a") as f:  # a continued run's log follows its first part
        proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], stdout=f, stderr=subprocess.STDOUT, env=env)
        _running.add(proc)
        if _stopping.is_set():  # stop_runs() came between the check above and the start
            proc.send_signal(signal.SIGINT)
        code = proc.wait()
        _running.discard(proc)
    if code == STOPPED or (code != 0 and _stopping.is_set()):  # stopped before its first step: started over next time
        print(f"stopped {Path(spec['run_dir']).name}" + (" with a checkpoint: the next launch continues it" if code == STOPPED else ""),
              flush=True)  # fmt: skip
        return None
    if code != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-25:])  # a GPU machine's log does not come back
        print(f"FAILED {Path(spec['run_dir']).name} (exit {code}): see {log}; its last lines:\n{tail}", flush=True)
        return None
    result = json.loads(out.read_text())
    print(f"done {Path(spec['run_dir']).name}: success {result['curve'][-1]['success']:.0%} in {result['seconds']:.0f} s", flush=True)
    return result


def sweep(args: argparse.Namespace) -> list[dict]:
    (args.work / "results").mkdir(parents=True, exist_ok=True)
    specs = plan_runs(args)
    with ThreadPoolExecutor(args.jobs) as pool:
        return [r for r in pool.map(lambda spec: launch(spec, args.report_only), specs) if r is not None]


def _pm(values: list[float], fmt: str = "{:.0%}") -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.fmean(values))} ± {fmt.format(statistics.stdev(values))}"


def final_flops(run: dict, key: str) -> float | None:
    """A run's FLOPs (`teacher_flops` | `student_flops`) at its last eval; None for a result from before they were logged."""
    return run["curve"][-1].get(key) if run["curve"] else None


def success_at(curve: list[dict], key: str, budget: float) -> float | None:
    """Held-out success where the run had spent `budget` of `key` (linear between its eval points); None past its last
    point or where the curve has no such key."""
    points = [(p[key], p["success"]) for p in curve if key in p]
    if not points or budget > points[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= budget <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (budget - x0) / (x1 - x0)
    return points[0][1]


CHEAP_TEACHER = 0.25  # a run whose teacher spent under this share of the largest spend does not set the budget


def teacher_budget(runs: list[dict]) -> float | None:
    """The equal-teacher-FLOPs budget: the smallest final teacher spend among the runs that spent any, leaving out
    runs whose teacher cost far less (under CHEAP_TEACHER of the largest spend: a student scoring itself, privileged
    self-distillation), which would put every other curve's reading at its first eval."""
    spent = [f for r in runs if (f := final_flops(r, "teacher_flops"))]
    return min(f for f in spent if f >= CHEAP_TEACHER * max(spent)) if spent else None


SHARES = (0.25, 0.5, 1.0)  # of the teacher budget: where the equal-teacher-FLOPs table reads each curve


def _flops(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{statistics.fmean(known):.2e}" if known else "-"


def template_counts(env: str, overrides: list[str]) -> dict[str, int]:
    """How many tasks of each template the eval sample holds (the same sample in every run and every eval)."""
    from collections import Counter

    from agentopd.config import load_config
    from agentopd.plan import Mixture

    cfg = load_config(env, overrides=overrides)
    mixture = Mixture.from_config(cfg)
    (source,) = mixture.sources
    tasks = [mixture.task(source, p.spec.task_id, "eval") for p in mixture.eval_plan(0, num_tasks=cfg.eval.num_tasks, seed=0)]
    return Counter((t.data or {}).get("template") or t.id.split(":")[0] for t in tasks if t is not None)


def report(results: list[dict], args: argparse.Namespace, png: Path | None) -> str:
    by = defaultdict(list)
    for r in results:
        by[r["env"], r["method"]].append(r)
    lines = []
    for env in args.env:
        teacher = [r["teacher_success"] for r in results if r["env"] == env and r["teacher_success"] is not None]
        lines += [f"## {env}" + (f" (teacher: {statistics.fmean(teacher):.0%})" if teacher else ""), ""]
        methods = [m for m in args.methods if by[env, m]]
        steps = [p["step"] for p in by[env, methods[0]][0]["curve"]] if methods else []
        lines += ["| method | seeds | " + " | ".join(f"step {s}" for s in steps)
                  + " | student tokens | teacher scored | teacher generated | teacher FLOPs | student FLOPs | wall s |",
                  "|---|---|" + "---|" * (len(steps) + 6)]  # fmt: skip
        for m in methods:
            runs = by[env, m]
            cells = [_pm([r["curve"][i]["success"] for r in runs if i < len(r["curve"])]) for i in range(len(steps))]
            last = [r["curve"][-1]["tokens"] for r in runs]
            lines.append(f"| {m} | {len(runs)} | " + " | ".join(cells) + f" | {statistics.fmean(last):,.0f} | "
                         f"{statistics.fmean(r['teacher_scored'] for r in runs):,.0f} | {statistics.fmean(r['teacher_generated'] for r in runs):,.0f} | "
                         f"{_flops([final_flops(r, 'teacher_flops') for r in runs])} | {_flops([final_flops(r, 'student_flops') for r in runs])} | "
                         f"{statistics.fmean(r['seconds'] for r in runs):.0f} |")  # fmt: skip
        budget = teacher_budget([r for m in methods for r in by[env, m]])
        if budget is not None:
            lines += ["", f"Held-out success at equal teacher FLOPs (budget B = {budget:.2e}, the smallest final teacher spend of a "
                          f"run, runs whose teacher spent under {CHEAP_TEACHER:g} of the largest spend left out; each curve read "
                          "linearly between its eval points; - where a run stopped short of it):", "",
                      "| method | " + " | ".join(f"{share:g} B" for share in SHARES) + " |", "|---|" + "---|" * len(SHARES)]  # fmt: skip
            for m in methods:
                cells = []
                for share in SHARES:
                    at = [success_at(r["curve"], "teacher_flops", share * budget) for r in by[env, m]]
                    cells.append(_pm([a for a in at if a is not None]))
                lines.append(f"| {m} | " + " | ".join(cells) + " |")
        templates = sorted({t for m in methods for r in by[env, m] for t in r["per_template"]})
        counts = template_counts(env, args.overrides)
        lines += ["", (f"Last eval (step {steps[-1] if steps else '-'}), success per template (its eval tasks in brackets) and recovery "
                       "(success among the episodes with a tool error; mean over seeds):"), "",
                  "| method | " + " | ".join(f"{t} ({counts[t]})" for t in templates) + " | error episodes | recovered |",
                  "|---|" + "---|" * (len(templates) + 2)]  # fmt: skip
        for m in methods:
            runs = by[env, m]
            cells = [_pm([r["per_template"][t] for r in runs if t in r["per_template"]]) for t in templates]
            recovered = [r["recovered"] for r in runs if r["recovered"] is not None]
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {statistics.fmean(r['error_episodes'] for r in runs):.1f} | {_pm(recovered)} |")
        rates = [(m, [r["intervene_rate"] for r in by[env, m] if r["intervene_rate"] is not None]) for m in methods]
        for m, values in rates:
            if values:
                lines += ["", f"{m}: the teacher replaced {statistics.fmean(values):.1%} of the student's training turns (mean over steps and seeds)."]
        lines.append("")
    if png is not None:
        lines += [f"![success vs student tokens (top) and teacher FLOPs (bottom)]({png.name})", ""]
    return "\n".join(lines)


def plot(results: list[dict], envs: list[str], methods: list[str], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(envs), figsize=(6 * len(envs), 9), squeeze=False)
    for row, (key, label) in enumerate((("tokens", "student tokens trained on"), ("teacher_flops", "teacher FLOPs spent"))):
        for ax, env in zip(axes[row], envs):
            _plot_env(ax, [r for r in results if r["env"] == env], methods, key)
            ax.set_title(env)
            ax.set_xlabel(label)
            ax.set_ylabel("held-out success")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def _plot_env(ax, results: list[dict], methods: list[str], key: str) -> None:
    """Each method's mean curve (+- std band) against `key`; against teacher FLOPs, the methods that spent none
    (grpo) or ran before FLOPs were logged are left out."""
    for m in methods:
        runs = [r for r in results if r["method"] == m]
        if not runs or any(not final_flops(r, key) for r in runs if key != "tokens"):
            continue
        n = min(len(r["curve"]) for r in runs)
        x = [statistics.fmean(r["curve"][i][key] for r in runs) for i in range(n)]
        ys = [[r["curve"][i]["success"] for r in runs] for i in range(n)]
        mean = [statistics.fmean(y) for y in ys]
        std = [statistics.stdev(y) if len(y) > 1 else 0.0 for y in ys]
        ax.plot(x, mean, marker="o", label=m)
        ax.fill_between(x, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)], alpha=0.15)
    teacher = [r["teacher_success"] for r in results if r["teacher_success"] is not None]
    if teacher:
        ax.axhline(statistics.fmean(teacher), color="black", linestyle="--", linewidth=1, label="teacher")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--env", action="append", help="an env or preset; repeat for several (default: sql_db_explore)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--intervene-below", type=float, default=-1.0, help="recipe.intervene_below of opd_intervene")
    ap.add_argument("--support-below", type=float, default=0.3, help="recipe.turn_support_below of opd_turn_weights")
    ap.add_argument("--privileged", default="solution", choices=("solution", "schema"),
                    help="teacher.privileged of opd_self_privileged and opd_privileged")
    ap.add_argument("--work", type=Path, default=Path("runs/quality"), help="run directories and per-run results")
    ap.add_argument("--out", type=Path, help="the markdown report (a PNG is written next to it)")
    ap.add_argument("--report-only", action="store_true", help="run nothing: report the results already under --work")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. run.device=cuda")
    args = ap.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        Path(spec["result"]).write_text(json.dumps(run_one(spec)))
        return
    args.env = args.env or ["sql_db_explore"]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        ap.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    t0 = time.perf_counter()
    results = sweep(args)
    png = args.out.with_suffix(".png") if args.out else None
    if png is not None and results:
        try:
            plot(results, args.env, args.methods, png)
        except ImportError as e:  # the tables still get written (the runs are kept under --work either way)
            print(f"no plot: {e} (pip install matplotlib)", file=sys.stderr)
            png = None
    import torch

    command = " ".join(["python benchmarks/quality.py", *(f"--env {e}" for e in args.env), f"--methods {','.join(args.methods)}",
                        f"--seeds {args.seeds}", f"--steps {args.steps}", f"--eval-every {args.eval_every}",
                        f"--intervene-below {args.intervene_below}", f"--support-below {args.support_below}", f"--privileged {args.privileged}",
                        *args.overrides])  # fmt: skip
    head = (f"# Quality: OPD recipes vs SFT vs GRPO at equal student tokens and equal teacher FLOPs\n\n`{command}`\n\n"
            f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
            f"{len(results)} runs, {args.jobs} at a time, {time.perf_counter() - t0:.0f} s.\n\n")  # fmt: skip
    text = head + report(results, args, png)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
