"""Packing: no padding, positions restart, loss rows line up, and packed forwards equal separate ones."""

import pytest
import torch
from _tiny import make_samples, one_thread, tiny_model  # noqa: F401  (one_thread: autouse fixture)

from agentopd.batch import TrainSample, dummy_micro_batch, pack
from agentopd.types import TokenStream


def _separate_logprobs(model, samples):
    """Reference: each sample alone, plain causal forward, logprob of every student token."""
    out = []
    for s in samples:
        logp_TV = torch.log_softmax(model(torch.tensor([s.token_ids]), use_cache=False).logits[0], -1)
        for r, m in enumerate(s.response_mask):
            if m:
                out.append(logp_TV[s.prompt_len + r - 1, s.token_ids[s.prompt_len + r]])
    return torch.stack(out)


def _packed_logprobs(model, mb):
    hidden_1TH = model.model(
        input_ids=mb.input_ids_1T, position_ids=mb.position_ids_1T, use_cache=False
    ).last_hidden_state
    logits_NV = model.lm_head(hidden_1TH[0, mb.loss_index_N])
    return torch.log_softmax(logits_NV, -1).gather(-1, mb.targets_N[:, None])[:, 0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_equal_separate_forwards(attn):
    model = tiny_model(attn=attn).eval()
    samples = make_samples(6, seed=3)
    with torch.no_grad():
        ref_N = _separate_logprobs(model, samples)
        mbs = pack(samples, max_tokens=10_000)
        assert len(mbs) == 1
        got_N = _packed_logprobs(model, mbs[0])
        assert got_N.shape == ref_N.shape
        torch.testing.assert_close(got_N, ref_N, atol=2e-6, rtol=0)
        # the packed layout really is what keeps sequences apart: one long sequence differs
        mb = mbs[0]
        mb.position_ids_1T = torch.arange(mb.num_tokens)[None]
        assert (_packed_logprobs(model, mb) - ref_N).abs().max() > 1e-3


def test_pack_layout_budget_and_alignment():
    samples = make_samples(9, seed=4, min_len=5, max_len=30)
    budget = 40
    mbs = pack(samples, max_tokens=budget)
    seen = []
    for mb in mbs:
        assert mb.num_tokens <= budget or len(mb.cu_seqlens_S1) == 2  # over budget only when alone
        lens = (mb.cu_seqlens_S1[1:] - mb.cu_seqlens_S1[:-1]).tolist()
        assert sum(lens) == mb.num_tokens  # no padding
        expected_pos = torch.cat([torch.arange(n) for n in lens])
        assert torch.equal(mb.position_ids_1T[0], expected_pos)
        assert torch.equal(mb.loss_index_N, mb.loss_mask_1T[0].nonzero()[:, 0])
        seen.extend(dict.fromkeys(mb.sample_index_N.tolist()))
    assert sorted(set(seen)) == [i for i, s in enumerate(samples) if s.num_student_tokens]
    # every student token appears exactly once, with its own sampler/teacher logprob and target
    all_targets = torch.cat([mb.targets_N for mb in mbs]).tolist()
    all_old = torch.cat([mb.old_logprobs_N for mb in mbs]).tolist()
    all_teacher = torch.cat([mb.teacher_logprobs_N for mb in mbs]).tolist()
    all_topk = torch.cat([mb.teacher_topk_ids_NK for mb in mbs]).tolist()
    exp_targets, exp_old, exp_teacher, exp_topk = [], [], [], []
    for s in samples:
        for r, m in enumerate(s.response_mask):
            if m:
                exp_targets.append(s.token_ids[s.prompt_len + r])
                exp_old.append(s.old_logprobs[r])
                exp_teacher.append(s.teacher_logprobs[r])
                exp_topk.append(s.teacher_topk_ids[r])
    assert all_targets == exp_targets
    assert all_old == pytest.approx(exp_old)
    assert all_teacher == pytest.approx(exp_teacher)
    assert all_topk == exp_topk


def test_long_sample_alone_and_teacher_hidden_rows():
    samples = make_samples(4, seed=5, min_len=20, max_len=30, teacher_hidden=6)
    mbs = pack(samples, max_tokens=10)  # every sample is over the budget
    assert len(mbs) == 4 and all(len(mb.cu_seqlens_S1) == 2 for mb in mbs)
    for s, mb in zip(samples, mbs):
        rows = [r for r, m in enumerate(s.response_mask) if m]
        torch.testing.assert_close(mb.teacher_hidden_NH, s.teacher_hidden[rows])


def test_sample_validation_and_from_stream():
    stream = TokenStream(
        token_ids=[5, 6, 7, 8], prompt_len=2, response_mask=[1, 0], logprobs=[-0.5, 0.0], turn_index=[0, 0]
    )
    s = TrainSample.from_stream(stream, teacher_logprobs=[-1.0, 0.0], reward=1.0, group_id=3)
    assert (s.token_ids, s.prompt_len, s.old_logprobs, s.group_id) == ([5, 6, 7, 8], 2, [-0.5, 0.0], 3)
    mb = pack([s], 100)[0]
    assert mb.loss_index_N.tolist() == [1] and mb.targets_N.tolist() == [7]
    with pytest.raises(ValueError, match="teacher_logprobs"):
        TrainSample([1, 2, 3], 1, [1, 1], [0.0, 0.0], teacher_logprobs=[0.0])
    with pytest.raises(ValueError, match="prompt_len"):
        TrainSample([1, 2], 0, [1, 1], [0.0, 0.0])
    with pytest.raises(ValueError, match="max_tokens"):
        pack([s], 0)
    assert dummy_micro_batch().num_loss_tokens == 0
