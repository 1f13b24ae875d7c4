"""The train phase at a small step (issue 52): `agentopd run --env math` with 64 single-turn completions of 128 tokens
a step, random-weight Qwen3-0.6B / 1.7B shapes and Qwen3's real vocabulary, reverse KL, on one GPU.

    agentopd make-tokenizer qwen3 TOK                                        # once
    python benchmarks/small_batch.py --tokenizer TOK --out DIR               # the defaults, then the hand-set arms
    python benchmarks/small_batch.py --tokenizer TOK --out DIR --profile     # + the defaults' last train phase profiled
    python benchmarks/small_batch.py --tokenizer TOK --out DIR --against /tmp/old --against-commit abc1234   # A/B
    python benchmarks/small_batch.py --tiny --out DIR                        # toy shapes on CPU (a smoke test)

Each arm is one `agentopd run` in a process of its own (`--steps` steps, default 6; the first compiles and warms up and
is left out of the medians): the defaults a user gets (nothing set but the step's shape), then the settings a user could
hand-set (`--arms`, `;`-separated lists of key=value; default: the 8k micro-batch that was the default until
2026-11-30, the compiled trainer, activation checkpointing on). `--against DIR`: every arm run with another commit's
agentopd as well (this script drives it, so a commit older than the script compares too; each arm's log names the tree
it imported), right before this tree's, in the same call: the before and after of a change on one host. Writes
DIR/small_batch.md (per arm the median train seconds, MFU, tokens and micro-batches of a step, and the rollout and
teacher seconds beside them) and DIR/<arm>.jsonl (the run's metrics).
`--profile`: the defaults arm's last train phase under torch.profiler (DIR/profile_train.txt: kernels by CUDA time and
ops by CPU time; the wall under the profiler is not the unprofiled one).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory_gpu  # noqa: E402  (the model builder and its cache)
from _measured import commit_measured, tree_env  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STEP = ["rollout.tasks_per_step=64", "rollout.n=1", "rollout.max_new_tokens=128", "trainer.loss=reverse_kl",
        "trainer.lr=1e-5", "eval.every=0", "eval.num_tasks=8", "eval.teacher=false", "run.checkpoint_every=0",
        "log.tensorboard=false", "teacher.selftest=false"]  # fmt: skip  # random weights are a uniform teacher: the self-test refuses them
TINY = ["run.device=cpu", "rollout.tasks_per_step=4", "rollout.max_new_tokens=16", "eval.num_tasks=2"]
ARMS = "trainer.micro_batch_tokens=8192;trainer.compile=true;trainer.activation_checkpointing=true"
FIGURES = {"train s": "perf/train_step_s", "MFU": "perf/mfu", "train tok/s": "perf/train_tokens_per_s",
           "tokens": "train/tokens", "micro-batches": "train/micro_batches", "rollout s": "perf/rollout_s",
           "teacher s": "perf/teacher_s"}  # fmt: skip


def one_arm(args: argparse.Namespace) -> None:
    """In this process: the run of one arm (`--run-arm`), its last train phase profiled with `--profile`."""
    if args.profile:
        import realsize

        realsize.profile_phases(args.out, args.steps, traces=False, phases=("train",))
    import agentopd
    from agentopd.config import load_config
    from agentopd.runner import Runner

    print(f"agentopd from {Path(agentopd.__file__).parent}", flush=True)  # the tree this arm measures
    cfg = load_config("math", overrides=args.overrides)
    shutil.rmtree(args.run_arm, ignore_errors=True)
    Runner(cfg, args.run_arm).run()


def run_arm(name: str, tree: Path, keys: list[str], args: argparse.Namespace, profile: bool) -> list[dict]:
    """One arm in a process of its own, with `tree`'s agentopd (this script's runner: a tree older than it compares
    too); the metrics of its steps."""
    run_dir = args.work / f"run_{name}"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-arm", str(run_dir), "--out", str(args.out),
           "--steps", str(args.steps), *(["--profile"] if profile else []), *keys]  # fmt: skip
    env = tree_env(tree)
    t = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    (args.out / f"{name}.log").write_text(done.stdout + done.stderr)
    print(f"arm {name}: exit {done.returncode} in {time.time() - t:.0f} s", flush=True)
    if done.returncode != 0:
        print((done.stdout + done.stderr)[-3000:], flush=True)
        return []
    text = (run_dir / "metrics.jsonl").read_text()
    (args.out / f"{name}.jsonl").write_text(text)
    shutil.rmtree(run_dir, ignore_errors=True)  # its last checkpoint and final/ (0.6B: ~10 GiB an arm) fill a GPU machine's disk
    return [r for r in map(json.loads, text.splitlines()) if "perf/train_step_s" in r]


def row(name: str, keys: str, steps: list[dict]) -> str:
    measured = steps[1:] or steps  # the first step compiles and warms up
    cells = []
    for label, key in FIGURES.items():
        vals = [r[key] for r in measured if r.get(key) is not None]
        if not vals:
            cells.append("-")
            continue
        v = statistics.median(vals)
        cells.append(f"{v:.1%}" if label == "MFU" else f"{v:,.0f}" if v >= 100 else f"{v:.3g}")
    spread = ", ".join(f"{r['perf/train_step_s']:.2f}" for r in measured)
    return f"| {name} | `{keys or '(defaults)'}` | " + " | ".join(cells) + f" | {steps[0]['perf/train_step_s']:.2f} | {spread} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    memory_gpu.add_pair_args(ap, shapes="0.6b,1.7b")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--arms", default=ARMS, help="the hand-set arms after the defaults: ';'-separated, each a "
                    "space-separated list of key=value ('' for none)")
    ap.add_argument("--profile", action="store_true", help="profile the defaults arm's last train phase")
    ap.add_argument("--against", type=Path, help="another commit's tree: each arm runs there first, in this call")
    ap.add_argument("--against-commit", default="", help="what --against's tree is, for the report")
    ap.add_argument("--work", type=Path, default=Path("/tmp/small_batch"), help="the run directories")
    ap.add_argument("--run-arm", type=Path, help=argparse.SUPPRESS)  # one arm's run, in this process
    ap.add_argument("overrides", nargs="*", help="key=value overrides of every arm")
    args = ap.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run_arm:
        return one_arm(args)
    args.work = args.work.resolve()
    tok_dir, s_shape, t_shape = memory_gpu.pair_of(args)
    models = memory_gpu.build_pair(s_shape, t_shape, tok_dir, args.out)
    common = [f"student={models['student']}", f"teacher={models['teacher']}", f"run.steps={args.steps}", *STEP,
              *(TINY if args.tiny else []), *args.overrides]  # fmt: skip
    trees = [(args.against_commit or "against", args.against.resolve())] if args.against else []
    trees.append((commit_measured() + ("+" if args.against and commit_measured() == args.against_commit else ""), ROOT))
    arms = [(f"{label}@{commit}", tree, keys.strip())  # with --against each arm runs in the other tree first
            for label, keys in [("defaults", ""), *((f"arm{i}", k) for i, k in enumerate(args.arms.split(";"), 1) if k.strip())]
            for commit, tree in trees]  # fmt: skip
    lines = [f"# small_batch: {s_shape} student, {t_shape} teacher, tokenizer {tok_dir.name}",
             f"commit {commit_measured()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; `agentopd run --env math "
             f"{' '.join(common[2:])}` and each arm's keys; medians of steps 2..{args.steps}\n",
             "| arm | keys | " + " | ".join(FIGURES) + " | step 1 train s (compiles) | train s, steps 2.. |",
             "|---|---|" + "---|" * len(FIGURES) + "---|---|"]  # fmt: skip
    for name, tree, keys in arms:
        profile = args.profile and tree == ROOT and not keys  # the defaults arm of this tree
        steps = run_arm(name.replace("@", "_"), tree, [*common, *keys.split()], args, profile)
        lines.append(row(name, keys, steps) if steps else f"| {name} | `{keys}` | failed: {name.replace('@', '_')}.log |")
    (args.out / "small_batch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
