"""The fast engine on one GPU, every arm in one process: decode bandwidth, multi-turn rollouts, HFEngine baseline.

    PYTHONUNBUFFERED=1 python benchmarks/engine_gpu.py [--quick] [--reps 2]
    python benchmarks/engine_gpu.py --check-json out.json   # only the arms benchmarks/gpu_check.py tracks

Model: Qwen3-0.6B shape (28 layers, hidden 1024, 16 q / 8 kv heads, head_dim 128, vocab 151,936, tied),
random weights, bf16. Arms:
1. copy bandwidth (device-to-device, bytes read + written) -> the bandwidth floor of a decode step:
   (weights + rows x context x KV bytes per token) / bandwidth.
2. fixed-batch decode: the captured decode graph at 64/128/256 rows x context 512/1024/2048
   (tokens/s and % of the floor), plus the sampler's time per step at that row count, and the step again
   with the first half of every row's context on the same pages (episodes sharing a prompt start).
3. synthetic multi-turn rollouts through the async engine: E episodes x 4 turns, a 256-token first
   prompt (128 shared system tokens + 128 own), 128 sampled tokens per turn (T=1), observations of
   64-256 tokens: generated tokens/s, prefix-hit tokens, and the largest |logprob - teacher-forced|
   against an fp32 and a bf16 HF forward of the same weights (8 episodes' final streams).
   Each workload runs twice: one step at a time (overlap off), then the engine's default (overlap on: each step
   planned and queued before the last one's sampled tokens are read).
   Then 128 and 256 episodes at shorter contexts (128-token first prompt, 64 tokens a turn: mean decode
   context ~500, where the issue derived its 30k target), and both workloads with turns of uneven length
   (the same mean), so that episodes do not all return, and prefill, at the same step. Then an agent-shaped
   workload: a 1,024-token system prompt shared by all episodes (its pages computed once and shared).
   These arms run `--reps` times each (default 2, new seeds each time): one run moves by up to 10-20%.
4. HFEngine (transformers) on two smaller multi-turn workloads and on the 64-episode workload of arm 3,
   with the fast engine on the same ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from agentopd.engines import GenerateRequest, SamplingParams
from agentopd.engines.fast import FastEngine
from agentopd.engines.fast.attention import PAGE
from agentopd.engines.fast.kv_cache import KVPool
from agentopd.engines.fast.sampler import sample
from agentopd.engines.hf import HFEngine

VOCAB = 151936


def model_bf16(hidden: int = 1024, intermediate: int = 3072) -> Qwen3ForCausalLM:
    """A random Qwen3 of 28 layers, 16 q / 8 kv heads of 128 (0.6B's shape by default; 2048 / 6144: 1.7B's) in bf16."""
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg)
    return model.to(torch.bfloat16).eval()


def copy_bandwidth() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 10 * 2 * x.numel() / (time.perf_counter() - t)
    del x, y
    return bw


def decode_batch(rows: int, ctx: int) -> tuple[torch.Tensor, ...]:
    """A decode step's inputs: `rows` rows each at position ctx - 1 over its own pages 1.. (ids, positions, slots,
    page table, context lengths), random tokens."""
    pages = ctx // PAGE
    table = torch.arange(1, 1 + rows * pages, dtype=torch.int32, device="cuda").view(rows, pages)
    ids = torch.randint(0, VOCAB, (rows,), device="cuda")
    pos = torch.full((rows,), ctx - 1, dtype=torch.long, device="cuda")
    slots = table[:, -1].long() * PAGE + PAGE - 1
    return ids, pos, slots, table, torch.full((rows,), ctx, dtype=torch.int32, device="cuda")


def replay(engine: FastEngine, ids, pos, slots, table_RP, ctx_lens, n: int = 20) -> tuple[float, torch.Tensor]:
    """Seconds a replay of the decode graph takes (after 3 warm-ups), and its logits."""
    for _ in range(3):
        logits = engine.graphs.run(ids, pos, slots, table_RP, ctx_lens)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        logits = engine.graphs.run(ids, pos, slots, table_RP, ctx_lens)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n, logits


def fixed_batch(engine: FastEngine, bw: float, weight_bytes: int) -> list[str]:
    s = engine.runner.shape
    kv_tok = KVPool.bytes_per_token(s.layers, s.kv_heads, s.head_dim, engine.runner.dtype)
    lines = ["| rows | context | step ms | tok/s | floor ms | % of floor | sampler ms | first half of the context on shared "
             "pages: step ms |", "|---|---|---|---|---|---|---|---|"]
    params = [SamplingParams(temperature=1.0)]
    for rows in (64, 128, 256):
        for ctx in (512, 1024, 2048):
            pages = ctx // PAGE
            ids, pos, slots, table, ctx_lens = decode_batch(rows, ctx)
            step, logits = replay(engine, ids, pos, slots, table, ctx_lens)
            t = time.perf_counter()
            for i in range(5):
                sample(logits, params * rows, list(range(rows)), [ctx + i] * rows)
            torch.cuda.synchronize()
            samp = (time.perf_counter() - t) / 5
            table[:, : pages // 2] = table[0, : pages // 2]  # every row's first half on row 0's pages (a shared prompt)
            shared, _ = replay(engine, ids, pos, slots, table, ctx_lens)
            floor = (weight_bytes + rows * ctx * kv_tok) / bw
            lines.append(f"| {rows} | {ctx} | {step * 1e3:.2f} | {rows / step:,.0f} | {floor * 1e3:.2f} | "
                         f"{100 * floor / step:.0f}% | {samp * 1e3:.2f} | {shared * 1e3:.2f} |")
            print(lines[-1], flush=True)
    return lines


async def multi_turn(engine, episodes: int, turns: int, max_tokens: int, seed: int, check: int = 0, prompt: int = 256,
                     spread: int = 0, system: int | None = None):
    """E episodes x `turns`; the first prompt is `prompt` tokens, of which the first `system` (default: half) are the
    same in every episode. A turn samples `max_tokens` tokens, or with `spread` a number drawn from max_tokens +-
    spread (the same mean: random weights never sample a stop, so without it every episode returns at the same step).
    Returns wall, generated, prefix hits, `check` final streams and the mean context a sampled token was decoded at."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(prompt // 2 if system is None else system)]
    starts = [system + [rng.randrange(VOCAB) for _ in range(prompt - len(system))] for _ in range(episodes)]
    obs = [[[rng.randrange(VOCAB) for _ in range(rng.randrange(64, 257))] for _ in range(turns)] for _ in range(episodes)]
    lengths = [[rng.randint(max_tokens - spread, max_tokens + spread) for _ in range(turns)] for _ in range(episodes)]
    streams = []

    async def play(i):
        ids, gen, hits, positions, logprobs = list(starts[i]), 0, 0, [], []
        for t in range(turns):
            params = SamplingParams(temperature=1.0, max_tokens=lengths[i][t], seed=seed * 100000 + i * 10 + t)
            r = await engine.generate(GenerateRequest(ids, params, f"bench-{seed}-{i}"))
            positions += range(len(ids), len(ids) + len(r.token_ids))
            logprobs += r.logprobs
            gen += len(r.token_ids)
            hits += r.info.get("prefix_hit_tokens", 0)
            ids = ids + r.token_ids + (obs[i][t] if t < turns - 1 else [])
        engine.release(f"bench-{seed}-{i}")
        streams.append((ids, positions, logprobs))
        return gen, hits

    t = time.perf_counter()
    out = await asyncio.gather(*[play(i) for i in range(episodes)])
    wall = time.perf_counter() - t
    ctx = [p for _, positions, _ in streams for p in positions]
    return wall, sum(g for g, _ in out), sum(h for _, h in out), streams[:check], sum(ctx) / max(len(ctx), 1)


def timing_line(before: dict, after: dict) -> str:
    d = {k: after[k] - before[k] for k in after}
    return (f"  worker: {d['steps']} steps ({d['decode_steps']} decode-only); per step: schedule "
            f"{1e3 * d['schedule'] / d['steps']:.2f} ms, inputs {1e3 * d['prepare'] / d['steps']:.2f} ms, inputs+model+sampler {1e3 * d['step'] / d['steps']:.2f} ms, "
            f"advance {1e3 * d['advance'] / d['steps']:.2f} ms; {d['overlapped_steps']} steps queued ahead, "
            f"{d['mixed_graph_steps']} prompt-chunk steps replayed from a captured graph")


def logprob_gap(model_fp32, model_bf16, streams) -> tuple[float, float]:
    worst32 = worst16 = 0.0
    with torch.no_grad():
        for ids, positions, logprobs in streams:
            ids_1T = torch.tensor([ids], device="cuda")
            pos = torch.tensor(positions, device="cuda")
            got = torch.tensor(logprobs, device="cuda")
            for m, which in ((model_fp32, 32), (model_bf16, 16)):
                lp_TV = torch.log_softmax(m(input_ids=ids_1T).logits[0].float(), -1)
                ref = lp_TV[pos - 1, ids_1T[0, pos]]
                gap = (got - ref).abs().max().item()
                if which == 32:
                    worst32 = max(worst32, gap)
                else:
                    worst16 = max(worst16, gap)
    return worst32, worst16


# the multi-turn arms that benchmarks/gpu_check.py compares against its baselines: figure name -> multi_turn's
# (episodes, turns, tokens a turn) and keyword arguments (4 turns, observations of 64-256 tokens, overlap on)
CHECK_ARMS = {
    "engine/128ep_lockstep_tok_s": ((128, 4, 128), {}),  # mean decode context ~750
    "engine/256ep_lockstep_tok_s": ((256, 4, 128), {}),
    "engine/256ep_short_tok_s": ((256, 4, 64), {"prompt": 128}),  # ~490, where the 30k target was derived
    "engine/256ep_uneven_tok_s": ((256, 4, 64), {"prompt": 128, "spread": 32}),
}


def check(engine: FastEngine, reps: int, path: str) -> None:
    """The CHECK_ARMS, each the best of `reps` runs (one run moves by 10-20%), as one JSON object at `path`."""
    engine.overlap = True
    figures = {}
    for name, (workload, kwargs) in CHECK_ARMS.items():
        runs = []
        for rep in range(reps):
            wall, gen, _, _, ctx = asyncio.run(multi_turn(engine, *workload, seed=11000 + 97 * rep + len(figures), **kwargs))
            runs.append(gen / wall)
            print(f"{name}: run {rep + 1}: {gen / wall:,.0f} tok/s (mean context {ctx:.0f})", flush=True)
        figures[name] = max(runs)
    with open(path, "w") as f:
        json.dump(figures, f)


def build_engine() -> tuple[FastEngine, Qwen3ForCausalLM]:
    model = model_bf16()
    t = time.perf_counter()
    engine = FastEngine(model, device="cuda", dtype=torch.bfloat16, max_batch_size=256, max_model_len=4096,
                        num_pages=33000)
    print(f"FastEngine built in {time.perf_counter() - t:.1f} s (graphs for {engine.graphs.buckets})", flush=True)
    # warm-up: the Triton kernels compile for the variants the arms meet (prefill steps, mixed steps of many rows),
    # so that no compile lands in a timed arm
    asyncio.run(multi_turn(engine, 4, 2, 16, seed=99))
    asyncio.run(multi_turn(engine, 48, 3, 16, seed=98, spread=8))
    asyncio.run(multi_turn(engine, 48, 3, 16, seed=97, spread=8, system=0))
    return engine, model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller arms (a smoke run)")
    ap.add_argument("--reps", type=int, default=2, help="runs of each shorter-context, uneven and agent-shaped arm")
    ap.add_argument("--check-json", default=None, help="run only the CHECK_ARMS (gpu_check.py) and write them here")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    if args.check_json:
        check(build_engine()[0], args.reps, args.check_json)
        return
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    engine, model = build_engine()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print("\n## fixed-batch decode (captured graph; sampler timed separately)", flush=True)
    fixed_batch(engine, bw, weight_bytes)

    print("\n## engine-level decode (128 requests, 512-token prompts, 256 sampled tokens each)", flush=True)
    async def plain(engine):
        rng = random.Random(5)
        reqs = [GenerateRequest([rng.randrange(VOCAB) for _ in range(512)], SamplingParams(max_tokens=256, seed=i))
                for i in range(128)]
        t0 = time.perf_counter()
        out = await asyncio.gather(*[engine.generate(r) for r in reqs])
        return sum(len(r.token_ids) for r in out), time.perf_counter() - t0
    before = dict(engine.timings)
    gen, wall = asyncio.run(plain(engine))
    print(f"{gen} tokens in {wall:.2f} s = {gen / wall:,.0f} tok/s (prefill of 65,536 prompt tokens included)", flush=True)
    print(timing_line(before, engine.timings), flush=True)

    print("\n## multi-turn rollouts (FastEngine, 4 turns, 128 tokens/turn)", flush=True)
    model32 = None
    for episodes in ((64, 128) if args.quick else (64, 128, 256)):
        for overlap in (False, True):  # one decode step at a time, then each queued before the last is read
            engine.overlap = overlap
            before = dict(engine.timings)
            wall, gen, hits, streams, ctx = asyncio.run(multi_turn(engine, episodes, 4, 128, seed=episodes + 1000 * overlap,
                                                                        check=8))  # own prompts: no cache hits from the other arm
            print(timing_line(before, engine.timings), flush=True)
            if model32 is None:
                model32 = model_bf16().float()  # same seed: the same weights, in fp32
                model32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
            g32, g16 = logprob_gap(model32, model, streams)
            print(f"| {episodes} episodes | overlap {'on' if overlap else 'off'} | {gen} generated | {wall:.1f} s | "
                  f"{gen / wall:,.0f} tok/s | mean context {ctx:.0f} | prefix hits {hits} tokens | max |lp - fp32 TF| {g32:.3f} | "
                  f"max |lp - bf16 TF| {g16:.3f} |", flush=True)
    del model32
    torch.cuda.empty_cache()

    print("\n## multi-turn rollouts at shorter contexts (4 turns, 128-token first prompt, 64 tokens/turn, "
          "observations 64-256; overlap on)", flush=True)
    engine.overlap = True
    for episodes in ((128,) if args.quick else (128, 256)):
        for rep in range(args.reps):
            before = dict(engine.timings)
            wall, gen, hits, _, ctx = asyncio.run(multi_turn(engine, episodes, 4, 64, seed=5000 + episodes + 10**6 * rep,
                                                             prompt=128))
            print(timing_line(before, engine.timings), flush=True)
            print(f"| {episodes} episodes | short | run {rep + 1} | {gen} generated | {wall:.1f} s | {gen / wall:,.0f} tok/s | "
                  f"mean context {ctx:.0f} | prefix hits {hits} tokens |", flush=True)

    print("\n## the same two workloads with turns of uneven length (each turn 32-96 tokens at the short contexts, "
          "64-192 at the long ones: the same means; episodes return at different steps, as they do with real "
          "stop tokens; overlap on)", flush=True)
    for episodes, prompt, tokens, spread in (((128, 128, 64, 32),) if args.quick else
                                             ((128, 128, 64, 32), (256, 128, 64, 32), (128, 256, 128, 64), (256, 256, 128, 64))):
        for rep in range(args.reps):
            before = dict(engine.timings)
            wall, gen, hits, _, ctx = asyncio.run(multi_turn(engine, episodes, 4, tokens, prompt=prompt, spread=spread,
                                                             seed=7000 + episodes + prompt + 10**6 * rep))
            print(timing_line(before, engine.timings), flush=True)
            print(f"| {episodes} episodes | {tokens} +- {spread} tokens a turn | run {rep + 1} | {gen} generated | "
                  f"{wall:.1f} s | {gen / wall:,.0f} tok/s | mean context {ctx:.0f} | prefix hits {hits} tokens |", flush=True)

    print("\n## agent-shaped: a 1,024-token system prompt (tools) shared by every episode, 128 own tokens, 4 turns of "
          "128 +- 64 tokens, observations 64-256 (overlap on)", flush=True)
    for episodes in ((128,) if args.quick else (128, 256)):
        for rep in range(args.reps):
            before = dict(engine.timings)
            wall, gen, hits, _, ctx = asyncio.run(multi_turn(engine, episodes, 4, 128, seed=9000 + episodes + 10**6 * rep,
                                                             prompt=1152, spread=64, system=1024))
            print(timing_line(before, engine.timings), flush=True)
            print(f"| {episodes} episodes | agent-shaped | run {rep + 1} | {gen} generated | {wall:.1f} s | "
                  f"{gen / wall:,.0f} tok/s | mean context {ctx:.0f} | prefix hits {hits} tokens |", flush=True)

    # episodes, turns, tokens a turn; the last is the 64-episode workload of the multi-turn table above
    workloads = ((64, 2, 64),) if args.quick else ((64, 2, 64), (128, 2, 64), (64, 4, 128))
    print("\n## baseline: HFEngine (max_batch_size = episodes) vs FastEngine", flush=True)
    fast = {w: asyncio.run(multi_turn(engine, *w, seed=7))[:2] for w in workloads}
    asyncio.run(engine.close())
    del engine
    torch.cuda.empty_cache()
    for w in workloads:
        hf = HFEngine(model, max_batch_size=w[0])
        hf_wall, hf_gen = asyncio.run(multi_turn(hf, *w, seed=7))[:2]
        asyncio.run(hf.close())
        fast_wall, fast_gen = fast[w]
        print(f"{w[0]} episodes x {w[1]} turns x {w[2]} tokens: HFEngine {hf_gen} tokens in {hf_wall:.1f} s = "
              f"{hf_gen / hf_wall:,.0f} tok/s; FastEngine {fast_gen} tokens in {fast_wall:.2f} s = "
              f"{fast_gen / fast_wall:,.0f} tok/s ({(fast_gen / fast_wall) / (hf_gen / hf_wall):.0f}x)", flush=True)


if __name__ == "__main__":
    main()
