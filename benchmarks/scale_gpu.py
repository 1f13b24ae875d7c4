"""The whole OPD loop on the Ray backend at 1-8 GPUs (issue 35): Qwen3 shapes with random weights and Qwen3's real
vocabulary, sql_db episodes of up to 4 turns; sync vs async, scaling, and faults at scale. One command per
measurement; on a machine lent for 10-minute calls add `--budget 480` (the install takes the rest).

    agentopd make-tokenizer qwen3 TOK --template agentopd          # once, where the real-vocab extra is installed
    python benchmarks/scale_gpu.py --tokenizer TOK --layout 2gpu --mode sync,async1 --out /tmp/s    # sync vs async
    python benchmarks/scale_gpu.py --tokenizer TOK --layout 4gpu --mode sync,async1,async2 --out /tmp/s
    python benchmarks/scale_gpu.py --tokenizer TOK --scaling --shapes 0.6b,1.7b --out /tmp/s  # every layout that fits
    python benchmarks/scale_gpu.py --tokenizer TOK --scaling --out /tmp/s   # on a CPU machine: the four plans alone
    python benchmarks/scale_gpu.py --tokenizer TOK --layout 4gpu --fault rollout --out /tmp/s   # a rollout worker killed
    python benchmarks/scale_gpu.py --tokenizer TOK --layout 8gpu --fault teacher --out /tmp/s   # a teacher replica killed
    python benchmarks/scale_gpu.py --tiny --mode sync,async1 --fault rollout --out /tmp/x       # CPU, toy sizes
    python benchmarks/scale_gpu.py ... trainer.micro_batch_tokens=16384   # extra key=value overrides go to every run

Layouts (LAYOUTS; ray.* keys on top of configs/examples/qwen3-2gpu.yaml, docs/guides/gpu.md section 6):
- 1gpu: trainer 0.5, rollout worker 0.25, teacher 0.25 of one GPU (weights over CUDA IPC);
- 2gpu: trainer on GPU 0; rollout worker and teacher share GPU 1 (the example as written);
- 4gpu: two FSDP2 trainer ranks (GPUs 0-1); on GPUs 2 and 3 a rollout worker and a teacher replica each (the 2gpu
  layout's GPU 1, twice: agentopd.backends.placement pairs them bundle by bundle);
- 8gpu: four trainer ranks (GPUs 0-3); on GPUs 4-7 a rollout worker and a teacher replica each;
- 4gpu-apart, 8gpu-apart: the roles on GPUs of their own: two trainer ranks, a rollout worker, the teacher (GPUs 0-1,
  2, 3); four ranks, two rollout workers, two teacher replicas (0-3, 4-5, 6-7). In sync mode a GPU idles while the
  other role's phase runs (4gpu-apart measured 62% of 2gpu's episodes/s per GPU); in async mode the roles overlap.
The student is 1.7B-shaped and the teacher 8B-shaped (bf16) unless `--shapes` says otherwise (0.6b,1.7b fits a
10-minute call more easily); the models are built by benchmarks/memory_gpu.py (cached under /tmp/memory_gpu).
Each step plays `--tasks` tasks x 8 per 2 GPUs: tasks_per_step scales with the layout's rollout GPUs (a quarter of
its GPUs), so every layout does the same work per GPU. Random weights rarely emit a well-formed tool call, so
episodes end after ~1 turn (num_turns/mean in the report says how many they took).

Before each run `agentopd plan-memory` prints the plan per GPU (for the layout's GPU count where the machine has
fewer: that layout is then not run); a layout the plan refuses is not run either. Each run is a process of its own
(benchmarks/_scale_run.py), stopped once its last step is logged (the resumable checkpoint and the final export
that follow are not measured: ~20 GiB written at 1.7B) or after `--timeout` seconds with the steps it finished; `--budget S` bounds the whole command
(a device call's limit less the install): each run stops 20 s before it, and one with under a minute left is not
started, so the report is always written. Measured per run, over the steps after
the first (which compiles and captures CUDA graphs): episodes/s and sampled student tokens/s per GPU, seconds per
phase (perf/rollout_s, perf/teacher_s, perf/train_step_s, perf/weight_sync_s and the NCCL broadcast's share; in async
mode rollout and teacher seconds are what the driver waited, the share of episodes scored ahead is `async/scored_ahead`), the
GPU busy share per role (nvidia-smi every 200 ms; roles mapped to GPUs by the GPU ids Ray gave each actor; not on
CPU) and, in sync mode, each GPU's peak memory per phase beside the plan (mem/gpu<g>_<phase>_*_gib).
`--scaling`: every layout the machine holds, with the episodes/s per GPU relative to the 2gpu layout's.
`--fault rollout|teacher`: a sync run in which the first rollout worker is killed (SIGKILL) once step
`--fault-step`'s first training episode is stored (work items of a quarter of its share, so it dies holding some),
or the first teacher replica `--fault-delay` s into that step's scoring; then each finished step must be logged
once and each of its training episodes stored once and scored (tests/_faults.py `lost_or_duplicated`).
`--tiny`: the same path on the CPU with the toy shapes and the embedded tokenizer, actors without GPUs.

Writes scale_gpu.md, scale_gpu.json (every run's keys, plan, summary, busy shares, fault, metrics; the commit
from AGENTOPD_COMMIT or git) and scale_gpu_log.txt (the runs' output). Exit 1 when a run fails or a fault check does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

from _faults import lost_or_duplicated  # noqa: E402
from _measured import commit_measured  # noqa: E402
from _scale_run import Fault  # noqa: E402
from memory_gpu import SHAPES, build_folder, build_pair, pair_of, plan_table  # noqa: E402

CONFIG = ROOT / "configs" / "examples" / "qwen3-2gpu.yaml"
WORK = Path("/tmp/scale_gpu")
N = 8  # episodes per task (rollout.n)
PENDING = "pending"  # a Run's exit before it ran: planned, fits, the machine holds it


@dataclass(frozen=True)
class Layout:
    """The roles on `gpus` GPUs of one node: (actors, GPU share each) per role."""

    gpus: int
    trainer: tuple[int, float]
    rollout: tuple[int, float]
    teacher: tuple[int, float]

    def keys(self, cpu: bool) -> list[str]:
        (t, tg), (r, rg), (q, qg) = self.trainer, self.rollout, self.teacher
        shares = [f"ray.gpus_per_trainer_worker={0 if cpu else tg}", f"ray.gpus_per_rollout_worker={0 if cpu else rg}",
                  f"ray.gpus_per_teacher={0 if cpu else qg}"]  # fmt: skip
        return [f"ray.trainer_workers={t}", f"ray.rollout_workers={r}", f"ray.teacher_replicas={q}", *shares]

    @property
    def rollout_gpus(self) -> float:
        return self.rollout[0] * self.rollout[1]


LAYOUTS = {
    "1gpu": Layout(1, trainer=(1, 0.5), rollout=(1, 0.25), teacher=(1, 0.25)),
    "2gpu": Layout(2, trainer=(1, 1.0), rollout=(1, 0.5), teacher=(1, 0.5)),
    "4gpu": Layout(4, trainer=(2, 1.0), rollout=(2, 0.5), teacher=(2, 0.5)),
    "8gpu": Layout(8, trainer=(4, 1.0), rollout=(4, 0.5), teacher=(4, 0.5)),
    "4gpu-apart": Layout(4, trainer=(2, 1.0), rollout=(1, 1.0), teacher=(1, 1.0)),
    "8gpu-apart": Layout(8, trainer=(4, 1.0), rollout=(2, 1.0), teacher=(2, 1.0)),
}

SIZES = {"rollout.n": N, "rollout.max_turns": 4, "rollout.max_new_tokens": 512, "rollout.max_context": 4096, "eval.num_tasks": 8}
TINY = {"rollout.n": 2, "rollout.max_turns": 3, "rollout.max_new_tokens": 32, "rollout.max_context": 1024, "eval.num_tasks": 2,
        "run.device": "cpu", "trainer.compile": "false", "ray.num_cpus": 2, "ray.cpus_per_rollout_worker": 0,
        "ray.cpus_per_teacher": 0, "ray.cpus_per_trainer_worker": 0}  # fmt: skip


class Mode(StrEnum):
    SYNC = "sync"
    ASYNC1 = "async1"  # async.max_staleness=1
    ASYNC2 = "async2"

    def keys(self) -> list[str]:
        if self is Mode.SYNC:
            return ["async.enabled=false"]
        return ["async.enabled=true", f"async.max_staleness={self.value[-1]}"]


@dataclass
class Run:
    """One measured run: what ran, its plan, and what it measured (a row of the report)."""

    layout: str
    mode: Mode
    fault: Fault | None
    keys: list[str]
    per_step: int  # training episodes a step
    plan: str = ""
    exit: str = "not run"
    wall_s: float = 0.0
    summary: dict = field(default_factory=dict)
    busy: dict = field(default_factory=dict)  # per GPU and per role (nvidia-smi)
    child: dict = field(default_factory=dict)  # the child's record: step end times, actors, the fault
    wrong: list[str] = field(default_factory=list)  # what a fault run lost or duplicated
    records: list[dict] = field(default_factory=list)  # metrics.jsonl

    @property
    def name(self) -> str:
        return f"{self.layout} {self.mode}" + (f" fault={self.fault}" if self.fault else "")


# ---- the parent: models, plans, runs, report ---------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--layout", default=None, help="comma-separated among " + ", ".join(LAYOUTS) + " (default 2gpu)")
    ap.add_argument("--mode", default=None, help="comma-separated among sync, async1, async2 (default sync; none with --fault)")
    ap.add_argument("--scaling", action="store_true", help="every layout this machine holds (or --layout's), per-GPU rate vs 2gpu")
    ap.add_argument("--fault", type=Fault, choices=list(Fault), help="also a sync run with a rollout worker / teacher replica killed")
    ap.add_argument("--fault-step", type=int, default=2)
    ap.add_argument("--fault-delay", type=float, default=0.5, help="seconds into the scoring before a teacher replica is killed")
    ap.add_argument("--shapes", default="1.7b,8b", help="student,teacher among " + ", ".join(SHAPES))
    ap.add_argument("--tokenizer", type=Path, help="a tokenizer folder (`agentopd make-tokenizer qwen3 DIR --template agentopd`)")
    ap.add_argument("--steps", type=int, help="steps per run (the first is not timed; default 4, 3 with --tiny)")
    ap.add_argument("--tasks", type=int, default=16, help=f"tasks per step per 2 GPUs (x{N} episodes), scaled with the layout")
    ap.add_argument("--turns", type=int, default=SIZES["rollout.max_turns"], help="rollout.max_turns")
    ap.add_argument("--timeout", type=float, help="stop each run after this many seconds and report the steps it finished")
    ap.add_argument("--budget", type=float, help="seconds for the whole command (models included): each run stops in time for "
                    "the report, and one with under a minute left is not started")
    ap.add_argument("--tiny", action="store_true", help="toy shapes, the embedded tokenizer, CPU actors (smoke test)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides of every run")
    args = ap.parse_args()
    if args.out is None:
        sys.exit("--out DIR")
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # Ray's GPU ids in nvidia-smi's order (the busy shares' roles)
    gpus = _gpus()
    names = [n.strip() for n in (args.layout or ("1gpu,2gpu,4gpu,8gpu" if args.scaling else "2gpu")).split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or not names:
        ap.error(f"--layout {args.layout!r}: unknown layout(s) {', '.join(unknown) or '(none given)'}; choose among {', '.join(LAYOUTS)}")
    if args.tiny and (args.scaling or names != ["2gpu"]):
        ap.error(f"--tiny runs the 2gpu layout alone, with CPU actors (no GPUs to place a {','.join(names)} layout on): "
                 "leave out --layout and --scaling")  # fmt: skip
    tok_dir, *pair = pair_of(args, make="agentopd make-tokenizer qwen3 DIR --template agentopd")
    shapes = tuple(pair)
    if args.tiny:
        args.tasks, args.steps = min(args.tasks, 2), args.steps or 3
    args.steps = args.steps or 4
    modes = [Mode(m) for m in args.mode.split(",")] if args.mode else ([] if args.fault else [Mode.SYNC])
    plan = [(n, m, None) for n in names for m in modes] + [(n, Mode.SYNC, args.fault) for n in names if args.fault]
    t = time.time()
    deadline = t + args.budget if args.budget else None
    # the plans first, from the models' config.json alone (seconds): a layout that cannot fit is known before any build
    configs = {role: build_folder(shape, tok_dir, args.out, config_only=True) for role, shape in zip(("student", "teacher"), shapes)}
    runs = [Run(layout, mode, fault, *_keys(args, LAYOUTS[layout], mode, fault, configs)) for layout, mode, fault in plan]
    for run in runs:
        plan_memory(args, run, gpus)
    if any(r.exit == PENDING for r in runs):
        models = build_pair(*shapes, tok_dir, args.out)
        print(f"models built in {time.time() - t:.0f} s", flush=True)
    with (args.out / "scale_gpu_log.txt").open("w") as log:
        for run in runs:
            if run.exit == PENDING:
                run.keys, _ = _keys(args, LAYOUTS[run.layout], run.mode, run.fault, models)
                measure(args, run, log, deadline)
    write_report(args, runs, shapes, tok_dir, gpus)
    failed = [r for r in runs if r.exit != "0" and not r.exit.startswith(("not run", "stopped")) or r.wrong]
    sys.exit(1 if failed else 0)


def _keys(args: argparse.Namespace, layout: Layout, mode: Mode, fault: Fault | None, models: dict[str, Path]) -> tuple[list[str], int]:
    """The run's overrides on top of CONFIG (models, layout, mode, step sizes: the same work per GPU) and its
    training episodes per step."""
    tasks = max(1, round(args.tasks * layout.rollout_gpus / LAYOUTS["2gpu"].rollout_gpus))
    sizes = {**SIZES, "rollout.max_turns": args.turns, **(TINY if args.tiny else {})}
    per_step = tasks * sizes["rollout.n"]
    steps = max(args.steps, args.fault_step + 1) if fault else args.steps
    keys = [f"student={models['student']}", f"teacher={models['teacher']}", *layout.keys(cpu=args.tiny), *mode.keys(),
            f"run.steps={steps}", f"rollout.tasks_per_step={tasks}", *(f"{k}={v}" for k, v in sizes.items()),
            "eval.every=0", "eval.teacher=false", "run.checkpoint_every=0", "log.tensorboard=false",
            "teacher.selftest=false"]  # fmt: skip  # random weights are a uniform teacher: the self-test would refuse them
    if fault:  # work items of a quarter of a worker's share: a worker killed mid-step holds some of them
        keys.append(f"ray.episodes_per_call={max(1, per_step // (4 * layout.rollout[0]))}")
    return [*keys, *args.overrides], per_step


def plan_memory(args: argparse.Namespace, run: Run, gpus: int) -> None:
    """`agentopd plan-memory` of the run, for the layout's GPUs where this machine has fewer (--tiny: the GPU layout
    on two named GPUs); the run stays PENDING only where the plan fits and the machine has the GPUs."""
    layout = LAYOUTS[run.layout]
    cli = [sys.executable, "-m", "agentopd.cli"]
    # the plan per GPU: for the layout's GPUs where this machine has fewer (or none: --tiny plans the GPU layout)
    named = ["--gpus", str(layout.gpus), "--gpu-gib", "80"] if args.tiny or gpus < layout.gpus else []
    gpu_keys = [*layout.keys(cpu=False), "run.device=cuda"] if args.tiny else []
    done = subprocess.run([*cli, "plan-memory", "--env", "sql_db", "--config", str(CONFIG), *run.keys, *gpu_keys, *named],
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    run.plan = (done.stdout + done.stderr).strip()
    print(f"== {run.name}: agentopd plan-memory (exit {done.returncode})\n{run.plan}", flush=True)
    if done.returncode != 0:
        run.exit = f"not run: the plan refuses it (exit {done.returncode})"
        return
    if not args.tiny and gpus < layout.gpus:
        run.exit = f"not run: {layout.gpus} GPUs asked, {gpus} here"
        return
    run.exit = PENDING


def measure(args: argparse.Namespace, run: Run, log, deadline: float | None) -> None:
    """Run it (a child process, stopped after --timeout or at the deadline less 20 s for the report) and read it back."""
    layout = LAYOUTS[run.layout]
    timeout = min(x for x in (args.timeout, deadline - 20 - time.time() if deadline else None, float("inf")) if x is not None)
    if timeout < 60:
        run.exit = f"not run: {timeout:.0f} s of --budget left"
        return
    run_dir = WORK / run.name.replace(" ", "_").replace("=", "-")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    spec = {"config": str(CONFIG), "keys": run.keys, "run_dir": str(run_dir / "run"), "info": str(run_dir / "child.json"),
            "fault": run.fault, "fault_step": args.fault_step, "fault_delay": args.fault_delay}  # fmt: skip
    (run_dir / "spec.json").write_text(json.dumps(spec))
    sampler = GpuSampler() if shutil.which("nvidia-smi") and not args.tiny else None
    log.write(f"\n== {run.name}\n{json.dumps(spec)}\n")
    log.flush()
    t = time.time()
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "_scale_run.py"), str(run_dir / "spec.json")],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)  # fmt: skip
    metrics = run_dir / "run" / "metrics.jsonl"
    run.exit = _wait(proc, timeout, metrics, _steps(run.keys))
    run.wall_s = time.time() - t
    samples = sampler.stop() if sampler else []
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    run.records = [r for x in lines if (r := _json(x))]  # a killed run's last line may be cut
    run.child = _json((run_dir / "child.json").read_text()) if (run_dir / "child.json").exists() else {}
    run.summary = summarize(run.records, run.child, layout)
    run.busy = busy_shares(samples, run.child, run.summary.get("window"))
    if run.fault:
        run.wrong = lost_or_duplicated(run_dir / "run", run.per_step) if (run_dir / "run").exists() else ["no run directory"]
        last = run.records[-1] if run.records else {}
        if not run.child.get("fault"):
            run.wrong.append("the fault was never injected")
        elif not last.get(f"ray/{run.fault}_restarts"):
            run.wrong.append(f"ray/{run.fault}_restarts is {last.get(f'ray/{run.fault}_restarts')}: no actor was replaced")
    wrong = f", wrong: {run.wrong}" if run.fault else ""
    print(f"== {run.name}: exit {run.exit}, {run.wall_s:.0f} s, {json.dumps(run.summary)}{wrong}", flush=True)


def _steps(keys: list[str]) -> int:
    """The run's run.steps: the last such key, as the config applies them (a user's override comes after _keys')."""
    return int([k for k in keys if k.startswith("run.steps=")][-1].split("=", 1)[1])


def _wait(proc: subprocess.Popen, timeout: float, metrics: Path, steps: int) -> str:
    """The run's exit: its exit code; or, once its last step's record is in `metrics` (everything the report reads),
    stopped there: what a run does after it (a resumable checkpoint with the optimizer state and the final export,
    ~20 GiB at 1.7B) is not what is measured, and a call's minutes are few; or stopped after `timeout` seconds."""
    until = time.time() + timeout
    while True:
        try:
            return str(proc.wait(timeout=1.0))
        except subprocess.TimeoutExpired:
            pass
        done = metrics.exists() and any((r := _json(x)) and r.get("step") == steps and "loss" in r for x in metrics.read_text().splitlines())
        if done or time.time() >= until:
            os.killpg(proc.pid, signal.SIGKILL)  # the run's local Ray cluster goes with it
            proc.wait()
            time.sleep(5)  # its actors release their GPUs
            if done:
                return "stopped after its last step"
            return f"stopped after {timeout:.0f} s"


def summarize(records: list[dict], child: dict, layout: Layout) -> dict:
    """Rates and phase seconds over the steps after the first (or the one step there is)."""
    steps = [r for r in records if "loss" in r]
    if not steps:
        return {"steps": 0}
    timed = steps[1:] or steps
    ends = {int(k): v for k, v in child.get("step_end", {}).items()}
    episodes = sum(r["episodes"] for r in timed)
    sampled = sum(r["perf/rollout_tokens_per_s"] * r["perf/rollout_s"] for r in timed)
    if len(steps) > 1 and steps[0]["step"] in ends and steps[-1]["step"] in ends:
        window = (ends[steps[0]["step"]], ends[steps[-1]["step"]])  # wall clock from the end of step 1
    else:  # one step: the sum of its phases
        start = ends.get(steps[0]["step"], time.time())
        phases = ("perf/rollout_s", "perf/teacher_s", "perf/train_step_s", "perf/weight_sync_s")
        window = (start - sum(steps[0].get(k, 0.0) for k in phases), start)
    wall = max(window[1] - window[0], 1e-9)
    out = {"steps": len(steps), "timed_steps": len(timed), "window": window, "episodes_per_step": episodes / len(timed),
           "episodes_per_s": episodes / wall, "episodes_per_s_per_gpu": episodes / wall / layout.gpus,
           "student_tokens_per_s_per_gpu": sampled / wall / layout.gpus}  # fmt: skip
    for key in ("perf/rollout_s", "perf/teacher_s", "perf/train_step_s", "perf/weight_sync_s", "perf/weight_broadcast_s",
                "perf/weight_push_s", "async/staleness_mean", "async/scored_ahead", "num_turns/mean", "kl/mean"):  # fmt: skip
        values = [r[key] for r in timed if r.get(key) is not None]
        if values:
            out[key] = statistics.mean(values)
    evals = [r["eval/success_rate"] for r in records if "eval/success_rate" in r]
    if evals:
        out["eval/success_rate"] = (evals[0], evals[-1])
    return out


class GpuSampler:
    """nvidia-smi's utilization and memory of each GPU every 200 ms, read in a thread: (time, gpu, busy %, MiB used)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, float, float]] = []
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                                      "-lms", "200"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                gpu, busy, mib = (x.strip() for x in line.split(","))
                self.samples.append((time.time(), int(gpu), float(busy), float(mib)))
            except ValueError:  # a header or "[N/A]"
                continue

    def stop(self) -> list[tuple[float, int, float, float]]:
        self.proc.terminate()
        self.proc.wait()
        self.thread.join(timeout=2)
        return self.samples


def busy_shares(samples: list[tuple[float, int, float, float]], child: dict, window: tuple[float, float] | None) -> dict:
    """Mean busy share and peak memory per GPU over the timed steps, and per role (the mean over the GPUs Ray gave
    that role's actors; a shared GPU counts for each of its roles)."""
    if not samples:
        return {}
    within = [s for s in samples if window and window[0] <= s[0] <= window[1]] or samples
    roles: dict[int, set[str]] = {}
    for actor in child.get("actors", []):
        for g in actor["gpus"]:
            roles.setdefault(int(g), set()).add(actor["role"])
    per_gpu = {}
    for g in sorted({s[1] for s in within}):
        mine = [s for s in within if s[1] == g]
        per_gpu[g] = {"roles": sorted(roles.get(g, ())), "busy": statistics.mean(s[2] for s in mine) / 100,
                      "peak_gib": max(s[3] for s in mine) / 1024, "samples": len(mine)}  # fmt: skip
    per_role = {}
    for role in sorted({r for rs in roles.values() for r in rs}):
        shares = [v["busy"] for v in per_gpu.values() if role in v["roles"]]
        if shares:
            per_role[role] = statistics.mean(shares)
    return {"per_gpu": per_gpu, "per_role": per_role, "whole_run": window is None or within is samples}


def write_report(args: argparse.Namespace, runs: list[Run], shapes: tuple[str, str], tok_dir: Path, gpus: int) -> None:
    commit = commit_measured()
    device = _device_name() or "CPU (no nvidia-smi)"
    lines = [f"# scale_gpu: {shapes[0]} student, {shapes[1]} teacher, tokenizer {tok_dir.name}", "",
             f"`python benchmarks/scale_gpu.py {' '.join(sys.argv[1:])}`; {gpus} x {device}; commit {commit}; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             "Rates over the steps after the first (wall clock from the end of step 1); student tokens are the ones sampled.", "",
             "| run | exit | steps | episodes/step | episodes/s | episodes/s per GPU | student tok/s per GPU | rollout s | teacher s | "
             "train s | weight sync s (broadcast) | staleness | scored ahead | turns |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in runs:
        s = r.summary
        if not s.get("steps"):
            lines.append(f"| {r.name} | {r.exit} | 0 |" + " |" * 11)
            continue
        f = lambda k, p=".2f": format(s[k], p) if k in s else ""  # noqa: E731  (a cell: blank where not measured)
        sync = f("perf/weight_sync_s", ".3f") + (f" ({f('perf/weight_broadcast_s', '.3f')})" if "perf/weight_broadcast_s" in s else "")
        lines.append(f"| {r.name} | {r.exit} | {s['steps']} | {s['episodes_per_step']:.0f} | {f('episodes_per_s')} | "
                     f"{f('episodes_per_s_per_gpu')} | {f('student_tokens_per_s_per_gpu', ',.0f')} | {f('perf/rollout_s')} | "
                     f"{f('perf/teacher_s')} | {f('perf/train_step_s')} | {sync} | {f('async/staleness_mean')} | {f('async/scored_ahead')} | {f('num_turns/mean')} |")  # fmt: skip
    modes = {(r.layout, r.mode): r.summary.get("episodes_per_s") for r in runs if not r.fault}
    for (layout, mode), rate in modes.items():
        base = modes.get((layout, Mode.SYNC))
        if mode != Mode.SYNC and rate and base:
            lines.append(f"\n{layout}: {mode} / sync episodes/s = {rate / base:.2f}")
    if args.scaling:
        base = next((r.summary.get("episodes_per_s_per_gpu") for r in runs if r.layout == "2gpu" and not r.fault), None)
        lines += ["", "Scaling (the same work per GPU):", "", "| layout | mode | episodes/s per GPU | relative to 2gpu |", "|---|---|---|---|"]
        for r in runs:
            rate = r.summary.get("episodes_per_s_per_gpu")
            if not r.fault and rate:
                lines.append(f"| {r.layout} | {r.mode} | {rate:.2f} | {rate / base:.2f} |" if base else f"| {r.layout} | {r.mode} | {rate:.2f} | |")
    lines += ["", "GPU busy share (nvidia-smi utilization, mean over the timed steps) and peak memory used:", ""]
    if not any(r.busy for r in runs):
        lines.append("not measured: " + ("no nvidia-smi here (CPU)" if not shutil.which("nvidia-smi") else "no run finished a step"))
    for r in runs:
        if r.busy:
            roles = ", ".join(f"{role} {share:.0%}" for role, share in r.busy["per_role"].items())
            gpus_ = "; ".join(f"GPU {g} ({'+'.join(v['roles']) or '?'}) {v['busy']:.0%}, {v['peak_gib']:.1f} GiB" for g, v in r.busy["per_gpu"].items())
            lines.append(f"- {r.name}: {roles} — {gpus_}")
    for r in runs:
        if r.fault:
            fault = r.child.get("fault") or {}
            verdict = "nothing lost or duplicated" if not r.wrong else "; ".join(r.wrong)
            lines += ["", f"Fault `{r.fault}` ({r.name}): killed pid {fault.get('pid')} at step {fault.get('step')}"
                      + (f", {_when(fault)} the teacher's scoring of that step" if r.fault == Fault.TEACHER else "")
                      + f"; restarts: rollout {r.records[-1].get('ray/rollout_restarts') if r.records else '?'}, teacher "
                      f"{r.records[-1].get('ray/teacher_restarts') if r.records else '?'}; {verdict}."]  # fmt: skip
    for r in runs:
        lines += ["", f"## {r.name}", "", f"`{' '.join(r.keys)}` — exit {r.exit}, {r.wall_s:.0f} s", "", "```", r.plan, "```"]
        if r.mode == Mode.SYNC and not r.fault and any(k.startswith("mem/") for rec in r.records for k in rec):
            lines += ["", *plan_table(r.records)]
    text = "\n".join(lines) + "\n"
    (args.out / "scale_gpu.md").write_text(text)
    bundle = {"commit": commit, "device": device, "gpus": gpus, "argv": sys.argv[1:], "shapes": shapes, "tokenizer": str(tok_dir),
              "runs": [dataclasses.asdict(r) for r in runs]}  # fmt: skip
    (args.out / "scale_gpu.json").write_text(json.dumps(bundle, indent=1, default=str))
    print(text)


def _json(text: str) -> dict:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {}


def _when(fault: dict) -> str:
    """Whether the teacher replica died while the scoring it was killed in still ran."""
    if "killed_at" not in fault or "scoring_ended" not in fault:
        return "?"
    return "during" if fault["killed_at"] <= fault["scoring_ended"] else "after"


def _gpus() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(line.startswith("GPU ") for line in done.stdout.splitlines())


def _device_name() -> str:
    if not shutil.which("nvidia-smi"):
        return ""
    done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return done.stdout.splitlines()[0].strip() if done.stdout.strip() else ""


if __name__ == "__main__":
    main()
