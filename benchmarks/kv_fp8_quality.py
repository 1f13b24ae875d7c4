"""What an fp8 KV pool (`engine.kv_cache_dtype=fp8`) does to a real checkpoint's sampled logprobs, on CPU.

    python benchmarks/kv_fp8_quality.py --model $(agentopd fetch-model qwen2.5-coder-0.5b)   # ~2 min on 2 cores

The fast engine in `--dtype` (default bfloat16) samples 4 chat prompts x 64 tokens at T=1 with a pool in the model's
dtype and with an fp8 pool (the same seeds); every sampled token's logprob is compared with a teacher-forced fp32
forward of the same weights: mean and max |difference| per pool, and how many episodes came out token for token the
same. benchmarks/kv_fp8.py measures the speed on a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentopd.engines import GenerateRequest, SamplingParams
from agentopd.engines.fast import FastEngine

QUESTIONS = ["What is 37 * 48 + 12? Use the calculator tool.", "Write a SQL query that counts the orders per customer.",
             "Explain in two sentences what a paged KV cache is.", "Compute 2**20 - 12345 step by step."]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a model folder (e.g. `agentopd fetch-model qwen2.5-coder-0.5b`)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    fp32 = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for q in QUESTIONS]

    def teacher_forced(ids: list[int], positions: list[int]) -> list[float]:
        with torch.no_grad():
            lp = torch.log_softmax(fp32(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        return [lp[p - 1, ids[p]].item() for p in positions]

    played, lines = {}, [f"{args.model} in {args.dtype}, {len(prompts)} prompts x {args.tokens} tokens at T=1", "",
                         "| KV pool | mean \\|logprob - fp32 teacher-forced\\| | max | seconds |", "|---|---|---|---|"]
    for kv in ("auto", "fp8"):
        engine = FastEngine(model, max_batch_size=4, kv_cache_dtype=kv)

        async def play(e=engine):
            try:
                return await asyncio.gather(*[e.generate(GenerateRequest(p, SamplingParams(temperature=1.0, max_tokens=args.tokens, seed=i), f"q{i}"))
                                              for i, p in enumerate(prompts)])  # fmt: skip
            finally:
                await e.close()

        t = time.perf_counter()
        results = asyncio.run(play())
        wall = time.perf_counter() - t
        diffs = [abs(a - b) for p, r in zip(prompts, results)
                 for a, b in zip(r.logprobs, teacher_forced(p + r.token_ids, list(range(len(p), len(p) + len(r.token_ids)))))]  # fmt: skip
        played[kv] = results
        lines.append(f"| {'fp8' if kv == 'fp8' else args.dtype} | {sum(diffs) / len(diffs):.4f} | {max(diffs):.3f} | {wall:.0f} |")
        print(lines[-1], flush=True)
    same = sum(a.token_ids == b.token_ids for a, b in zip(played["auto"], played["fp8"]))
    lines += ["", f"episodes sampled token for token alike with the same seeds: {same} of {len(prompts)}"]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
