"""The fast engine's KV pool in bf16 and in fp8 (`engine.kv_cache_dtype=fp8`), in one process on one GPU.

    PYTHONUNBUFFERED=1 python benchmarks/kv_fp8.py --out DIR        # ~3 min on an H200

Model: the README GPU example's student shape (Qwen3-1.7B: 28 layers, hidden 2048, 16 q / 8 kv heads, head_dim 128,
151,936-row vocabulary), random weights, bf16; each pool 32 GiB (fp8 holds twice the tokens). Arms, bf16 then fp8:
1. fixed-batch decode: the captured decode graph at 128 / 256 rows x context 512 / 1,024 / 2,048 (where the pool holds
   it): ms a step and the fp8 / bf16 ratio. The real-size rollout spends ~62% of its GPU time in the decode kernel
   (benchmarks/results/realsize_profile.md), which reads K/V at the memory bound.
2. a rollout-shaped workload through the async engine: 256 episodes of one turn, a 384-token prompt (the first 192
   shared), 1,024 +- 512 sampled tokens: generated tokens/s and the ratio.
3. the sampled tokens' logprobs against a teacher-forced fp32 forward of the same weights (8 episodes of arm 2): mean
   and max |difference|, bf16 pool and fp8 pool (what fp8 moves the sampler's distribution by, on random weights;
   tests/test_kv_fp8.py and the results file have a real checkpoint's figure).
Writes DIR/kv_fp8.md and DIR/kv_fp8.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_gpu import decode_batch, model_bf16, multi_turn, replay

from agentopd.engines.fast import FastEngine
from agentopd.engines.fast.attention import PAGE

POOL_GIB = 32.0


def decode_steps(engine: FastEngine) -> dict[str, float]:
    out = {}
    for rows in (128, 256):
        for ctx in (512, 1024, 2048):
            if rows * (ctx // PAGE) + 1 > engine.num_pages:
                continue
            step, _ = replay(engine, *decode_batch(rows, ctx))
            out[f"{rows}x{ctx}"] = step
            print(f"  decode {rows} rows x {ctx}: {step * 1e3:.2f} ms", flush=True)
    return out


def logprob_gap(model_fp32: Qwen3ForCausalLM, streams) -> tuple[float, float]:
    diffs = []
    with torch.no_grad():
        for ids, positions, logprobs in streams:
            ids_1T = torch.tensor([ids], device="cuda")
            pos = torch.tensor(positions, device="cuda")
            lp_TV = torch.log_softmax(model_fp32(input_ids=ids_1T).logits[0].float(), -1)
            diffs.append((torch.tensor(logprobs, device="cuda") - lp_TV[pos - 1, ids_1T[0, pos]]).abs())
    d = torch.cat(diffs)
    return d.mean().item(), d.max().item()


def arm(model: Qwen3ForCausalLM, kv_dtype: str) -> tuple[dict, list]:
    engine = FastEngine(model, device="cuda", dtype=torch.bfloat16, max_batch_size=256, max_model_len=4096,
                        kv_cache_gb=POOL_GIB, kv_cache_dtype=kv_dtype)
    print(f"{kv_dtype}: {engine.num_pages:,} pages ({engine.num_pages * PAGE:,} tokens) in {POOL_GIB:g} GiB", flush=True)
    asyncio.run(multi_turn(engine, 8, 2, 16, seed=99))  # the Triton kernels compile outside the timed arms
    asyncio.run(multi_turn(engine, 48, 2, 16, seed=98, spread=8))
    result = {"pages": engine.num_pages, "decode_s": decode_steps(engine)}
    wall, gen, _, streams, ctx = asyncio.run(multi_turn(engine, 256, 1, 1024, seed=7, check=8, prompt=384, spread=512))
    result.update(rollout_tok_s=gen / wall, rollout_s=wall, generated=gen, mean_context=ctx)
    print(f"  rollout: {gen:,} tokens in {wall:.1f} s = {gen / wall:,.0f} tok/s (mean context {ctx:.0f})", flush=True)
    asyncio.run(engine.close())
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return result, streams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = model_bf16(hidden=2048, intermediate=6144)  # the 1.7B shape
    results, streams = {}, {}
    for kv in ("auto", "fp8"):
        results[kv], streams[kv] = arm(model, kv)
    model_fp32 = model.float()
    for kv in ("auto", "fp8"):
        results[kv]["logprob_gap_mean"], results[kv]["logprob_gap_max"] = logprob_gap(model_fp32, streams[kv])
    b, f = results["auto"], results["fp8"]
    lines = [(f"# KV pool bf16 vs fp8 (`benchmarks/kv_fp8.py`), {torch.cuda.get_device_name()}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"), "",
             f"Pools of {POOL_GIB:g} GiB: bf16 {b['pages'] * PAGE:,} tokens, fp8 {f['pages'] * PAGE:,}.", "",
             "| decode step (rows x context) | bf16 ms | fp8 ms | fp8 speed-up |", "|---|---|---|---|"]
    for key, sb in b["decode_s"].items():
        if key in f["decode_s"]:
            lines.append(f"| {key} | {sb * 1e3:.2f} | {f['decode_s'][key] * 1e3:.2f} | {sb / f['decode_s'][key]:.2f}x |")
    lines += ["", "| 256 episodes, 1 turn of 1,024 +- 512 tokens | bf16 | fp8 | ratio |", "|---|---|---|---|",
              (f"| generated tok/s | {b['rollout_tok_s']:,.0f} | {f['rollout_tok_s']:,.0f} | "
              f"{f['rollout_tok_s'] / b['rollout_tok_s']:.2f}x |"),
              f"| seconds | {b['rollout_s']:.1f} | {f['rollout_s']:.1f} | |",
              (f"| mean \\|logprob - fp32 teacher-forced\\| (8 episodes) | {b['logprob_gap_mean']:.4f} | "
              f"{f['logprob_gap_mean']:.4f} | |"),
              f"| max | {b['logprob_gap_max']:.3f} | {f['logprob_gap_max']:.3f} | |"]
    (args.out / "kv_fp8.md").write_text("\n".join(lines) + "\n")
    (args.out / "kv_fp8.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
