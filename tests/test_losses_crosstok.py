"""Cross-tokenizer losses (agentopd.losses.crosstok) against brute-force references on tiny vocabularies."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentopd.losses import policy_gradient_loss
from agentopd.losses.crosstok import (
    cross_full_per_token,
    mapped_topk_kl_per_token,
    span_k1_advantages,
    span_sum,
    uld_per_token,
    vocab_map,
)
from agentopd.losses.policy import opd_advantages

S_VOCAB = [b"a", b"b", b"ab", b"c", b"abc", b" "]  # V = 6
T_VOCAB = [b"b", b"ab", b"x", b"a", b"c ", b"c", b"b"]  # W = 7: "x", "c " unmapped; a second "b" maps to nothing


def test_vocab_map_by_bytes():
    m, share = vocab_map(S_VOCAB, T_VOCAB)
    assert m.tolist() == [1, 2, -1, 0, -1, 3, -1]
    assert share == pytest.approx(4 / 7)


def test_span_k1_reduces_to_sampled_k1_with_one_token_spans():
    g = torch.Generator().manual_seed(0)
    old, teacher = -torch.rand(9, generator=g) * 3, -torch.rand(9, generator=g) * 3
    adv = span_k1_advantages(old, teacher, torch.arange(9))
    torch.testing.assert_close(adv, opd_advantages(teacher, old))


def test_span_k1_brute_force():
    old = torch.tensor([-1.0, -0.5, -2.0, -0.1, -0.3])
    span = torch.tensor([0, 0, 1, 2, 2])
    t_span = torch.tensor([-1.2, -2.5, -0.1])
    adv = span_k1_advantages(old, t_span, span)
    expect = [-1.2 - (-1.5), -1.2 - (-1.5), -2.5 - (-2.0), -0.1 - (-0.4), -0.1 - (-0.4)]
    torch.testing.assert_close(adv, torch.tensor(expect))
    torch.testing.assert_close(span_sum(old, span, 3), torch.tensor([-1.5, -2.0, -0.4]))
    # trained like sampled_k1: the IS gradient of one update is -sum_i A_{span(i)} grad logp_i
    lp = old.clone().requires_grad_(True)
    loss, _ = policy_gradient_loss(lp, old, adv)
    loss.backward()
    torch.testing.assert_close(lp.grad, -adv)


def _probs(logits):
    return torch.softmax(logits.double(), -1).tolist()


def _mapped_kl_brute(s_logits, t_ids, t_lps, m):
    """Coarse-grain both distributions to {each mapped student id of the teacher's top-k} + {the rest}; KL(q || p)."""
    p = _probs(s_logits)
    q = {}
    for w, lp in zip(t_ids, t_lps):
        if m[w] >= 0:
            q[m[w]] = q.get(m[w], 0.0) + math.exp(lp)
    q_tail = 1 - sum(q.values())
    p_tail = 1 - sum(p[v] for v in q)
    kl = sum(qv * (math.log(qv) - math.log(p[v])) for v, qv in q.items() if qv > 0)
    return kl + (q_tail * (math.log(q_tail) - math.log(p_tail)) if q_tail > 1e-12 else 0.0)


def _uld_brute(s_logits, t_lps):
    p = sorted(_probs(s_logits), reverse=True)
    q = sorted((math.exp(x) for x in t_lps), reverse=True)
    k = len(q)
    p_k = (p + [0.0] * k)[:k]
    return sum(abs(a - b) for a, b in zip(p_k, q)) + abs((1 - sum(p_k)) - (1 - sum(q)))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 7))
def test_full_terms_match_brute_force(seed, k):
    g = torch.Generator().manual_seed(seed)
    m, _ = vocab_map(S_VOCAB, T_VOCAB)
    n = 4
    s_logits = torch.randn(n, len(S_VOCAB), generator=g) * 2
    t_full = torch.log_softmax(torch.randn(n, len(T_VOCAB), generator=g) * 2, -1)
    t_lps, t_ids = t_full.topk(k, dim=-1)
    kl, mass = mapped_topk_kl_per_token(s_logits, t_ids, t_lps, m)
    uld = uld_per_token(s_logits, t_lps)
    for i in range(n):
        assert kl[i].item() == pytest.approx(_mapped_kl_brute(s_logits[i], t_ids[i].tolist(), t_lps[i].tolist(), m.tolist()), abs=1e-5)
        assert uld[i].item() == pytest.approx(_uld_brute(s_logits[i], t_lps[i].tolist()), abs=1e-5)
        assert mass[i].item() == pytest.approx(sum(math.exp(x) for w, x in zip(t_ids[i].tolist(), t_lps[i].tolist()) if m[w] >= 0), abs=1e-5)
    assert (kl >= -1e-6).all() and (uld >= -1e-6).all()


def test_zero_for_identical_distributions_and_grad():
    """Same vocabulary, identity map, teacher = student with K = V: KL_map = 0 and ULD = 0."""
    m = torch.arange(5)
    logits = torch.randn(3, 5).requires_grad_(True)
    t_lps, t_ids = torch.log_softmax(logits.detach(), -1).topk(5, dim=-1)
    loss, stats = cross_full_per_token(logits, t_ids, t_lps, m, torch.tensor([1, 0, 1]))
    assert loss.abs().max().item() < 1e-5
    assert stats["mapped_share"].item() == pytest.approx(2 / 3) and stats["mapped_mass"].item() == pytest.approx(1.0)
    # away from the teacher, the gradient of the summed loss is finite and non-zero
    t_lps2, t_ids2 = torch.log_softmax(torch.randn(3, 5), -1).topk(3, dim=-1)
    loss2, _ = cross_full_per_token(logits, t_ids2, t_lps2, m, torch.tensor([1, 0, 1]))
    loss2.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


def test_full_kind_none_trains_only_mapped_positions():
    m = torch.arange(5)
    logits = torch.randn(2, 5)
    t_lps, t_ids = torch.log_softmax(torch.randn(2, 5), -1).topk(3, dim=-1)
    loss, _ = cross_full_per_token(logits, t_ids, t_lps, m, torch.tensor([0, 1]), full_kind="none")
    assert loss[0].item() == 0.0 and loss[1].item() > 0
    with pytest.raises(ValueError):
        cross_full_per_token(logits, t_ids, t_lps, m, torch.tensor([0, 1]), full_kind="bogus")


def test_encoded_rows_match_the_direct_terms():
    """The trainer's row encoding (NOT_A_START / all -1 / mapped ids) gives KL_map, ULD and 0 where they belong."""
    from agentopd.losses.crosstok import NOT_A_START, cross_full_from_rows

    m, _ = vocab_map(S_VOCAB, T_VOCAB)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, len(S_VOCAB), generator=g)
    t_lps, t_ids = torch.log_softmax(torch.randn(3, len(T_VOCAB), generator=g), -1).topk(4, dim=-1)
    rows = torch.stack([m[t_ids[0]], torch.full((4,), -1), torch.full((4,), NOT_A_START)])
    for kind in ("uld", "none"):
        loss, stats = cross_full_from_rows(logits, rows, t_lps, kind)
        direct, _ = cross_full_per_token(logits[:2], t_ids[:2], t_lps[:2], m, torch.tensor([1, 0]), full_kind=kind)
        torch.testing.assert_close(loss[:2], direct)
        assert loss[2].item() == 0.0 and stats["starts"].item() == 2 and stats["mapped"].item() == 1
