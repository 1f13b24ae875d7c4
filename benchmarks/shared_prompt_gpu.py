"""The fast engine's decode with and without reading a shared prompt once per tile of rows, in one process.

    PYTHONUNBUFFERED=1 python benchmarks/shared_prompt_gpu.py [--shape 1.7b] [--tasks 32] [--n 8] [--prompt 384]
        [--tokens 1024] [--out DIR]

The rollout of the README's GPU example (64 tasks x 8 samples, ~380-token prompts, up to 1,024 tokens, 256 in flight)
spends ~60% of its GPU time in the decode kernel reading K/V, and ~40% of those bytes are each task's prompt, read
once per sample (benchmarks/results/realsize_profile.md). `FastEngine(shared_prompts=True)` (on by default where the
Triton kernel runs) reads the pages a tile of rows shares once for the tile (agentopd/engines/fast/shared_prefix.py).

Arms, each on an engine of its own built in this process (random weights of the shape, bf16, a 256-row decode
graph), on first and then off, `--reps` runs of each arm:
- tasks: `--tasks` x `--n` samples of a prompt of `--prompt` tokens (each task's own), `--tokens` tokens each (T=1,
  random weights: no stop, so a spread of +-25% keeps the rows from finishing at one step), all in flight at once;
- unshared: the same number of episodes, every prompt its own (nothing to share: what the kernel's merge costs).
Prints generated tokens/s per arm and the ratio on / off, and writes DIR/shared_prompt_gpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import time
from pathlib import Path

import torch

from agentopd.engines import GenerateRequest, SamplingParams
from agentopd.engines.fast import FastEngine

SHAPES = {"0.6b": (1024, 3072), "1.7b": (2048, 6144)}  # hidden, intermediate (28 layers, 16 q / 8 kv heads of 128)


def build(shape: str, shared: bool) -> FastEngine:
    from engine_gpu import model_bf16

    engine = FastEngine(model_bf16(*SHAPES[shape]), device="cuda", dtype=torch.bfloat16, max_batch_size=256,
                        max_model_len=4096, kv_cache_gb=40.0, shared_prompts=shared)
    asyncio.run(play(engine, tasks=8, n=4, prompt=128, tokens=32, seed=1))  # kernels compiled, allocator settled
    return engine


async def play(engine: FastEngine, tasks: int, n: int, prompt: int, tokens: int, seed: int) -> tuple[float, int]:
    rng = random.Random(seed)
    vocab = engine.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(prompt)] for _ in range(tasks)]
    reqs = [GenerateRequest(prompts[t], SamplingParams(temperature=1.0, seed=seed * 10_000 + t * 100 + i,
                                                       max_tokens=rng.randint(tokens * 3 // 4, tokens * 5 // 4)),
                            f"s{seed}-{t}-{i}") for t in range(tasks) for i in range(n)]
    t0 = time.perf_counter()
    out = await asyncio.gather(*[engine.generate(r) for r in reqs])
    wall = time.perf_counter() - t0
    for r in reqs:
        engine.release(r.episode_id)
    return wall, sum(len(o.token_ids) for o in out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1.7b", choices=sorted(SHAPES))
    ap.add_argument("--tasks", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=384)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.shape}, {args.tasks} tasks x "
          f"{args.n}, {args.prompt}-token prompts, ~{args.tokens} tokens", flush=True)
    arms = {"tasks": (args.tasks, args.n), "unshared": (args.tasks * args.n, 1)}
    results: dict[str, dict[str, list[float]]] = {a: {"on": [], "off": []} for a in arms}
    for shared in (True, False):
        key = "on" if shared else "off"
        engine = build(args.shape, shared)
        for rep in range(args.reps):
            for arm, (tasks, n) in arms.items():
                before = dict(engine.timings)
                wall, gen = asyncio.run(play(engine, tasks, n, args.prompt, args.tokens, seed=100 + rep))
                results[arm][key].append(gen / wall)
                d = {k: engine.timings[k] - before[k] for k in before}
                share = d["shared_prompt_rows"] / max(d["decode_rows"], 1)
                print(f"{arm:9s} shared_prompts={key:3s} run {rep + 1}: {gen / wall:8,.0f} tok/s ({gen:,} tokens in "
                      f"{wall:.1f} s; {d['decode_rows'] / max(d['decode_steps'], 1):.0f} rows a decode step, "
                      f"{100 * share:.0f}% of them in a shared-prompt tile; prepare "
                      f"{1e3 * d['prepare'] / max(d['steps'], 1):.2f} ms a step)", flush=True)
        asyncio.run(engine.close())
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    lines = ["| arm | shared_prompts on, tok/s | off, tok/s | on / off |", "|---|---|---|---|"]
    summary = {}
    for arm, r in results.items():
        on, off = max(r["on"]), max(r["off"])
        summary[arm] = {"on_tok_s": on, "off_tok_s": off, "ratio": on / off}
        lines.append(f"| {arm} | {on:,.0f} | {off:,.0f} | {on / off:.2f} |")
    print("\n" + "\n".join(lines), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "shared_prompt_gpu.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                                    "summary": summary, "runs": results}, indent=1))


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
