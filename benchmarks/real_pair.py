"""Does on-policy distillation beat SFT on a real pretrained pair? Arms on the 2-core CPU, a study that spans stops.

    # seconds per step of each arm first (2 steps each, 2-task evals): the budget is planned from these
    python benchmarks/real_pair.py --measure --env calculator --out ~/real_pair
    # the arms x seeds, one run at a time, each under `flock /tmp/agentopd-bigmem.lock` (the host's memory lock);
    # run it again after a stop: finished runs are skipped, unfinished ones continue from their checkpoint (--resume);
    # on a new machine (no ~/real_pair) the finished runs kept in benchmarks/results/real_pair.json are restored first
    nohup python benchmarks/real_pair.py --env calculator --arms sft,opd --seeds 0,1 --steps 20 --eval-every 10 \
        --out ~/real_pair > ~/real_pair/study.log 2>&1 &
    # the report of what is there: benchmarks/results/real_pair.md + .json (+ .png where matplotlib is installed); the
    # reading written by hand between its NOTES markers is kept when the report is written again
    python benchmarks/real_pair.py --report --env calculator --out ~/real_pair --zero-shot benchmarks/results/real_pair_zero_shot.jsonl

Arms (every one from the same student, the same tasks per step, steps and seeds: about the same student-token budget):

    sft            objective=sft: the teacher plays the step's tasks, cross-entropy on its tokens (sequence-level KD)
    opd            the student plays, the teacher scores every student token (trainer.loss, reverse_kl here)
    sft_then_opd   recipe.sft_steps = a third of the steps, then OPD
    opd_mixed      recipe.teacher_fraction=0.5: the teacher plays half of each step's tasks, the same loss
    xtok_sft       across tokenizers (XPAIR: SmolLM2-135M student): SFT on the teacher's episodes re-rendered in the
                   student's template and tokens (agentopd.crosstok.retokenize)
    xtok_opd       across tokenizers: trainer.loss=xtok_k1 on the student's episodes (only with --arms)
The base student is every run's step-0 eval (greedy, the same held-out tasks for every arm of a seed); the zero-shot
table (benchmarks/real_zero_shot.py, >= 100 tasks) gives both models on every env considered.

Each run is `agentopd run` in a process of its own (its command is in the report), its directory `<out>/runs/<name>`,
its log beside it; a thread stamps each metrics.jsonl record as it appears (`<name>.times.jsonl`: wall seconds per
step, evals included where they fall). A finished run's result is `<out>/results/<name>.json` (curve: step, student
tokens, teacher and student FLOPs, held-out success; seconds per step; peak RSS from /usr/bin/time); its checkpoints
and final/ (GBs) are then removed unless --keep-weights. Runs not finished at a stop keep their last checkpoint
(run.checkpoint_every = --eval-every) and continue from it on the next launch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


quality = _load("quality")  # learning curves, equal-teacher-FLOPs reading, the plot
_measured = _load("_measured")

LOCK = "/tmp/agentopd-bigmem.lock"
ARMS = ("sft", "opd", "sft_then_opd", "opd_mixed")
XTOK_ARMS = ("xtok_sft", "xtok_opd")  # the cross-tokenizer pair (XPAIR): not in the default --arms
RESULTS = _HERE / "results"
HOME = Path(os.environ.get("AGENTOPD_HOME") or "~/.cache/agentopd").expanduser()
# What every run is given (a user's override of the same key, after these, wins): the real pair, the student's
# template for the teacher (the 1.5B's GGUF template differs from the 0.5B's by an escaped brace), a learning rate for
# a pretrained 0.5B (the presets' 3e-3 is the tiny embedded student's), sampling at T=0.7 (at T=1 the 1.5B teacher's
# calculator episodes succeeded 1 time in 8 in the 2-step measure, where it solves 90% greedy: SFT would learn its
# noise), reverse KL on the student's samples (the OPD of the literature), 256 new tokens a turn (the zero-shot's:
# at 128 the teacher's worked answers were cut), 32 engine rows and activation
# checkpointing (the host-memory plan at 22 GiB: train 19.0 GiB where 19.8 fit; without both 20.3 did not), no
# teacher self-test (its pre-flight passed in every 2-step measure run: signal 0.27 nats a token, repeat difference 0;
# its student scorer, 1.2 GiB in the plan's score phase, refused runs at 21 GiB available), and the teacher's eval left
# to the zero-shot table. 2e-5 rather than 1e-5: 20 steps of 4 tasks is a small budget.
PAIR = [f"student={HOME}/gguf/qwen2.5-coder-0.5b", f"teacher={HOME}/gguf/qwen2.5-coder-1.5b", "teacher.chat_template=student"]
# the cross-tokenizer arms: SmolLM2-135M-Instruct (49,152 ids) learns from the same 1.5B teacher (151,936 rows), each in
# its own chat template: xtok_k1 on the student's episodes, or SFT on the teacher's re-rendered in the student's tokens
XPAIR = [f"student={HOME}/gguf/smollm2-135m", f"teacher={HOME}/gguf/qwen2.5-coder-1.5b"]
COMMON = ["trainer.loss=reverse_kl", "trainer.lr=2e-5", "trainer.warmup_steps=2", "trainer.schedule=cosine",
          "rollout.temperature=0.7", "rollout.max_new_tokens=256", "rollout.max_context=2048", "rollout.tasks_per_step=4",
          "rollout.episode_timeout_s=7200", "engine.max_batch_size=32", "trainer.activation_checkpointing=true",
          "teacher.selftest=false", "eval.teacher=false", "eval.num_tasks=100", "log.tensorboard=false", "run.keep_checkpoints=1"]  # fmt: skip
REFUSED = "does not fit this machine's memory"  # agentopd.memory_host.HostMemoryError: the plan refused the run at start
NOTES = ("<!-- notes: kept by --report -->", "<!-- /notes -->")
ENV_KEYS = {"sql_db": ["env.schema_in_prompt=true"]}


def arm_overrides(arm: str, steps: int) -> list[str]:
    return {"sft": ["objective=sft"], "opd": ["objective=opd"],
            "sft_then_opd": ["objective=opd", f"recipe.sft_steps={max(1, steps // 3)}"],
            "opd_mixed": ["objective=opd", "recipe.teacher_fraction=0.5"],
            "xtok_sft": ["objective=sft"], "xtok_opd": ["objective=opd", "trainer.loss=xtok_k1"]}[arm]  # fmt: skip


def plan(args: argparse.Namespace) -> list[dict]:
    """One spec per (arm, seed): its name, run directory, result file and the whole `agentopd run` command."""
    steps, every = (2, 0) if args.measure else (args.steps, args.eval_every)
    folder = args.out / ("measure" if args.measure else ".")
    specs = []
    for seed in args.seeds:
        for arm in args.arms:
            name = f"{args.env}-{arm}-s{seed}-{steps}steps"
            extra = ["eval.num_tasks=2", "run.checkpoint_every=0"] if args.measure else [f"run.checkpoint_every={every}"]
            overrides = [*(XPAIR if arm in XTOK_ARMS else PAIR), *COMMON, *ENV_KEYS.get(args.env, []), f"run.steps={steps}", f"eval.every={every}", f"run.seed={seed}",
                         *extra, *args.overrides, *arm_overrides(arm, steps)]  # fmt: skip
            run_dir = folder / "runs" / name
            cmd = ["agentopd", "run", "--env", args.env, "--run-dir", str(run_dir), *overrides]
            specs.append({"name": name, "arm": arm, "seed": seed, "steps": steps, "eval_every": every, "run_dir": str(run_dir),
                          "result": str(folder / "results" / f"{name}.json"), "command": cmd})  # fmt: skip
    return specs


def _stamp(metrics: Path, times: Path, stop: threading.Event, launch: float) -> None:
    """Append `{"step", "t", "launch"}` to `times` for each metrics.jsonl record as it appears (polled each second)."""
    seen = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    while not stop.wait(1.0):
        if not metrics.exists():
            continue
        lines = metrics.read_text().splitlines()
        if len(lines) < seen:  # a resumed run truncated the records past its checkpoint
            seen = len(lines)
        with times.open("a") as f:
            for line in lines[seen:]:
                try:
                    step = json.loads(line)["step"]
                except (ValueError, KeyError):  # a line being written: read it again next time
                    break
                f.write(json.dumps({"step": step, "t": time.time(), "launch": launch}) + "\n")
                seen += 1


def play(spec: dict, keep_weights: bool, wait_s: float = 120.0, tries: int = 60) -> dict | None:
    """The run's result: the one already written, else the run played (continued from its checkpoint where a launch
    was stopped), under the memory lock. A launch that the run's host-memory plan refused (other work holds memory the
    lock does not guard) is tried again after `wait_s`, `tries` times at most. None when it failed."""
    out, run_dir = Path(spec["result"]), Path(spec["run_dir"])
    if out.exists():
        return json.loads(out.read_text())
    log, times = run_dir.with_suffix(".log"), run_dir.with_suffix(".times.jsonl")
    for attempt in range(1, tries + 1):
        code, said = launch(spec, run_dir, log, times)
        if code == 0 and (run_dir / "final").exists():
            break
        if REFUSED in said and attempt < tries and could_fit(said):
            print(f"{time.strftime('%H:%M:%S')} {spec['name']}: the memory plan refused it (other work holds memory); "
                  f"again in {wait_s:.0f} s", flush=True)  # fmt: skip
            time.sleep(wait_s)
            continue
        tail = "".join(said.splitlines(keepends=True)[-20:])
        print(f"FAILED or stopped {spec['name']} (exit {code}): {log}\n{tail}", flush=True)
        return None
    result = summarise(spec, run_dir, log, times)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if not keep_weights:
        for heavy in ("checkpoints", "final"):
            shutil.rmtree(run_dir / heavy, ignore_errors=True)
    print(f"{time.strftime('%H:%M:%S')} done {spec['name']}: success {result['curve'][-1]['success']:.0%}", flush=True)
    return result


def could_fit(said: str) -> bool:
    """Whether a run the host plan refused would fit this machine once other work is gone: its worst phase's need
    (the refusal's "needs X GiB") within the plan's headroom of all the memory (MemTotal), not only of what is free
    now. A run that can never fit is reported at once instead of being tried again `tries` times."""
    from agentopd.memory_host import HEADROOM

    need = re.search(r"needs ([0-9.]+) GiB", said)
    total = re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text())
    return need is None or total is None or float(need.group(1)) <= HEADROOM * int(total.group(1)) / 2**20


def launch(spec: dict, run_dir: Path, log: Path, times: Path) -> tuple[int, str]:
    """One `agentopd run` of the spec, continued from its last checkpoint where there is one; its exit code and what it
    printed."""
    from agentopd.rundir import RunDir

    resume = run_dir.exists() and RunDir(run_dir).latest_checkpoint() is not None
    if not resume and run_dir.exists():  # stopped before its first checkpoint: nothing to continue
        shutil.rmtree(run_dir)
    log.parent.mkdir(parents=True, exist_ok=True)
    if not resume:
        times.unlink(missing_ok=True)
    timer = ["/usr/bin/time", "-v"] if Path("/usr/bin/time").exists() else []  # its peak RSS, at the end of the log
    cmd = ["flock", LOCK, *timer, *spec["command"], *(["--resume"] if resume else [])]
    print(f"{time.strftime('%H:%M:%S')} {'resume' if resume else 'start'} {spec['name']}", flush=True)
    stop = threading.Event()
    stamper = threading.Thread(target=_stamp, args=(run_dir / "metrics.jsonl", times, stop, time.time()), daemon=True)
    stamper.start()
    start = log.stat().st_size if log.exists() else 0
    with log.open("a") as f:
        f.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
        f.flush()
        code = subprocess.run(cmd, check=False, stdout=f, stderr=subprocess.STDOUT).returncode
    stop.set()
    stamper.join()
    with log.open(errors="replace") as f:
        f.seek(start)
        return code, f.read()


def peak_gb(rss_kb: list[int], records: list[dict]) -> float | None:
    """The run's peak resident memory, GB: the largest of `/usr/bin/time -v`'s maximum resident set sizes (kB) and the
    per-phase peaks the run logs (`mem/<phase>_host_peak_gib`). A run resets its high-water mark at each phase, so
    time's figure alone is only the last phase's (agentopd.step.phases)."""
    phases = [v * 2**30 / 1e9 for r in records for k, v in r.items() if k.startswith("mem/") and k.endswith("_host_peak_gib")]
    found = [kb / 1e6 for kb in rss_kb] + phases
    return max(found) if found else None


def summarise(spec: dict, run_dir: Path, log: Path, times: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/success_rate" in r]
    curve, _ = quality.learning_curve(records, evals)
    stamps = {}
    for line in times.read_text().splitlines() if times.exists() else []:
        s = json.loads(line)
        stamps[s["step"]] = s  # a replayed step's last stamp
    eval_steps = {e["step"] for e in evals}
    # wall seconds of a step: from the record before it, in the same launch; steps with an eval, step 1 (the teacher's
    # self-test) and a launch's first step (model loading) are left out of the per-step figure
    walls = {s: stamps[s]["t"] - stamps[s - 1]["t"] for s in stamps if s - 1 in stamps and stamps[s]["launch"] == stamps[s - 1]["launch"]}
    plain = [w for s, w in walls.items() if s > 1 and s not in eval_steps]
    phases = {k: statistics.fmean(r[k] for r in records if k in r and r["step"] > 1) if any(k in r and r["step"] > 1 for r in records) else None
              for k in ("perf/rollout_s", "perf/teacher_s", "perf/train_step_s", "perf/weight_sync_s")}  # fmt: skip
    rss = [int(m) for m in re.findall(r"Maximum resident set size \(kbytes\): (\d+)", log.read_text(errors="replace"))]
    step_phases = {r["step"]: sum(r.get(k, 0.0) for k in phases) for r in records if "perf/rollout_s" in r}
    return {
        "arm": spec["arm"], "seed": spec["seed"], "steps": spec["steps"], "curve": curve,
        "step_s": statistics.median(plain) if plain else None, "step_walls": {str(s): w for s, w in walls.items()}, "phases": phases,
        # an eval step's wall less its own step's phases (a median of other steps was contended differently: a step-10
        # eval of one resumed run came out at -33 s)
        "eval_s": [walls[s] - step_phases.get(s, 0.0) for s in sorted(eval_steps) if s in walls],
        "student_tokens": sum(r.get("train/student_tokens", 0.0) for r in records),
        "teacher_scored": sum(r.get("teacher/scored_tokens", 0.0) for r in records),
        "teacher_generated": sum(r.get("teacher/generated_tokens", 0.0) for r in records),
        "kl_turns": kl_by_turn(records), "peak_rss_gb": peak_gb(rss, records), "command": " ".join(spec["command"]),
        "commit": _measured.commit_measured(), "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }  # fmt: skip


def kl_by_turn(records: list[dict]) -> dict[str, dict[str, float]]:
    """The teacher's per-turn KL on the student's tokens (`kl/turn_<k>`, scored steps only), mean over the run's first
    and last fifth of its steps: where the student departs from the teacher, and whether training closed it."""
    scored = [r for r in records if any(k.startswith("kl/turn_") for k in r)]
    if not scored:
        return {}
    n = max(1, len(scored) // 5)
    out = {}
    for part, rows in (("first", scored[:n]), ("last", scored[-n:])):
        turns = sorted({k for r in rows for k in r if k.startswith("kl/turn_")}, key=lambda k: int(k.rsplit("_", 1)[1]))
        out[part] = {k.rsplit("_", 1)[1]: statistics.fmean(r[k] for r in rows if k in r) for k in turns}
    return out


# ---- the report ---------------------------------------------------------------------------------
def _pm(values: list[float], fmt: str = "{:.0%}") -> str:
    return quality._pm([v for v in values if v is not None], fmt)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def zero_shot_table(path: Path | None) -> list[str]:
    if path is None or not path.exists():
        return ["(no zero-shot file given: --zero-shot)"]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lines = ["| model | env | held-out success | tasks | tool calls / turn | parse errors / turn | tool error rate | how episodes ended | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        ended = ", ".join(f"{k} {v}" for k, v in r["stop_reasons"].items())
        lines.append(f"| {r['model']} | {r['env']} | {r['success']:.0%} | {r['tasks']} | {r['tool_calls_per_turn']:.2f} | "
                     f"{r['parse_errors_per_turn']:.2f} | {r['tool_error_rate']:.0%} | {ended} | {r['seconds']:.0f} |")  # fmt: skip
    return lines


def measure_table(results: list[dict]) -> list[str]:
    """Step 2's phases (step 1 holds the teacher's self-test and first-call warm-ups; its wall time beside them)."""
    lines = ["| arm | step 2: rollout s | teacher s | train s | sync s | sum s | step 1 wall s | peak RSS GB | student tokens / step | "
             "teacher tokens scored / step | teacher tokens generated / step |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        p, n = r["phases"], r["steps"]
        total = sum(v for v in p.values() if v is not None)
        lines.append(f"| {r['arm']} | {_s(p['perf/rollout_s'])} | {_s(p['perf/teacher_s'])} | {_s(p['perf/train_step_s'])} | "
                     f"{_s(p['perf/weight_sync_s'])} | {_s(total)} | {_s(r['step_walls'].get('1'))} | {_s(r['peak_rss_gb'])} | "
                     f"{r['student_tokens'] / n:,.0f} | {r['teacher_scored'] / n:,.0f} | {r['teacher_generated'] / n:,.0f} |")  # fmt: skip
    return lines


def arms_table(results: list[dict], arms: list[str]) -> list[str]:
    by = {a: [r for r in results if r["arm"] == a] for a in arms}
    by = {a: rs for a, rs in by.items() if rs}
    if not by:
        return ["(no finished run yet)"]
    steps = sorted({p["step"] for rs in by.values() for r in rs for p in r["curve"]})
    lines = ["| arm | seeds | " + " | ".join(f"step {s}" for s in steps) + " | student tokens | teacher FLOPs | s / step | wall min |",
             "|---|---|" + "---|" * (len(steps) + 4)]  # fmt: skip
    for a, rs in by.items():
        cells = [_pm([next((p["success"] for p in r["curve"] if p["step"] == s), None) for r in rs]) for s in steps]
        walls = [sum(w for w in r["step_walls"].values()) / 60 for r in rs]
        lines.append(f"| {a} | {','.join(str(r['seed']) for r in rs)} | " + " | ".join(cells) + f" | {statistics.fmean(r['student_tokens'] for r in rs):,.0f} | "
                     f"{quality._flops([quality.final_flops(r, 'teacher_flops') for r in rs])} | "
                     f"{_s(statistics.fmean(r['step_s'] for r in rs if r['step_s']) if any(r['step_s'] for r in rs) else None)} | {statistics.fmean(walls):.0f} |")  # fmt: skip
    for pair, members in (("the same-tokenizer pair", [a for a in by if a not in XTOK_ARMS]),
                          ("the cross-tokenizer pair (XPAIR)", [a for a in by if a in XTOK_ARMS])):  # fmt: skip
        budget = quality.teacher_budget([r for a in members for r in by[a]])  # each pair's own: its teacher's spend
        if not budget:
            continue
        lines += ["", f"At equal teacher FLOPs, {pair} (B = {budget:.2e}, the smallest final teacher spend of its arms; each "
                      "curve read linearly between its eval points):", "", "| arm | " + " | ".join(f"{s:g} B" for s in quality.SHARES) + " |",
                  "|---|" + "---|" * len(quality.SHARES)]  # fmt: skip
        for a in members:
            lines.append(f"| {a} | " + " | ".join(_pm([quality.success_at(r["curve"], "teacher_flops", s * budget) for r in by[a]])
                                                  for s in quality.SHARES) + " |")  # fmt: skip
    return lines


def kl_table(results: list[dict]) -> list[str]:
    rows = [r for r in results if r.get("kl_turns")]
    if not rows:
        return []
    turns = sorted({t for r in rows for part in r["kl_turns"].values() for t in part}, key=int)
    lines = ["Per-turn KL (`kl/turn_<k>`, the teacher's scoring of the student's tokens, nats a token; mean over the first and "
             "last fifth of the scored steps):", "", "| arm | seed | " + " | ".join(f"turn {t} first -> last" for t in turns) + " |",
             "|---|---|" + "---|" * len(turns)]  # fmt: skip
    for r in rows:
        cells = [f"{_s3(r['kl_turns']['first'].get(t))} -> {_s3(r['kl_turns']['last'].get(t))}" for t in turns]
        lines.append(f"| {r['arm']} | {r['seed']} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _s3(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _without_run_dir(command: list[str]) -> list[str]:
    i = command.index("--run-dir") if "--run-dir" in command else len(command)
    return command[:i] + command[i + 2 :]


def restore(bundle: Path, env: str, out: Path, specs: list[dict] | None = None) -> list[str]:
    """The finished runs the committed report keeps (`bundle`, real_pair.json) written back as result files where `out`
    has none: on a new machine the study's folder is gone, and its finished runs are not run again. With `specs` (a
    study), only a run whose recorded command is its spec's, the run folder aside (a changed arm runs anew); without
    (a report), every one. The names restored."""
    if not bundle.exists():
        return []
    data = json.loads(bundle.read_text())
    if data.get("env") != env:
        return []
    wanted = {s["name"]: _without_run_dir(s["command"]) for s in specs or []}
    restored = []
    for kind, entries in (("measure", data.get("measure", [])), (".", data.get("runs", []))):
        for entry in entries:
            command = entry["command"].split()
            name = Path(command[command.index("--run-dir") + 1]).name
            target = out / kind / "results" / f"{name}.json"
            if target.exists() or (specs is not None and wanted.get(name) != _without_run_dir(command)):
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(entry, indent=1))
            restored.append(name)
    return restored


def report(args: argparse.Namespace) -> None:
    import torch

    if restored := restore(args.report.with_suffix(".json"), args.env, args.out):
        print(f"restored from {args.report.with_suffix('.json')}: {', '.join(restored)}")

    load = lambda folder: [json.loads(p.read_text()) for p in sorted((folder / "results").glob(f"{args.env}-*.json"))]
    measured, results = load(args.out / "measure"), [r for r in load(args.out) if r["arm"] in args.arms]
    png: Path | None = args.report.with_suffix(".png")
    try:
        quality.plot([{**r, "env": args.env, "method": r["arm"], "teacher_success": None} for r in results], [args.env], list(args.arms), png)
    except ImportError as e:
        print(f"no png: {e}", file=sys.stderr)
        png = None
    common = " ".join([*COMMON, *ENV_KEYS.get(args.env, [])])
    lines = [f"# Does OPD beat SFT on a real pair? Qwen2.5-Coder-0.5B-Instruct <- 1.5B-Instruct, {args.env}", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; report written "
             f"{time.strftime('%Y-%m-%d')} at {_measured.commit_measured()}. Every run, after `{' '.join(PAIR).replace(str(HOME), '$AGENTOPD_HOME')}`: `{common}`, "
             "then its arm's keys (benchmarks/real_pair.py). Timings contended where other work shared the 2 cores.", "",
             "## Zero-shot (greedy, real_zero_shot.py)", "", *zero_shot_table(args.zero_shot), "",
             "## Seconds per step (2-step runs, `--measure`: 2-task evals, the settings of the commands at the end)", "", *measure_table(measured), "",
             f"## Arms ({args.env}, held-out success at each eval; mean ± std over seeds)", "", *arms_table(results, list(args.arms)), "",
             *kl_table(measured + results)]  # fmt: skip
    if png is not None and results:
        lines += [f"![held-out success vs student tokens and teacher FLOPs]({png.name})", ""]
    elif png is None:
        lines += ["(no png: matplotlib is not installed in this venv)", ""]
    lines += ["## Commands", "", "```", *sorted({r["command"].replace(str(HOME), "$AGENTOPD_HOME") for r in measured + results}), "```", ""]
    # the hand-written reading between the NOTES markers of the report being replaced is kept, after the title
    old = args.report.read_text() if args.report.exists() else ""
    notes = old[old.index(NOTES[0]) : old.index(NOTES[1]) + len(NOTES[1])] if NOTES[0] in old and NOTES[1] in old else f"{NOTES[0]}\n{NOTES[1]}"
    lines[1:1] = ["", notes]
    args.report.write_text("\n".join(lines))
    bundle = {"env": args.env, "zero_shot": [json.loads(x) for x in args.zero_shot.read_text().splitlines() if x.strip()] if args.zero_shot and args.zero_shot.exists() else [],
              "measure": measured, "runs": results}  # fmt: skip
    args.report.with_suffix(".json").write_text(json.dumps(bundle, indent=1))
    print(f"wrote {args.report}, {args.report.with_suffix('.json').name}" + (f", {png.name}" if png and results else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", default="calculator")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("~/real_pair").expanduser(), help="run directories and results (outside the repo)")
    ap.add_argument("--measure", action="store_true", help="2 steps of each arm (seed 0), 2-task evals: seconds per step")
    ap.add_argument("--report", type=Path, nargs="?", const=RESULTS / "real_pair.md", help="write the report (default benchmarks/results/real_pair.md); run nothing")
    ap.add_argument("--zero-shot", type=Path, default=RESULTS / "real_pair_zero_shot.jsonl")
    ap.add_argument("--keep-weights", action="store_true", help="keep a finished run's checkpoints and final/")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--no-restore", action="store_true", help="run what --out has not finished even where the committed "
                    "report keeps a run of the same command (the code changed, not the command: the cross-tokenizer "
                    "arms' second round after 77bc226's tool block)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every run (after the script's own)")
    args = ap.parse_args()
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(args.arms) - set(ARMS) - set(XTOK_ARMS))
    if unknown:
        ap.error(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS + XTOK_ARMS)}")
    args.seeds = [0] if args.measure else [int(s) for s in args.seeds.split(",") if s]
    args.out = args.out.expanduser()
    if args.report:
        report(args)
        return
    specs = plan(args)
    if args.dry_run:
        print("\n".join(" ".join(s["command"]) for s in specs))
        return
    if not args.no_restore and (restored := restore(RESULTS / "real_pair.json", args.env, args.out, specs)):
        print(f"finished runs restored from {RESULTS / 'real_pair.json'} (not run again): {', '.join(restored)}", flush=True)
    t0 = time.monotonic()
    done = [r for s in specs if (r := play(s, args.keep_weights)) is not None]
    print(f"{len(done)} of {len(specs)} runs finished in {time.monotonic() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
