"""HFEngine on CPU with a tiny random-init Qwen3 (vocab 300, hidden 64, 2 layers, fp32).

The key check is logprob consistency: the logprob the engine reports for each sampled token
equals `log_softmax(logits / T)` of a teacher-forced forward over prompt + generation, within
LOGPROB_TOL (fp32 on CPU; the measured max difference is printed, about 1e-5).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from agentopd.engines import FinishReason, GenerateRequest, SamplingParams, make_engine
from agentopd.engines.hf import HFEngine
from agentopd.engines.sampling import filter_logprobs, sample_rows

LOGPROB_TOL = 5e-5  # fp32, CPU, |logprob| up to ~30: batched/cached decode vs one teacher-forced forward
VOCAB = 300


def tiny_model(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        initializer_range=0.3,  # peaked enough that greedy ties and near-uniform rows are rare
    )
    return Qwen3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model() -> Qwen3ForCausalLM:
    torch.set_num_threads(1)
    return tiny_model()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def run_all(engine: HFEngine, reqs: list[GenerateRequest]):
    async def go():
        try:
            return await asyncio.gather(*[engine.generate(r) for r in reqs])
        finally:
            await engine.close()

    return asyncio.run(go())


def one_at_a_time(model, reqs: list[GenerateRequest]):
    engine = HFEngine(model, max_batch_size=1)

    async def go():
        try:
            return [await engine.generate(r) for r in reqs]
        finally:
            await engine.close()

    return asyncio.run(go())


def teacher_forced_logprobs(model, prompt: list[int], gen: list[int], temperature: float) -> list[float]:
    ids_1T = torch.tensor([prompt + gen])
    with torch.no_grad():
        logits_TV = model(input_ids=ids_1T).logits[0].float()
    t = temperature if temperature > 0 else 1.0
    logprobs_TV = torch.log_softmax(logits_TV / t, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(gen) - 1)
    return logprobs_TV[pos, torch.tensor(gen)].tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forced_forward(model, temperature):
    ps = prompts(12, seed=1)
    params = SamplingParams(temperature=temperature, top_p=1.0, max_tokens=24)
    reqs = [GenerateRequest(p, dataclasses.replace(params, seed=i)) for i, p in enumerate(ps)]
    results = run_all(HFEngine(model), reqs)
    worst = 0.0
    for p, r in zip(ps, results):
        assert len(r.token_ids) == 24 and r.finish_reason == FinishReason.LENGTH
        ref = teacher_forced_logprobs(model, p, r.token_ids, temperature)
        worst = max(worst, max(abs(a - b) for a, b in zip(r.logprobs, ref)))
    print(f"\nHFEngine fp32 CPU T={temperature}: max |engine - teacher-forced| logprob = {worst:.2e}"
          f" (tolerance {LOGPROB_TOL:.0e})")
    assert worst < LOGPROB_TOL


def test_batched_greedy_equals_one_at_a_time(model):
    ps = prompts(10, seed=2)
    reqs = [GenerateRequest(p, SamplingParams(temperature=0, max_tokens=20)) for p in ps]
    batched = run_all(HFEngine(model), reqs)
    single = one_at_a_time(model, reqs)
    for b, s in zip(batched, single):
        assert b.token_ids == s.token_ids
        assert max(abs(x - y) for x, y in zip(b.logprobs, s.logprobs)) < LOGPROB_TOL


def test_stop_id_stops_and_is_included(model):
    p = prompts(1, seed=3)[0]
    free = run_all(HFEngine(model), [GenerateRequest(p, SamplingParams(temperature=0, max_tokens=12))])[0]
    stop = free.token_ids[5]
    first = free.token_ids.index(stop)
    r = run_all(HFEngine(model), [GenerateRequest(p, SamplingParams(temperature=0, max_tokens=12,
                                                                    stop_token_ids=(stop, VOCAB - 1)))])[0]
    assert r.finish_reason == FinishReason.STOP
    assert r.token_ids == free.token_ids[: first + 1] and r.token_ids[-1] == stop
    assert len(r.logprobs) == len(r.token_ids)


def test_max_tokens_and_context_limit_give_length(model):
    p = prompts(1, seed=4)[0]
    r = run_all(HFEngine(model), [GenerateRequest(p, SamplingParams(max_tokens=7, seed=0))])[0]
    assert r.finish_reason == FinishReason.LENGTH and len(r.token_ids) == 7
    limit = len(p) + 3
    reqs = [GenerateRequest(p, SamplingParams(max_tokens=50, seed=0)),
            GenerateRequest(list(range(limit)), SamplingParams(max_tokens=5))]
    capped, too_long = run_all(HFEngine(model, max_model_len=limit), reqs)
    assert capped.finish_reason == FinishReason.LENGTH and len(capped.token_ids) == 3
    assert too_long.finish_reason == FinishReason.LENGTH and too_long.token_ids == []


def test_mixed_sampling_params_in_one_batch(model):
    ps = prompts(5, seed=5)
    mixed = [
        SamplingParams(temperature=0, max_tokens=16),
        SamplingParams(temperature=1.0, top_k=1, max_tokens=16, seed=1),  # top-1 sampling is greedy
        SamplingParams(temperature=0.8, top_p=1e-6, max_tokens=16, seed=2),  # the nucleus is the top token
        SamplingParams(temperature=1.0, max_tokens=9, seed=3),
        SamplingParams(temperature=0.5, top_k=20, top_p=0.9, max_tokens=16, seed=4),
    ]
    reqs = [GenerateRequest(ps[0], p) for p in mixed[:3]] + [GenerateRequest(ps[i], mixed[i]) for i in (3, 4)]
    results = run_all(HFEngine(model), reqs)
    greedy, top1, nucleus, free, narrow = results
    assert top1.token_ids == greedy.token_ids == nucleus.token_ids
    # Truncation is not renormalised: the reported logprob is the full softmax at that temperature.
    assert top1.logprobs == pytest.approx(greedy.logprobs, abs=LOGPROB_TOL)
    ref = teacher_forced_logprobs(model, ps[0], nucleus.token_ids, 0.8)
    assert nucleus.logprobs == pytest.approx(ref, abs=LOGPROB_TOL)
    assert len(free.token_ids) == 9
    # Each seeded request reproduces alone what it sampled in the mixed batch.
    for r, req in [(free, reqs[3]), (narrow, reqs[4])]:
        assert one_at_a_time(model, [req])[0].token_ids == r.token_ids


def test_filter_logprobs_keeps_top_k_and_nucleus():
    lp_V = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert torch.isfinite(filter_logprobs(lp_V, 2, 1.0)).tolist() == [True, True, False, False, False]
    assert torch.isfinite(filter_logprobs(lp_V, 0, 0.7)).tolist() == [True, True, False, False, False]
    assert torch.isfinite(filter_logprobs(lp_V, 0, 0.71)).tolist() == [True, True, True, False, False]
    assert torch.isfinite(filter_logprobs(lp_V, 0, 1e-9)).sum() == 1


def test_update_weights_changes_outputs_and_matches_fresh_model():
    torch.set_num_threads(1)
    old, new = tiny_model(seed=0), tiny_model(seed=7)
    reqs = [GenerateRequest(p, SamplingParams(temperature=0, max_tokens=12)) for p in prompts(4, seed=6)]
    engine = HFEngine(old)

    async def go():
        before = await asyncio.gather(*[engine.generate(r) for r in reqs])
        await engine.update_weights({k: v.clone() for k, v in new.state_dict().items()})
        after = await asyncio.gather(*[engine.generate(r) for r in reqs])
        with pytest.raises(ValueError, match="not_a_weight"):
            await engine.update_weights({"not_a_weight": torch.zeros(1)})
        await engine.close()
        return before, after

    before, after = asyncio.run(go())
    fresh = one_at_a_time(new, reqs)
    assert [r.token_ids for r in before] != [r.token_ids for r in after]
    assert [r.token_ids for r in after] == [r.token_ids for r in fresh]
    assert after[0].info["weight_version"] == 1 and before[0].info["weight_version"] == 0


def test_staggered_concurrent_requests_all_complete_and_match(model):
    """Requests join a batch that is already decoding (KV caches merged) and leave it at different times."""
    rng = random.Random(8)
    ps = prompts(24, seed=8)
    reqs = [GenerateRequest(p, SamplingParams(temperature=0, max_tokens=rng.randrange(1, 30))) for p in ps]
    delays = [rng.random() * 0.05 for _ in reqs]
    engine = HFEngine(model, max_batch_size=8)

    async def late(req, delay):
        await asyncio.sleep(delay)
        return await engine.generate(req)

    async def go():
        try:
            return await asyncio.gather(*[late(r, d) for r, d in zip(reqs, delays)])
        finally:
            await engine.close()

    results = asyncio.run(go())
    single = one_at_a_time(model, reqs)
    for req, r, s in zip(reqs, results, single):
        assert len(r.token_ids) == req.params.max_tokens
        assert r.token_ids == s.token_ids


def test_cancelled_request_does_not_disturb_others_and_engine_survives_loops(model):
    ps = prompts(3, seed=9)
    engine = HFEngine(model)

    async def go():
        victim = asyncio.ensure_future(engine.generate(GenerateRequest(ps[0], SamplingParams(max_tokens=200))))
        others = [engine.generate(GenerateRequest(p, SamplingParams(temperature=0, max_tokens=15))) for p in ps[1:]]
        await asyncio.sleep(0.01)
        victim.cancel()
        return await asyncio.gather(*others)

    first = asyncio.run(go())
    second = asyncio.run(go())  # a second event loop reuses the same engine
    asyncio.run(engine.close())
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
    assert all(len(r.token_ids) == 15 for r in first)


def test_make_engine_kinds(model, tmp_path):
    assert isinstance(make_engine("hf", model, max_batch_size=2), HFEngine)
    model.save_pretrained(tmp_path)
    req = GenerateRequest(prompts(1, seed=10)[0], SamplingParams(temperature=0, max_tokens=6))
    from_path = run_all(make_engine("hf", str(tmp_path), dtype="float32"), [req])[0]
    assert from_path.token_ids == run_all(HFEngine(model), [req])[0].token_ids
    with pytest.raises(ValueError, match="unknown engine kind 'tgi'"):
        make_engine("tgi", model)
    with pytest.raises(ValueError, match="token_ids is empty"):
        asyncio.run(HFEngine(model).generate(GenerateRequest([], SamplingParams())))


def test_sample_rows_follows_the_tempered_distribution_and_truncation():
    probs_V = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    n = 4000
    logits_BV = probs_V.log().expand(n, -1)
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    tokens, logprobs = sample_rows(logits_BV, [SamplingParams(temperature=1.0)] * n, gens)
    freq_V = torch.bincount(torch.tensor(tokens), minlength=5).float() / n
    assert torch.allclose(freq_V, probs_V, atol=4 * (0.25 / n) ** 0.5)  # 4 sigma
    assert logprobs == pytest.approx(probs_V.log()[tokens].tolist(), abs=1e-6)
    tempered_V = torch.softmax(probs_V.log() / 0.5, -1)
    tokens, _ = sample_rows(logits_BV, [SamplingParams(temperature=0.5)] * n, gens)
    freq_V = torch.bincount(torch.tensor(tokens), minlength=5).float() / n
    assert torch.allclose(freq_V, tempered_V, atol=4 * (0.25 / n) ** 0.5)
    tokens, logprobs = sample_rows(logits_BV[:500], [SamplingParams(top_k=2)] * 500, gens[:500])
    assert set(tokens) == {0, 1}
    assert logprobs == pytest.approx(probs_V.log()[tokens].tolist(), abs=1e-6)  # not renormalised


def test_a_bf16_engine_over_an_fp32_model_keeps_its_rotary_embedding_in_fp32(model):
    """The engine casts the weights only (agentopd.weights_dtype): Module.to(bf16) also cast the rotary inv_freq, and the
    engine then sampled from RoPE angles ~0.1% off the trainer's fp32 ones, growing with the position."""
    import copy

    from agentopd.weights_dtype import cast_weights

    engine = HFEngine(copy.deepcopy(model), dtype=torch.bfloat16)
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    assert engine.model.model.rotary_emb.inv_freq.dtype == torch.float32
    loaded = cast_weights(copy.deepcopy(model), torch.bfloat16)  # what backends.stages does for an engine copy
    assert loaded.model.rotary_emb.inv_freq.dtype == torch.float32 and loaded.lm_head.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32 and next(model.parameters()).dtype == torch.float32
