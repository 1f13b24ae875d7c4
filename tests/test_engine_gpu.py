"""HFEngine logprob consistency on CUDA (bf16 and fp32): run once on a GPU machine.

    pytest tests/test_engine_gpu.py -s -m gpu

A random-init Qwen3-shaped model (hidden 1024, 8 layers, vocab 32k, ~0.2B parameters) samples
16 concurrent requests x 64 tokens; each reported logprob is compared with
`log_softmax(logits / T)` of a teacher-forced forward of the same model, same dtype, over
prompt + generation (one sequence, no padding). The measured max / mean absolute differences
are printed; the asserted bounds are loose ceilings, the printed numbers are the result.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from agentopd.engines import GenerateRequest, SamplingParams
from agentopd.engines.hf import HFEngine

CEILING = {torch.bfloat16: 0.5, torch.float32: 2e-3}


def gpu_model(dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
        initializer_range=0.05,  # less flat than the default 0.02, closer to a trained model's entropy
    )
    return Qwen3ForCausalLM(cfg).to(device="cuda", dtype=dtype).eval()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gpu_logprobs_match_teacher_forced_forward(dtype, temperature):
    model = gpu_model(dtype)
    rng = random.Random(0)
    prompts = [[rng.randrange(32000) for _ in range(rng.randrange(16, 200))] for _ in range(16)]
    reqs = [GenerateRequest(p, SamplingParams(temperature=temperature, max_tokens=64, seed=i))
            for i, p in enumerate(prompts)]
    engine = HFEngine(model)

    async def go():
        try:
            return await asyncio.gather(*[engine.generate(r) for r in reqs])
        finally:
            await engine.close()

    results = asyncio.run(go())
    diffs, entropies = [], []
    with torch.no_grad():
        for p, r in zip(prompts, results):
            ids_1T = torch.tensor([p + r.token_ids], device="cuda")
            logprobs_TV = torch.log_softmax(model(input_ids=ids_1T).logits[0].float() / temperature, -1)
            rows_GV = logprobs_TV[len(p) - 1 : len(p) + len(r.token_ids) - 1]
            ref_G = rows_GV.gather(1, torch.tensor(r.token_ids, device="cuda")[:, None])[:, 0]
            diffs.append((torch.tensor(r.logprobs, device="cuda") - ref_G).abs())
            entropies.append(-(rows_GV.exp() * rows_GV).sum(-1))
    diff_N = torch.cat(diffs)
    worst, mean = diff_N.max().item(), diff_N.mean().item()
    print(f"\n[GPU logprob consistency] {torch.cuda.get_device_name()} dtype={dtype} T={temperature}: "
          f"max |engine - teacher-forced| = {worst:.3e}, mean = {mean:.3e}, p99 = "
          f"{diff_N.quantile(0.99).item():.3e} over {diff_N.numel()} tokens "
          f"(mean entropy {torch.cat(entropies).mean().item():.2f} nats)")
    assert worst < CEILING[dtype]
