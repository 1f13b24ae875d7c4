"""The memory plan (agentopd.memory_plan) against measured peaks: the README's GPU example with random-weight
Qwen3 shapes and Qwen3's real vocabulary, on one GPU (issue 30).

    agentopd make-tokenizer qwen3 bench_tok --template agentopd     # once, where the real-vocab extra is installed
    python benchmarks/memory_gpu.py --tokenizer bench_tok --shapes 1.7b,8b --out /tmp/mem   # one GPU, ~5 min
    python benchmarks/memory_gpu.py --tokenizer bench_tok --shapes 1.7b,8b --out /tmp/mem --as-written   # 3 full steps
    python benchmarks/memory_gpu.py --tiny --out /tmp/x              # the same path at toy sizes (CPU smoke test)
    python benchmarks/memory_gpu.py ... trainer.micro_batch_tokens=16384   # extra key=value overrides go to the run

The student and teacher are built from Qwen3Config on the GPU (random bf16 weights; the embedding rows of the
tokenizer's family, 151,936 for Qwen3: `agentopd_vocab.json`), in a process of their own, and cached under
/tmp/memory_gpu. Then `agentopd plan-memory` prints the plan and `agentopd run --config
configs/examples/qwen3-gpu.yaml` runs it: by default with issue 30's smaller step (2 steps of 8 tasks x 8, 3
turns, 8 eval tasks, eval.every=0), which still fills every buffer the plan counts (32k-token micro-batches,
16k-token teacher batches, the fixed KV pool); `--as-written` runs the example's own 64 x 8 x 8 turns for 3 steps.
Run it from the repository root. `engine.sleep=true` as an override measures the engine's sleep and wake
seconds (perf/engine_sleep_s, perf/engine_wake_s) and the peaks with the pool freed.
Writes memory_gpu.md and the run's metrics: per phase the plan's GiB (mem/<phase>_plan_gib), the measured peak
of torch's reserved memory (mem/<phase>_peak_gib; the plan also counts 1 GiB of CUDA context that torch does not
see), their ratio, and seconds per phase. Exit 1 when the run fails or a measured peak exceeds the plan.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

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
WORK = Path("/tmp/memory_gpu")


def build(shape: str, tokenizer: Path, out: Path) -> None:
    """A random-weight Qwen3 model of `shape` with the tokenizer's embedding rows, saved to `out` (cached)."""
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
    dtype, device = (torch.bfloat16, "cuda") if torch.cuda.is_available() else (torch.float32, "cpu")
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default="1.7b,8b", help="student,teacher among " + ", ".join(SHAPES))
    ap.add_argument("--tokenizer", type=Path, help="a tokenizer folder (`agentopd make-tokenizer qwen3 DIR`)")
    ap.add_argument("--as-written", action="store_true", help="the example's own step sizes, 3 steps")
    ap.add_argument("--tiny", action="store_true", help="toy shapes and the embedded tokenizer (CPU smoke test)")
    ap.add_argument("--build", nargs=3, metavar=("SHAPE", "TOKENIZER", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides of the run")
    args = ap.parse_args()
    if args.build:
        return build(args.build[0], Path(args.build[1]), Path(args.build[2]))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        from agentopd.bootstrap import BootstrapSpec, ensure_tokenizer

        tok_dir = WORK / "tiny_tokenizer"
        ensure_tokenizer(BootstrapSpec(corpus_tasks_per_env=300), home=WORK / "home").save_pretrained(tok_dir)
        s_shape, t_shape = "tiny-s", "tiny-t"
    else:
        if args.tokenizer is None:
            sys.exit("--tokenizer DIR: a real-vocabulary tokenizer folder (`agentopd make-tokenizer qwen3 DIR --template agentopd`)")
        tok_dir = args.tokenizer.resolve()
        s_shape, t_shape = args.shapes.split(",")
    models = {}
    for role, shape in (("student", s_shape), ("teacher", t_shape)):
        models[role] = WORK / f"{shape}-{tok_dir.name}"
        t = time.time()
        subprocess.run([sys.executable, __file__, "--out", str(args.out), "--build", shape, str(tok_dir), str(models[role])], check=True)
        print(f"{role}: {shape} at {models[role]} ({time.time() - t:.0f} s)", flush=True)
    run = WORK / "run"
    subprocess.run(["rm", "-rf", str(run)], check=True)
    sizes = ["run.steps=3"] if args.as_written else SMALL_STEP
    if args.tiny:
        sizes = [*SMALL_STEP, "rollout.max_new_tokens=32", "rollout.max_context=1024", "rollout.tasks_per_step=2",
                 "eval.num_tasks=2", "trainer.compile=false", "run.device=cpu"]  # fmt: skip
    keys = ["--env", "sql_db", "--config", "configs/examples/qwen3-gpu.yaml", f"student={models['student']}",
            f"teacher={models['teacher']}", *sizes, "run.checkpoint_every=0", "log.tensorboard=false", *args.overrides]  # fmt: skip
    cli = [sys.executable, "-m", "agentopd.cli"]
    plan = subprocess.run([*cli, "plan-memory", *keys], capture_output=True, text=True)
    print(plan.stdout + plan.stderr, flush=True)
    t = time.time()
    done = subprocess.run([*cli, "run", "--run-dir", str(run), *keys], capture_output=True, text=True)
    wall = time.time() - t
    (args.out / "memory_gpu_log.txt").write_text(done.stdout + done.stderr)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] if (run / "metrics.jsonl").exists() else []
    (args.out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    seconds = {"rollout": "perf/rollout_s", "teacher": "perf/teacher_s", "train": "perf/train_step_s"}
    lines = [f"# memory plan vs measured: {s_shape} student, {t_shape} teacher, tokenizer {tok_dir.name}",
             f"`{' '.join(keys)}`; run exit {done.returncode}, {wall:.0f} s\n", "```", plan.stdout.strip(), "```\n",
             "| phase | plan GiB | measured peak reserved GiB | measured / plan | seconds (mean over steps) |",
             "|---|---|---|---|---|"]  # fmt: skip
    over = []
    for phase in PHASES:
        peaks = [r[f"mem/{phase}_peak_gib"] for r in records if f"mem/{phase}_peak_gib" in r]
        plans = [r[f"mem/{phase}_plan_gib"] for r in records if f"mem/{phase}_plan_gib" in r]
        secs = [r[seconds[phase]] for r in records if seconds.get(phase) in r]
        if not peaks:
            continue
        peak, predicted = max(peaks), (max(plans) if plans else float("nan"))
        if peak > predicted:
            over.append(phase)
        mean_s = f"{sum(secs) / len(secs):.1f}" if secs else ""
        lines.append(f"| {phase} | {predicted:.1f} | {peak:.1f} | {peak / predicted:.2f} | {mean_s} |")
    for key in ("perf/engine_sleep_s", "perf/engine_wake_s", "perf/train_tokens_per_s", "perf/mfu"):
        values = [r[key] for r in records if key in r]
        if values:
            lines.append(f"\n{key}: " + ", ".join(f"{v:.3g}" for v in values) + " (per step)")
    (args.out / "memory_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if done.returncode != 0:
        print("\n".join((done.stdout + done.stderr).splitlines()[-30:]))
    sys.exit(1 if done.returncode != 0 or over else 0)


if __name__ == "__main__":
    main()
