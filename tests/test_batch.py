"""Packing: positions restart, padding is inert, loss rows line up, packed forwards equal separate ones."""

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
    hidden_BTH = model.model(
        input_ids=mb.input_ids_BT, position_ids=mb.position_ids_BT, use_cache=False
    ).last_hidden_state
    logits_NV = model.lm_head(hidden_BTH[mb.loss_mask_BT])
    return torch.log_softmax(logits_NV, -1).gather(-1, mb.targets_N[:, None])[:, 0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("row_tokens", [None, 48])
def test_packed_logprobs_equal_separate_forwards(attn, row_tokens):
    model = tiny_model(attn=attn).eval()
    samples = make_samples(6, seed=3)
    with torch.no_grad():
        mbs = pack(samples, max_tokens=10_000, row_tokens=row_tokens)
        assert len(mbs) == 1
        mb = mbs[0]
        assert mb.input_ids_BT.shape[0] == (1 if row_tokens is None else 4)
        # reference in the packed order (rows are filled longest first)
        order = list(dict.fromkeys(mb.sample_index_N.tolist()))
        ref_N = _separate_logprobs(model, [samples[i] for i in order])
        got_N = _packed_logprobs(model, mb)
        assert got_N.shape == ref_N.shape
        torch.testing.assert_close(got_N, ref_N, atol=2e-6, rtol=0)
        # the restarting positions really are what keeps sequences apart
        mb.position_ids_BT = torch.arange(mb.input_ids_BT.shape[1]).expand_as(mb.input_ids_BT)
        assert (_packed_logprobs(model, mb) - ref_N).abs().max() > 1e-3


@pytest.mark.parametrize("row_tokens", [None, 30])
def test_pack_layout_budget_and_alignment(row_tokens):
    samples = make_samples(9, seed=4, min_len=5, max_len=30)
    budget = 70
    mbs = pack(samples, max_tokens=budget, row_tokens=row_tokens)
    rows = {}
    for mb in mbs:
        assert mb.num_slots <= budget or mb.input_ids_BT.shape[0] == 1  # over budget only as a single row
        for b, lens in enumerate(mb.seq_lens):
            pad = mb.input_ids_BT.shape[1] - sum(lens)
            if row_tokens is None:
                assert pad == 0 and len(mb.seq_lens) == 1  # one row, no padding at all
            # padding restarts after several sequences, continues a row's only one
            expected_pos = torch.arange(sum(lens) + pad) if len(lens) == 1 else torch.cat([torch.arange(n) for n in lens + [pad]])
            assert torch.equal(mb.position_ids_BT[b], expected_pos)
            assert not mb.loss_mask_BT[b, sum(lens) :].any()  # padding carries no loss
        assert torch.equal(mb.targets_N, mb.targets_BT[mb.loss_mask_BT])
        for i in mb.sample_index_N.tolist():
            rows.setdefault(i, id(mb))
    assert sorted(rows) == [i for i, s in enumerate(samples) if s.num_student_tokens]
    # every student token appears exactly once, with its own sampler/teacher logprob and target
    got = {}
    for mb in mbs:
        for n, i in enumerate(mb.sample_index_N.tolist()):
            got.setdefault(i, []).append(
                (mb.targets_N[n].item(), mb.old_logprobs_N[n].item(), mb.teacher_logprobs_N[n].item(),
                 mb.teacher_topk_ids_NK[n].tolist())
            )
    for i, s in enumerate(samples):
        expected = [
            (s.token_ids[s.prompt_len + r], s.old_logprobs[r], s.teacher_logprobs[r], s.teacher_topk_ids[r])
            for r, m in enumerate(s.response_mask) if m
        ]
        assert [(t, pytest.approx(o), pytest.approx(tl), k) for t, o, tl, k in expected] == got.get(i, [])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_rows_of_one_sample_need_no_mask(attn, monkeypatch):
    """Rows that each hold one sample, right-padded: positions never restart, so transformers builds no block
    mask (a plain causal forward), and the student tokens' logprobs still equal separate forwards."""
    import transformers.masking_utils as mu

    model = tiny_model(attn=attn).eval()
    samples = make_samples(5, seed=6, min_len=20, max_len=40)
    (mb,) = pack(samples, max_tokens=10_000, row_tokens=40)  # no two samples fit one row
    assert [len(lens) for lens in mb.seq_lens] == [1] * 5 and (mb.input_ids_BT == 0).any()  # padded rows
    assert torch.equal(mb.position_ids_BT, torch.arange(mb.input_ids_BT.shape[1]).expand_as(mb.input_ids_BT))
    seen = []
    real = mu.find_packed_sequence_indices
    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda pos: seen.append(real(pos)) or seen[-1])
    with torch.no_grad():
        order = list(dict.fromkeys(mb.sample_index_N.tolist()))
        torch.testing.assert_close(_packed_logprobs(model, mb), _separate_logprobs(model, [samples[i] for i in order]),
                                   atol=2e-6, rtol=0)
    assert seen and all(s is None for s in seen)  # transformers found no packed rows


def test_long_sample_alone_and_teacher_hidden_rows():
    samples = make_samples(4, seed=5, min_len=20, max_len=30, teacher_hidden=6)
    mbs = pack(samples, max_tokens=10, row_tokens=10)  # every sample is over the budget
    assert len(mbs) == 4 and all(mb.input_ids_BT.shape[0] == 1 for mb in mbs)
    for mb in mbs:
        (i,) = set(mb.sample_index_N.tolist())
        rows = [r for r, m in enumerate(samples[i].response_mask) if m]
        torch.testing.assert_close(mb.teacher_hidden_NH, samples[i].teacher_hidden[rows])


def test_sample_validation_and_from_stream():
    stream = TokenStream(
        token_ids=[5, 6, 7, 8], prompt_len=2, response_mask=[1, 0], logprobs=[-0.5, 0.0], turn_index=[0, 0]
    )
    s = TrainSample.from_stream(stream, teacher_logprobs=[-1.0, 0.0], reward=1.0, group_id=3)
    assert (s.token_ids, s.prompt_len, s.old_logprobs, s.group_id) == ([5, 6, 7, 8], 2, [-0.5, 0.0], 3)
    mb = pack([s], 100)[0]
    assert mb.loss_mask_BT.nonzero()[:, 1].tolist() == [1] and mb.targets_N.tolist() == [7]
    with pytest.raises(ValueError, match="teacher_logprobs"):
        TrainSample([1, 2, 3], 1, [1, 1], [0.0, 0.0], teacher_logprobs=[0.0])
    with pytest.raises(ValueError, match="prompt_len"):
        TrainSample([1, 2], 0, [1, 1], [0.0, 0.0])
    with pytest.raises(ValueError, match="max_tokens"):
        pack([s], 0)
    assert dummy_micro_batch().num_loss_tokens == 0 and pack([], 10) == []


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_shared_prefix_runs_once_and_the_rows_hold_the_rest(attn):
    """collate(share_prefix=True) with one sample a row: the common prefix becomes prefix_ids_1P and the rows start
    after it (tokens, positions, loss rows). The prefix's K/V repeated over the rows give every student token the
    logprob of a separate forward. Rows of several samples, or a prefix shorter than MIN_SHARED_PREFIX, share
    nothing."""
    from _tiny import with_shared_prefix

    from agentopd.batch import collate
    from agentopd.prefix import MIN_SHARED_PREFIX, run_prefix

    model = tiny_model(attn=attn).eval()
    samples = with_shared_prefix(make_samples(5, seed=3), length=20)
    mb = collate(samples, [[i] for i in range(5)], share_prefix=True)
    assert mb.prefix_ids_1P.tolist() == [samples[0].token_ids[:20]]
    assert mb.input_ids_BT.shape == (5, max(s.num_tokens for s in samples) - 20)
    assert mb.position_ids_BT[:, 0].tolist() == [20] * 5 and mb.num_tokens == sum(s.num_tokens for s in samples) - 4 * 20
    with torch.no_grad():
        extra = run_prefix(model.model, mb.prefix_ids_1P, rows=5)
        hidden_BTH = model.model(input_ids=mb.input_ids_BT, position_ids=mb.position_ids_BT, **extra).last_hidden_state
        got_N = torch.log_softmax(model.lm_head(hidden_BTH[mb.loss_mask_BT]), -1).gather(-1, mb.targets_N[:, None])[:, 0]
        torch.testing.assert_close(got_N, _separate_logprobs(model, samples), atol=2e-6, rtol=0)
    assert collate(samples, [[0, 1], [2], [3, 4]], share_prefix=True).prefix_ids_1P is None
    short = with_shared_prefix(make_samples(5, seed=3), length=MIN_SHARED_PREFIX - 1)
    assert collate(short, [[i] for i in range(5)], share_prefix=True).prefix_ids_1P is None
