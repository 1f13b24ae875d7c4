"""`engine.kv_cache_dtype=fp8`: the fast engine's KV pool in float8 e4m3 (half the bytes a token of bf16).

On CPU (the torch path the kernels are defined by): what the pool stores (clamped to fp8's finite range, not NaN),
that attention reads exactly those rounded values, that an engine with an fp8 pool runs and its logprobs stay near the
teacher-forced forward while differing from the exact pool's, and the config's checks. The Triton kernels' fp8 reads
and writes are GPU tests in tests/test_fast_engine.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_fast_engine import VOCAB, prompts, teacher_forced, tiny_model

from agentopd.backends.stages import kv_dtype_option
from agentopd.config import load_config
from agentopd.engines import GenerateRequest, SamplingParams
from agentopd.engines.fast import FastEngine
from agentopd.engines.fast.attention import PAGE, AttnBatch, gather, reference_attention
from agentopd.engines.fast.kv_cache import (
    FP8,
    FP8_MAX,
    KVPool,
    kv_dtype,
    store,
    to_pool,
)


def test_the_pool_stores_fp8_clamped_to_its_range_and_gathers_it_back():
    x = torch.tensor([[0.1234, -3.3, 1000.0, -1e6, 448.0, 0.0]]).repeat(3, 1)[:, None, :]  # [3 tokens, 1 head, 6]
    stored = to_pool(x, FP8)
    assert stored.dtype == FP8 and not stored.float().isnan().any()
    assert stored.float()[0, 0].tolist()[2:5] == [FP8_MAX, -FP8_MAX, FP8_MAX]  # a plain cast gives NaN here
    assert torch.equal(stored.float()[:, :, [0, 1, 5]], x[:, :, [0, 1, 5]].to(FP8).float())  # in range: a plain cast
    pool = torch.zeros(4 * PAGE, 1, 6, dtype=FP8)
    store(pool, torch.tensor([5, 17, 40]), x)
    got = gather(pool, torch.tensor([[40, 17], [5, 5]]))
    assert got.dtype == FP8 and got.shape == (2, 2, 1, 6)
    assert torch.equal(got[0, 1].float(), stored[1].float()) and torch.equal(got[1, 0].float(), stored[0].float())
    assert to_pool(x, torch.float32) is x  # the model's dtype: untouched


def test_attention_over_an_fp8_pool_is_attention_over_its_rounded_values():
    torch.manual_seed(0)
    hq, hkv, d = 4, 2, 16
    k, v = torch.randn(8 * PAGE, hkv, d) * 3, torch.randn(8 * PAGE, hkv, d) * 3
    k8, v8 = to_pool(k, FP8), to_pool(v, FP8)
    table = torch.tensor([[1, 2, 3], [4, 0, 0], [5, 6, 7]], dtype=torch.int32)
    rows = [(40, 1), (9, 1), (37, 5)]  # two decode rows and a chunk of 5 queries
    starts = [0, 1, 2]
    batch = AttnBatch(None, None, table, torch.tensor([c for c, _ in rows], dtype=torch.int32),
                      torch.tensor(starts, dtype=torch.int32), [n for _, n in rows], starts, [c for c, _ in rows])
    q = torch.randn(7, hq, d)
    got = reference_attention(q, k8, v8, batch, 0.25)
    batch.memo.clear()
    rounded = reference_attention(q, k8.float(), v8.float(), batch, 0.25)
    batch.memo.clear()
    exact = reference_attention(q, k, v, batch, 0.25)
    assert got.dtype == q.dtype and torch.equal(got, rounded)
    assert 1e-4 < (got - exact).abs().max() < 0.5  # fp8 is in effect, and near


def test_an_engine_with_an_fp8_pool_samples_near_teacher_forcing():
    model = tiny_model()
    engine = FastEngine(model, max_batch_size=4, kv_cache_dtype="fp8")
    exact = FastEngine(model, max_batch_size=4)
    assert engine.kv_pool.kv.dtype == FP8 and engine.kv_pool.kv.element_size() == 1
    assert KVPool.bytes_per_token(2, 2, 16, FP8) * 4 == KVPool.bytes_per_token(2, 2, 16, torch.float32)
    ps = prompts(6, seed=3)
    reqs = [GenerateRequest(p, SamplingParams(temperature=1.0, max_tokens=24, seed=i), f"e{i}") for i, p in enumerate(ps)]

    async def go(e):
        try:
            return await asyncio.gather(*[e.generate(r) for r in reqs])
        finally:
            await e.close()

    results, exact_results = asyncio.run(go(engine)), asyncio.run(go(exact))
    diffs, worst_exact = [], 0.0
    for p, r, x in zip(ps, results, exact_results):
        assert len(r.token_ids) == 24 and all(0 <= t < VOCAB for t in r.token_ids)
        ref = teacher_forced(model, p + r.token_ids, list(range(len(p), len(p) + len(r.token_ids))), 1.0)
        diffs += [abs(a - b) for a, b in zip(r.logprobs, ref)]
        ref_x = teacher_forced(model, p + x.token_ids, list(range(len(p), len(p) + len(x.token_ids))), 1.0)
        worst_exact = max(worst_exact, max(abs(a - b) for a, b in zip(x.logprobs, ref_x)))
    mean = sum(diffs) / len(diffs)
    print(f"\nfp8 pool: |engine - fp32 teacher-forced| mean {mean:.2e}, max {max(diffs):.2e} (the exact pool's max: "
          f"{worst_exact:.2e})")
    # the tiny model's peaked logits (initializer_range 0.3) magnify fp8's 3-bit rounding of K: the mean stays small
    assert worst_exact < 5e-5 < mean < 0.25  # measured 0.106 (max 0.49); a broken pool is nats off


def test_kv_cache_dtype_is_checked_and_reaches_the_engines():
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or 'fp8', got 'fp16'"):
        kv_dtype("fp16", torch.bfloat16)
    assert kv_dtype("auto", torch.bfloat16) == torch.bfloat16 and kv_dtype(None, torch.float32) == torch.float32
    assert kv_dtype_option(load_config("sql_db")) == {}
    assert kv_dtype_option(load_config("sql_db", overrides=["engine.kv_cache_dtype=fp8"])) == {"kv_cache_dtype": "fp8"}
    with pytest.raises(ValueError, match="engine.kv_cache_dtype=fp8 needs engine.kind fast or vllm"):
        load_config("sql_db", overrides=["engine.kv_cache_dtype=fp8", "engine.kind=hf"])
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        load_config("sql_db", overrides=["engine.kv_cache_dtype=int4"])
