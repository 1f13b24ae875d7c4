"""The memory plan (agentopd.memory_plan) against measured peaks: the README's GPU examples with random-weight
Qwen3 shapes and Qwen3's real vocabulary, on one GPU or two (issue 30).

    agentopd make-tokenizer qwen3 bench_tok --template agentopd     # once, where the real-vocab extra is installed
    python benchmarks/memory_gpu.py --tokenizer bench_tok --shapes 1.7b,8b --out /tmp/mem   # one GPU, ~5 min
    python benchmarks/memory_gpu.py --tokenizer bench_tok --out /tmp/mem --as-written --refuse 8b,32b   # 3 full steps
    python benchmarks/memory_gpu.py --tokenizer bench_tok --out /tmp/mem --as-written \
        --config configs/examples/qwen3-2gpu.yaml                   # the same on two GPUs (Ray)
    python benchmarks/memory_gpu.py ... --timeout 330 && python benchmarks/memory_gpu.py ... --resume   # in two calls
    python benchmarks/memory_gpu.py --tiny --out /tmp/x              # the same path at toy sizes (CPU smoke test)
    python benchmarks/memory_gpu.py ... trainer.micro_batch_tokens=16384   # extra key=value overrides go to the run

The student and teacher are built from Qwen3Config on the GPU (random bf16 weights; the embedding rows of the
tokenizer's family, 151,936 for Qwen3: `agentopd_vocab.json`), in a process of their own, and cached under
/tmp/memory_gpu. Then `agentopd plan-memory` prints the plan and `agentopd run --config <the example>` runs it:
by default with issue 30's smaller step (2 steps of 8 tasks x 8, 3 turns, 8 eval tasks, eval.every=0), which
still fills every buffer the plan counts (32k-token micro-batches, 16k-token teacher batches, the fixed KV
pool); `--as-written` runs the example's own 64 x 8 x 8 turns for 3 steps. `--timeout S` stops the run after S
seconds and reports the steps it finished (the log is written as the run goes): it interrupts the run as Ctrl-C does
(the running step finishes and is checkpointed; `--grace` seconds later a second interrupt checkpoints what the
trainer has), so `--resume` in a later call on the same (warm) machine continues it, the models and run directory
kept under --work: a run longer than one ten-minute call, in two. `--refuse 8b,32b` first times
`agentopd run` of shapes that cannot fit (their config.json and tokenizer only: the plan refuses before any
weights load). Run it from the repository root. `engine.sleep=true` as an override measures the engine's sleep
and wake seconds (perf/engine_sleep_s, perf/engine_wake_s) and the peaks with the pool freed.
Writes memory_gpu.md and the run's metrics: per phase (and per GPU on Ray) the plan's GiB (mem/<phase>_plan_gib,
mem/gpu<g>_<phase>_plan_gib), the measured peak held in tensors (torch's max_memory_allocated: what the plan models)
and the peak reserved by the caching allocator (what the GPU holds, blocks cached from earlier phases included); on
Ray the sums over the actors the plan puts on that GPU. The plan also counts 1 GiB of CUDA context per process that
torch does not see. Exit 1 when the run fails or a measured allocated peak exceeds the plan.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _measured import commit_measured

SHAPES = {  # hidden, layers, heads, kv heads, head_dim, intermediate, tied embeddings (the Qwen3 model cards)
    "0.6b": (1024, 28, 16, 8, 128, 3072, True),
    "1.7b": (2048, 28, 16, 8, 128, 6144, True),
    "4b": (2560, 36, 32, 8, 128, 9728, True),
    "8b": (4096, 36, 32, 8, 128, 12288, False),
    "14b": (5120, 40, 40, 8, 128, 17408, False),
    "32b": (5120, 64, 64, 8, 128, 25600, False),
    "tiny-s": (32, 1, 2, 1, 16, 64, True),
    "tiny-t": (48, 1, 2, 1, 24, 96, True),
}
SMALL_STEP = ["run.steps=2", "eval.every=0", "eval.num_tasks=8", "rollout.tasks_per_step=8", "rollout.max_turns=3"]
PHASES = ("rollout", "teacher", "train", "eval")
WORK = Path("/tmp/memory_gpu")  # models and the run directory (--work)


def build(shape: str, tokenizer: Path, out: Path, config_only: bool = False) -> None:
    """A random-weight Qwen3 model of `shape` with the tokenizer's embedding rows, saved to `out` (cached);
    `config_only`: its config.json and tokenizer alone (what the memory plan reads)."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer)
    info = tokenizer / "agentopd_vocab.json"
    rows = json.loads(info.read_text())["model_rows"] if info.exists() else len(tok)
    h, layers, heads, kv, hd, inter, tied = SHAPES[shape]
    cfg = Qwen3Config(vocab_size=rows, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, head_dim=hd, intermediate_size=inter, max_position_embeddings=40960,
                      tie_word_embeddings=tied, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    if (out / "config.json").exists() and json.loads((out / "config.json").read_text()).get("hidden_size") == h and \
            json.loads((out / "config.json").read_text()).get("vocab_size") == rows:  # fmt: skip
        return
    if config_only:
        out.mkdir(parents=True, exist_ok=True)
        cfg.save_pretrained(out)
        tok.save_pretrained(out)
        return
    dtype, device = (torch.bfloat16, "cuda") if torch.cuda.is_available() else (torch.float32, "cpu")
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def main() -> None:
    global WORK
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    add_pair_args(ap, shapes="1.7b,8b")
    ap.add_argument("--config", default="configs/examples/qwen3-gpu.yaml", help="the example to run (qwen3-2gpu.yaml: Ray, 2 GPUs)")
    ap.add_argument("--as-written", action="store_true", help="the example's own step sizes, 3 steps")
    ap.add_argument("--timeout", type=float, help="interrupt the run after this many seconds (it checkpoints) and report")
    ap.add_argument("--grace", type=float, default=90, help="seconds after --timeout before the second interrupt")
    ap.add_argument("--resume", action="store_true", help="continue the run under --work from its last checkpoint")
    ap.add_argument("--work", type=Path, default=WORK, help=f"models and the run directory (default {WORK})")
    ap.add_argument("--refuse", metavar="SHAPES", help="also time the refusal of student,teacher shapes that cannot fit (8b,32b)")
    ap.add_argument("--build", nargs=3, metavar=("SHAPE", "TOKENIZER", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--config-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides of the run")
    args = ap.parse_args()
    WORK = args.work.resolve()
    if args.build:
        return build(args.build[0], Path(args.build[1]), Path(args.build[2]), config_only=args.config_only)
    args.out.mkdir(parents=True, exist_ok=True)
    tok_dir, s_shape, t_shape = pair_of(args, make="agentopd make-tokenizer qwen3 DIR --template agentopd")
    models = build_pair(s_shape, t_shape, tok_dir, args.out)
    sizes = ["run.steps=3"] if args.as_written else SMALL_STEP
    if args.tiny:
        sizes = [*SMALL_STEP, "rollout.max_new_tokens=32", "rollout.max_context=1024", "rollout.tasks_per_step=2",
                 "eval.num_tasks=2", "trainer.compile=false", "run.device=cpu", "run.backend=local"]  # fmt: skip
    common = ["--env", "sql_db", "--config", args.config]
    keys = [*common, f"student={models['student']}", f"teacher={models['teacher']}", *sizes, "run.checkpoint_every=0",
            "log.tensorboard=false", "teacher.selftest=false", *args.overrides]  # fmt: skip  # random weights are a uniform teacher: the self-test would refuse them
    cli = [sys.executable, "-m", "agentopd.cli"]
    refusal = _refusal(cli, common, args, tok_dir) if args.refuse else []
    plan = subprocess.run([*cli, "plan-memory", *keys], capture_output=True, text=True)
    print(plan.stdout + plan.stderr, flush=True)
    run = WORK / "run"
    if args.resume and not (run / "config.yaml").exists():
        sys.exit(f"--resume: no run to continue under {run} (a warm machine keeps --work between calls; a fresh one does not)")
    if not args.resume:
        subprocess.run(["rm", "-rf", str(run)], check=True)
    log = args.out / "memory_gpu_log.txt"
    t = time.time()
    with log.open("a" if args.resume else "w") as f:  # written as it runs: a run stopped by the call's limit leaves its log
        resume = ["--resume"] if args.resume else []
        proc = subprocess.Popen([*cli, "run", "--run-dir", str(run), *resume, *keys], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True)  # its own process group: a kill takes its local Ray cluster too
        ready = threading.Event()
        copier = threading.Thread(target=stamp_lines, args=(proc.stdout, f, t, ready), daemon=True)
        copier.start()
        code = stop_at(proc, args.timeout, args.grace, ready)
        copier.join(timeout=10)
    wall = time.time() - t
    if not isinstance(code, int):  # stopped: which checkpoint a --resume would continue from
        done = sorted(p.parent.name for p in (run / "checkpoints").glob("step_*/DONE"))
        code += f" ({done[-1]} written)" if done else " (no checkpoint: a --resume starts over)"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] if (run / "metrics.jsonl").exists() else []
    (args.out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    steps = [r for r in records if "perf/rollout_s" in r]
    resumed = [x.split("] ", 1)[-1] for x in log.read_text().splitlines() if "] resumed from " in x]
    lines = [f"# memory plan vs measured: {s_shape} student, {t_shape} teacher, tokenizer {tok_dir.name}",
             f"commit {commit_measured()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"`{' '.join(keys)}`; run exit {code}, {wall:.0f} s, {len(steps)} steps finished"
             + (f" ({resumed[-1].split(':')[0]} in this call)" if args.resume and resumed else "") + "\n",
             "```", plan.stdout.strip(), "```\n",
             *refusal, *plan_table(records)]  # fmt: skip
    (args.out / "memory_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if code != 0:
        print("\n".join(log.read_text().splitlines()[-30:]))
    over = any(row.endswith(" over") for row in lines)
    sys.exit(1 if code != 0 or over else 0)


# a line the run prints once it takes Ctrl-C as "stop after this step" (before it, during set-up, Ctrl-C ends it)
IN_LOOP = ("eval @ step ", "resumed from ", "step ")


def stamp_lines(stream, log, t0: float, ready: threading.Event) -> None:
    """Copy the run's output into the log, each line with the seconds since the run started (where the time of a
    stopped run went); set `ready` at the first line printed from the run's step loop."""
    for line in stream:
        log.write(f"[{time.time() - t0:6.0f} s] {line}")
        log.flush()
        if line.startswith(IN_LOOP):
            ready.set()
    ready.set()


def stop_at(proc: subprocess.Popen, timeout: float | None, grace: float, ready: threading.Event) -> int | str:
    """Wait for the run; at `timeout`, or later when the run is still setting up (`ready` unset: a Ctrl-C then would
    end it without a checkpoint), interrupt it as Ctrl-C does (in its step loop it finishes the running step and
    checkpoints it), `grace` seconds later interrupt it again (it checkpoints the last step the trainer took), 90 s
    after that kill its process group (the interrupts go to the driver alone: it stops its Ray actors itself). Returns
    its exit code, or what stopped it."""
    t0 = time.monotonic()
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    while not ready.wait(timeout=1.0):
        if proc.poll() is not None:
            return proc.returncode
    first = time.monotonic() - t0
    for signum, wait in ((signal.SIGINT, grace), (signal.SIGINT, 90.0)):
        proc.send_signal(signum)
        try:
            proc.wait(timeout=wait)
            return f"interrupted after {first:.0f} s"
        except subprocess.TimeoutExpired:
            pass
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and what it started (a Ray run's raylet and actors hold the GPUs)
    proc.wait()
    return f"killed {first + grace + 90:.0f} s in, after two interrupts"


def tiny_tokenizer() -> Path:
    """The embedded tokenizer saved as a folder (the toy shapes' vocabulary, CPU smoke tests)."""
    from agentopd.bootstrap import BootstrapSpec, ensure_tokenizer

    tok_dir = WORK / "tiny_tokenizer"
    ensure_tokenizer(BootstrapSpec(corpus_tasks_per_env=300), home=WORK / "home").save_pretrained(tok_dir)
    return tok_dir


def add_pair_args(ap: argparse.ArgumentParser, shapes: str) -> None:
    """A script's options for its model pair (`pair_of` reads them): `--tokenizer`, `--shapes` (default `shapes`),
    `--tiny`."""
    ap.add_argument("--tokenizer", type=Path, help="a real-vocabulary tokenizer folder (`agentopd make-tokenizer qwen3 DIR`)")
    ap.add_argument("--shapes", default=shapes, help="student,teacher among " + ", ".join(SHAPES))
    ap.add_argument("--tiny", action="store_true", help="toy shapes and the embedded tokenizer (a CPU smoke test)")


def pair_of(args: argparse.Namespace, make: str = "agentopd make-tokenizer qwen3 DIR") -> tuple[Path, str, str]:
    """The tokenizer folder and student, teacher shapes of `add_pair_args`'s options: the toy ones with `--tiny`, else
    `--tokenizer`'s vocabulary and `--shapes` ("student,teacher"); exits naming `--tokenizer` (and `make`, the command
    that builds one) where it is missing."""
    if args.tiny:
        return tiny_tokenizer(), "tiny-s", "tiny-t"
    if args.tokenizer is None:
        sys.exit(f"--tokenizer DIR: a real-vocabulary tokenizer folder (`{make}`)")
    s_shape, t_shape = args.shapes.split(",")
    return args.tokenizer.resolve(), s_shape, t_shape


def build_pair(s_shape: str, t_shape: str, tok_dir: Path, out: Path) -> dict[str, Path]:
    """The student and teacher model folders, built side by side (each build is mostly writing its safetensors)."""
    with ThreadPoolExecutor(2) as pool:
        built = pool.map(lambda shape: build_folder(shape, tok_dir, out), (s_shape, t_shape))
        return dict(zip(("student", "teacher"), built))


def build_folder(shape: str, tok_dir: Path, out: Path, config_only: bool = False) -> Path:
    """The model folder of `shape` (built in a process of its own, cached under WORK)."""
    folder = WORK / f"{shape}-{tok_dir.name}{'-config' if config_only else ''}"
    t = time.time()
    subprocess.run([sys.executable, __file__, "--out", str(out), "--build", shape, str(tok_dir), str(folder),
                    *(["--config-only"] if config_only else [])], check=True)  # fmt: skip
    print(f"{shape} at {folder} ({time.time() - t:.0f} s)", flush=True)
    return folder


def _refusal(cli: list[str], common: list[str], args: argparse.Namespace, tok_dir: Path) -> list[str]:
    """`agentopd run` of shapes that cannot fit (config.json and tokenizer, no weights): its seconds and message."""
    s_shape, t_shape = args.refuse.split(",")
    folders = [build_folder(shape, tok_dir, args.out, config_only=True) for shape in (s_shape, t_shape)]
    t = time.time()
    done = subprocess.run([*cli, "run", "--run-dir", str(WORK / "refused"), *common, f"student={folders[0]}",
                           f"teacher={folders[1]}"], capture_output=True, text=True)  # fmt: skip
    wall = time.time() - t
    said = (done.stdout + done.stderr).strip().splitlines()
    print("\n".join(said[-40:]), flush=True)
    first = next((x for x in said if "does not fit" in x), said[-1] if said else "")
    return [f"Refusal: `agentopd run {' '.join(common)} student=<{s_shape}> teacher=<{t_shape}>` (the example as written) "
            f"exited {done.returncode} after {wall:.1f} s (process start included), before any model loaded:\n",
            "```", first.strip(), "```\n"]  # fmt: skip


def plan_table(records: list[dict]) -> list[str]:
    """Plan against measured peak allocated and reserved GiB per phase (per GPU on Ray), the allocator's retries, and
    seconds per phase."""
    seconds = {"rollout": "perf/rollout_s", "teacher": "perf/teacher_s", "train": "perf/train_step_s"}
    gpus = sorted({k.split("_")[0][len("mem/gpu"):] for r in records for k in r if k.startswith("mem/gpu")}, key=int)
    prefixes = [(f"GPU {g}", f"mem/gpu{g}_") for g in gpus] or [("GPU 0", "mem/")]
    lines = ["| GPU | phase | plan GiB | measured peak allocated GiB (tensors) | allocated / plan | peak reserved GiB "
             "(allocator, cached blocks included) | allocator retries | seconds (mean over steps) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for label, prefix in prefixes:
        for phase in PHASES:
            def peak(kind: str) -> float:
                values = [r[f"{prefix}{phase}_{kind}_gib"] for r in records if f"{prefix}{phase}_{kind}_gib" in r]
                return max(values) if values else float("nan")

            if not any(f"{prefix}{phase}_peak_gib" in r for r in records):
                continue
            predicted, allocated, reserved = peak("plan"), peak("alloc"), peak("peak")
            secs = [r[seconds[phase]] for r in records if seconds.get(phase) in r]
            mean_s = f"{sum(secs) / len(secs):.1f}" if secs else ""
            retried = [r[f"{prefix}{phase}_alloc_retries"] for r in records if f"{prefix}{phase}_alloc_retries" in r]
            retries = f"{sum(retried):.0f}" if retried else "-"  # summed over the steps (and the actors on the GPU)
            verdict = " over" if allocated > predicted else ""
            lines.append(f"| {label} | {phase} | {predicted:.1f} | {allocated:.1f} | {allocated / predicted:.2f} | {reserved:.1f} | "
                         f"{retries} | {mean_s} |{verdict}")  # fmt: skip
    for key in ("perf/weight_sync_s", "perf/engine_sleep_s", "perf/engine_wake_s", "perf/rollout_tokens_per_s",
                "perf/teacher_tokens_per_s", "perf/train_tokens_per_s", "perf/mfu", "episodes", "num_turns/mean"):  # fmt: skip
        values = [r[key] for r in records if key in r]
        if values:
            lines.append(f"\n{key}: " + ", ".join(f"{v:.3g}" for v in values) + " (per step)")
    return lines


if __name__ == "__main__":
    main()
