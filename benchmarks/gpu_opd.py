"""The main job on a GPU with real-architecture models (random weights): rollout, teacher and
training tokens/s of a few OPD steps, bf16, transformers engine (issue 5's GPU check).

    python benchmarks/gpu_opd.py --out results_dir            # Qwen3-0.6B-shaped student, 1.7B-shaped teacher
    python benchmarks/gpu_opd.py --tiny --out /tmp/x          # the same path at toy sizes (CPU smoke test)
    python benchmarks/gpu_opd.py --out DIR engine.kind=hf     # extra key=value overrides go to the run
    agentopd make-tokenizer qwen3 TOK && python benchmarks/gpu_opd.py --out DIR --tokenizer TOK   # Qwen3's vocabulary
    python benchmarks/gpu_opd.py --out DIR --tokenizer TOK --teacher-tokenizer TOK35 trainer.loss=xtok_k1   # a Qwen3.5 teacher

Models are built locally from Qwen3 configs (no hub): layers, widths and heads are the real ones. The vocabulary
is the embedded tokenizer's (~1k rows) by default, or with `--tokenizer` a tokenizer folder's (e.g. Qwen3's real
151,643-token BPE and template from `agentopd make-tokenizer qwen3`, with the 151,936 embedding rows its
`agentopd_vocab.json` records). Writes `gpu_opd.md` (a table from the run's metrics.jsonl) and the metrics.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {  # hidden, layers, heads, kv heads, head_dim, intermediate
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144),
    "tiny-s": (32, 1, 2, 1, 16, 64),
    "tiny-t": (48, 1, 2, 1, 24, 96),
}


def build(shape: str, tok, out: Path, dtype, rows: int) -> int:
    """A random-weight Qwen3 model of `shape` with `rows` embedding rows (>= len(tok): real checkpoints pad theirs)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    h, layers, heads, kv, hd, inter = SHAPES[shape]
    if (out / "config.json").exists():  # built by an earlier run of this script (same shape, same tokenizer)
        built = Qwen3Config.from_pretrained(out)
        if (built.hidden_size, built.num_hidden_layers, built.vocab_size) == (h, layers, rows):
            with torch.device("meta"):
                return sum(p.numel() for p in Qwen3ForCausalLM(built).parameters())
    cfg = Qwen3Config(vocab_size=rows, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, head_dim=hd, intermediate_size=inter, max_position_embeddings=4096,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(dtype)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def tokenizer_and_rows(path: Path | None, home: Path):
    """A tokenizer folder's tokenizer and its model's embedding rows (`agentopd_vocab.json`), or with no folder the
    embedded tokenizer (built and cached under `home`) and its length."""
    if path is None:
        from agentopd.bootstrap import BootstrapSpec, ensure_tokenizer

        tok = ensure_tokenizer(BootstrapSpec(corpus_tasks_per_env=300), home=home)
        return tok, len(tok)
    from transformers import AutoTokenizer

    from agentopd.vocab import read_vocab_info

    tok = AutoTokenizer.from_pretrained(path)
    return tok, read_vocab_info(path).get("model_rows", len(tok))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer folder (agentopd make-tokenizer) instead of the embedded one")
    ap.add_argument("--teacher-tokenizer", type=Path, default=None,
                    help="the teacher's own tokenizer folder (a cross-tokenizer pair: pass trainer.loss=xtok_k1 or xtok_full)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides of the run, e.g. engine.kind=fast")
    args = ap.parse_args()
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/gpu_opd")
    tok, rows = tokenizer_and_rows(args.tokenizer, work / "home")
    if args.tokenizer is not None:
        work = work / args.tokenizer.name  # models of this vocabulary apart from the embedded one's
    dtype = torch.float32 if args.tiny else torch.bfloat16
    s_shape, t_shape = ("tiny-s", "tiny-t") if args.tiny else ("qwen3-0.6b", "qwen3-1.7b")
    n_s = build(s_shape, tok, work / "student", dtype, rows)
    t_tok, t_rows, t_dir = tok, rows, work / "teacher"
    if args.teacher_tokenizer is not None:
        t_tok, t_rows = tokenizer_and_rows(args.teacher_tokenizer, work / "home")
        t_dir = work / f"teacher-{args.teacher_tokenizer.name}"
    n_t = build(t_shape, t_tok, t_dir, dtype, t_rows)
    run = work / "run"
    subprocess.run(["rm", "-rf", str(run)], check=True)
    cmd = [sys.executable, "-m", "agentopd.cli", "run", "--env", "sql_db", "--run-dir", str(run),
           f"student={work / 'student'}", f"teacher={t_dir}", f"steps={args.steps}",
           "rollout.tasks_per_step=16", "rollout.n=4", "rollout.max_new_tokens=128", "rollout.max_turns=3",
           "rollout.max_context=2048", "eval.num_tasks=32", "eval.every=0", "log.tensorboard=false",
           "trainer.loss=reverse_kl", "trainer.lr=1e-5", "trainer.activation_checkpointing=true",
           "trainer.micro_batch_tokens=16384", "run.checkpoint_every=0",
           "teacher.selftest=false", *args.overrides]  # fmt: skip  # random weights are a uniform teacher: the self-test would refuse them
    t = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t
    (args.out / "gpu_opd_log.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:])
        sys.exit(done.returncode)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r][1:] or [r for r in records if "loss" in r]  # skip the warm-up step
    keys = ["perf/rollout_tokens_per_s", "perf/teacher_tokens_per_s", "perf/train_tokens_per_s",
            "perf/rollout_s", "perf/teacher_s", "perf/train_step_s", "perf/weight_sync_s",
            "perf/weight_broadcast_s", "perf/weight_group_s", "perf/weight_gather_s", "perf/weight_push_s",
            "perf/step_s", "perf/mfu"]  # fmt: skip
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    lines = [f"# OPD loop on {dev}: {s_shape} student ({n_s / 1e6:.0f}M) / {t_shape} teacher ({n_t / 1e6:.0f}M), random weights",
             "", f"command: `python benchmarks/gpu_opd.py --out DIR` (runs: `{' '.join(cmd[3:])}`)", "",
             f"vocabulary: {args.tokenizer or 'the embedded tokenizer'}'s {len(tok):,} tokens, {rows:,} embedding rows; "
             "bf16 engine/teacher/compute, "
             f"fp32 master weights, activation checkpointing; wall time {wall:.0f} s for {args.steps} steps incl. start-up and evals.",
             "", "| metric (median over steps 2..N) | value |", "|---|---|"]  # fmt: skip
    for k in keys:
        vals = [r[k] for r in steps if r.get(k) is not None]
        if vals:
            lines.append(f"| {k} | {statistics.median(vals):,.2f} |")
    lines.append(f"| tokens per step (train/tokens) | {statistics.median(r['train/tokens'] for r in steps):,.0f} |")
    text = "\n".join(lines)
    print(text)
    (args.out / "gpu_opd.md").write_text(text + "\n")
    (args.out / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text())


if __name__ == "__main__":
    main()
