"""Each task's prompt computed once in the packed rows of the teacher and the trainer, against every stream whole,
in one process on one GPU.

    PYTHONUNBUFFERED=1 python benchmarks/prefix_share_gpu.py --out DIR        # ~6 min on an H200

Half of what the README's GPU example hands its phases a step: 32 tasks x 8 samples, each sample the task's prompt
then its own tokens (a 370-token prompt, ~26% of the tokens, and 300-1,700 tokens of its own: the example's mix,
benchmarks/results/realsize_profile.md). Random Qwen3 weights, 151,936 rows:
1. teacher (`--teacher` shape, default 8b, bf16, each layer compiled as `teacher.compile` does, mode hidden as reverse
   KL takes): `share_prefix=False` (every stream whole in its packed row) and True (`agentopd.prefix.pack_row`),
   each run once to warm, then `--repeats` times alternating: seconds (median), stream tokens / s, the speed-up, and
   the largest difference of the sampled tokens' logprobs between the arms (the same attention up to bf16 rounding);
2. trainer (`--student` shape, default 1.7b, the example's trainer: compiled, activation checkpointing, bf16 compute,
   32k-token micro-batches; loss sampled_k1, whose head work is the same in both arms): trainer.share_prefix false,
   true, and true with trainer.checkpoint_every=2; a fresh trainer each, one step to warm (compile), then
   `--repeats` steps: seconds (median), tokens / s, peak GiB.
Writes DIR/prefix_share_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measured import commit_measured
from memory_gpu import SHAPES

from agentopd.batch import TrainSample
from agentopd.prefix import pack_row
from agentopd.teacher.hf import HFTeacher, plan_shared_rows
from agentopd.trainer import Trainer, TrainerConfig
from agentopd.types import TokenStream

VOCAB = 151936


def model(shape: str) -> Qwen3ForCausalLM:
    h, layers, heads, kv, hd, inter, tied = SHAPES[shape]
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, max_position_embeddings=40960,
                      tie_word_embeddings=tied)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = Qwen3ForCausalLM(cfg)
    return m.to(torch.bfloat16).eval()


def streams(tasks: int, samples: int, prompt: int, lo: int, hi: int) -> list[TokenStream]:
    g = torch.Generator().manual_seed(0)
    out = []
    prompts = [torch.randint(100, VOCAB, (prompt,), generator=g).tolist() for _ in range(tasks)]
    for k in range(samples):  # the order episodes come back in: task by task within each sample round
        for p in prompts:
            n = int(torch.randint(lo, hi + 1, (1,), generator=g))
            own = torch.randint(100, VOCAB, (n,), generator=g).tolist()
            out.append(TokenStream(p + own, len(p), [1] * n, [0.0] * n, [0] * n))
    return out


def timed(teacher: HFTeacher, batch: list[TokenStream]) -> tuple[float, list]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    scores = teacher.score(batch, mode="hidden")
    torch.cuda.synchronize()
    return time.perf_counter() - t, scores


def teacher_arms(m, batch: list[TokenStream], repeats: int, compile: bool) -> dict:
    arms = {name: HFTeacher(m, device="cuda", offload_after_score=False, compile=compile, share_prefix=name == "shared")
            for name in ("whole", "shared")}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in arms}
    logprobs = {}
    for teacher in arms.values():  # warm: the compile of the layers' shapes
        timed(teacher, batch)
    for _ in range(repeats):
        for name, teacher in arms.items():
            seconds, scores = timed(teacher, batch)
            times[name].append(seconds)
            logprobs[name] = [lp for s in scores for lp in s.logprobs]
    diff = max(abs(a - b) for a, b in zip(logprobs["whole"], logprobs["shared"]))
    return {"seconds": {k: statistics.median(v) for k, v in times.items()}, "all_seconds": times, "max_logprob_diff": diff}


def trainer_arms(shape: str, batch: list[TokenStream], repeats: int) -> dict:
    samples = [TrainSample(token_ids=s.token_ids, prompt_len=s.prompt_len, response_mask=s.response_mask,
                           old_logprobs=[-1.0] * len(s.response_mask), teacher_logprobs=[-1.2] * len(s.response_mask))
               for s in batch]  # fmt: skip
    arms = {"whole": {"share_prefix": False}, "shared": {}, "shared_ckpt2": {"checkpoint_every": 2}}
    out: dict = {"seconds": {}, "all_seconds": {}, "peak_gib": {}}
    for name, extra in arms.items():
        cfg = TrainerConfig(loss="sampled_k1", lr=1e-6, warmup_steps=1, total_steps=repeats + 1, micro_batch_tokens=32768,
                            chunk_size=4096, compile=True, activation_checkpointing=True, mixed_precision="bf16", **extra)  # fmt: skip
        trainer = Trainer(model(shape).float().cpu(), cfg, device="cuda")
        trainer.train_step(samples)  # warm: the compile
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t = time.perf_counter()
            trainer.train_step(samples)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out["all_seconds"][name], out["seconds"][name] = times, statistics.median(times)
        out["peak_gib"][name] = torch.cuda.max_memory_allocated() / 2**30
        print(f"  trainer {name:12s} {out['seconds'][name]:.2f} s  peak {out['peak_gib'][name]:.1f} GiB  runs {times}", flush=True)
        del trainer
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--student", default="1.7b", choices=sorted(SHAPES))
    ap.add_argument("--tasks", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=370)
    ap.add_argument("--own", default="300,1700", help="min,max tokens of each sample's own")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--phases", default="teacher,trainer")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.own.split(","))
    batch = streams(args.tasks, args.samples, args.prompt, lo, hi)
    tokens = sum(len(s.token_ids) for s in batch)
    computed = sum(len(pack_row([batch[i] for i in r]).ids) for r in plan_shared_rows(batch, 16384))
    result = {"commit": commit_measured(), "device": torch.cuda.get_device_name(), "streams": len(batch), "tokens": tokens,
              "computed_shared": computed}  # fmt: skip
    print(f"{len(batch)} streams, {tokens:,} tokens ({computed:,} computed with the prompts shared)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if "teacher" in args.phases:
        m = model(args.teacher)
        r = teacher_arms(m, batch, args.repeats, compile=True)
        del m
        torch.cuda.empty_cache()
        r["speedup"] = r["seconds"]["whole"] / r["seconds"]["shared"]
        result["teacher"] = r | {"shape": args.teacher}
        for k, v in r["seconds"].items():
            print(f"  teacher {k:6s} {v:.2f} s  {tokens / v:,.0f} tok/s   runs {r['all_seconds'][k]}", flush=True)
        print(f"  teacher speed-up {r['speedup']:.2f}x, largest logprob difference {r['max_logprob_diff']:.4f}", flush=True)
        (args.out / "prefix_share_gpu.json").write_text(json.dumps(result, indent=1))
    if "trainer" in args.phases:
        r = trainer_arms(args.student, batch, args.repeats)
        r["speedup"] = {k: r["seconds"]["whole"] / v for k, v in r["seconds"].items()}
        result["trainer"] = r | {"shape": args.student}
        print(f"  trainer speed-ups {r['speedup']}", flush=True)
        (args.out / "prefix_share_gpu.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
