"""Tests of the sampled-token estimators, policy-gradient losses, episode weights and the
global token normalisation. Legend: N tokens, E episodes, V vocab."""

import math

import pytest
import torch

from agentopd import losses as L


def test_k1_k3_match_the_true_reverse_kl_in_expectation():
    g = torch.Generator().manual_seed(0)
    s_logits, t_logits = torch.randn(2, 12, generator=g, dtype=torch.float64) * 1.5
    s_lp, t_lp = torch.log_softmax(s_logits, -1), torch.log_softmax(t_logits, -1)
    true_kl = (s_lp.exp() * (s_lp - t_lp)).sum().item()
    x = torch.multinomial(s_lp.exp(), 200_000, replacement=True, generator=g)
    k1 = L.sampled_kl(s_lp[x], t_lp[x], "k1")
    k3 = L.sampled_kl(s_lp[x], t_lp[x], "k3")
    assert abs(k1.mean().item() - true_kl) < 0.02 * max(true_kl, 0.1) + 4 * k1.std().item() / math.sqrt(x.numel())
    assert abs(k3.mean().item() - true_kl) < 0.02 * max(true_kl, 0.1) + 4 * k3.std().item() / math.sqrt(x.numel())
    assert (k3 >= 0).all() and (k1 < 0).any()  # k1 is negative on some tokens, k3 never
    # advantages are the negated estimate with the sampler's logprobs
    torch.testing.assert_close(L.opd_advantages(t_lp[x[:5]], s_lp[x[:5]]), t_lp[x[:5]] - s_lp[x[:5]])
    torch.testing.assert_close(L.opd_advantages(t_lp[x[:5]], s_lp[x[:5]], "k3"), -k3[:5])
    with pytest.raises(ValueError, match="estimator"):
        L.sampled_kl(s_lp, t_lp, "k7")


def test_k3_is_nonnegative_everywhere():
    lr = torch.linspace(-30, 30, 1001, dtype=torch.float64)
    assert (L.sampled_kl(torch.zeros_like(lr), lr, "k3") >= 0).all()


def test_is_loss_gradient_is_the_reverse_kl_gradient_on_policy():
    """With samples from the student and k1 advantages, E[grad of the IS loss] = grad KL(s||t)."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(8, generator=g, dtype=torch.float64)).requires_grad_(True)
    t_lp = torch.log_softmax(torch.randn(8, generator=g, dtype=torch.float64) * 2, -1)
    s_lp = torch.log_softmax(logits, -1)
    true_grad = torch.autograd.grad((s_lp.exp() * (s_lp - t_lp)).sum(), logits)[0]
    x = torch.multinomial(s_lp.exp().detach(), 400_000, replacement=True, generator=g)
    lp_N = torch.log_softmax(logits, -1)[x]
    adv = L.opd_advantages(t_lp[x], lp_N.detach())
    loss, stats = L.policy_gradient_loss(lp_N, lp_N.detach(), adv, mode="is")
    (grad,) = torch.autograd.grad(loss / x.numel(), logits)
    assert (grad - true_grad).abs().max() < 0.05 * true_grad.abs().max()
    assert abs(stats["ratio_mean"].item() - 1) < 1e-12 and stats["clip_fraction"].item() == 0


def test_k3_as_advantage_gives_reverse_minus_forward_kl_gradient():
    """Documented caution: E_s[k3 grad log p_s] = grad KL(s||t) - grad KL(t||s) (exact expectation)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(7, generator=g, dtype=torch.float64).requires_grad_(True)
    t_lp = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64) * 2, -1)
    s_lp = torch.log_softmax(logits, -1)
    rkl = (s_lp.exp() * (s_lp - t_lp)).sum()
    fkl = (t_lp.exp() * (t_lp - s_lp)).sum()
    expected = torch.autograd.grad(rkl - fkl, logits, retain_graph=True)[0]
    p = s_lp.exp().detach()
    adv = L.opd_advantages(t_lp, s_lp.detach(), "k3")  # one entry per vocabulary item, weighted by p below
    loss, _ = L.policy_gradient_loss(s_lp, s_lp.detach(), adv, weights_N=p, mode="is")
    (grad,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_ppo_clip_boundaries(adv):
    eps, eps_high = 0.2, 0.3
    old = torch.zeros(1, dtype=torch.float64)

    def grad_at(ratio, **kw):
        lp = torch.tensor([math.log(ratio)], dtype=torch.float64, requires_grad=True)
        loss, stats = L.policy_gradient_loss(lp, old, torch.tensor([adv], dtype=torch.float64), mode="ppo_clip",
                                             clip_eps=eps, clip_eps_high=eps_high, **kw)
        (g,) = torch.autograd.grad(loss, lp)
        return loss.item(), g.item(), stats["clip_fraction"].item()

    d = 1e-6
    for ratio in (1 - eps + d, 1.0, 1 + eps_high - d):  # inside the trust region: plain -ratio * A
        loss, g, frac = grad_at(ratio)
        assert loss == pytest.approx(-ratio * adv) and g == pytest.approx(-ratio * adv) and frac == 0
    if adv > 0:  # positive advantage: clipped above 1 + eps_high, never below
        loss, g, frac = grad_at(1 + eps_high + d)
        assert g == 0 and loss == pytest.approx(-(1 + eps_high) * adv) and frac == 1
        loss, g, frac = grad_at(0.5)
        assert g == pytest.approx(-0.5 * adv) and frac == 0
    else:  # negative advantage: clipped below 1 - eps, never above
        loss, g, frac = grad_at(1 - eps - d)
        assert g == 0 and loss == pytest.approx(-(1 - eps) * adv) and frac == 1
        loss, g, frac = grad_at(2.0)
        assert g == pytest.approx(-2.0 * adv) and frac == 0


def test_is_cap_truncates_the_ratio_in_value_and_gradient():
    lp = torch.tensor([math.log(3.0), math.log(0.5)], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, dtype=torch.float64)
    adv = torch.tensor([2.0, 2.0], dtype=torch.float64)
    w = torch.tensor([1.0, 0.5], dtype=torch.float64)
    loss, stats = L.policy_gradient_loss(lp, old, adv, weights_N=w, mode="is", is_cap=2.0)
    (g,) = torch.autograd.grad(loss, lp)
    assert loss.item() == pytest.approx(-(2.0 * 2.0 * 1.0 + 0.5 * 2.0 * 0.5))
    torch.testing.assert_close(g, torch.tensor([-4.0, -0.5], dtype=torch.float64))
    assert stats["clip_fraction"].item() == pytest.approx(1.0 / 1.5)
    assert stats["ratio_mean"].item() == pytest.approx((3.0 + 0.25) / 1.5)
    with pytest.raises(ValueError, match="mode"):
        L.policy_gradient_loss(lp, old, adv, mode="ppo")


def test_reward_weights_mean_one_per_group_and_limits():
    r = torch.tensor([1.0, 0.0, 2.0, 5.0, 5.0, 1.0])
    gid = torch.tensor([7, 7, 7, 3, 3, 3])
    w = L.reward_weights(r, gid, beta=1.0)
    assert w[:3].mean().item() == pytest.approx(1.0) and w[3:].mean().item() == pytest.approx(1.0)
    torch.testing.assert_close(w[:3], 3 * torch.softmax(r[:3], 0))
    assert (w[:3].argsort() == torch.tensor([1, 0, 2])).all()
    torch.testing.assert_close(L.reward_weights(r, gid, beta=1e6), torch.ones(6), atol=1e-5, rtol=0)
    torch.testing.assert_close(L.reward_weights(r, gid, beta=1e-4), torch.tensor([0, 0, 3, 1.5, 1.5, 0.0]))
    wb = L.reward_weights(r, None, beta=2.0)  # whole batch is one group
    torch.testing.assert_close(wb, 6 * torch.softmax(r / 2, 0))
    with pytest.raises(ValueError, match="reward_beta"):
        L.reward_weights(r, gid, beta=0.0)


def test_grpo_advantages():
    r = torch.tensor([1.0, 0.0, 2.0, 4.0, 4.0, 3.0])
    gid = torch.tensor([0, 0, 0, 1, 1, 2])
    a = L.grpo_advantages(r, gid)
    torch.testing.assert_close(a[:3], (r[:3] - 1.0) / (r[:3].std(correction=0) + 1e-6))
    torch.testing.assert_close(a[3:5], torch.zeros(2))
    assert a[5].item() == 0.0  # a group of one
    torch.testing.assert_close(L.grpo_advantages(r, gid, normalize_std=False)[:3], r[:3] - 1.0)


def test_teacher_confidence_weights():
    lps = [torch.tensor([-0.1, -0.1]), torch.tensor([-1.0, -3.0, -2.0]), torch.tensor([-0.5]), torch.tensor([]),
           torch.tensor([-0.2])]
    gid = torch.tensor([0, 0, 1, 1, 1])
    w = L.teacher_confidence_weights(lps, gid, power=1.0)
    c = torch.tensor([math.exp(-0.1), math.exp(-2.0)])
    torch.testing.assert_close(w[:2], 2 * c / c.sum())
    assert w[3].item() == 0.0  # no student tokens: weight 0, not counted in the group size
    assert w[2].item() + w[4].item() == pytest.approx(2.0) and w[4] > w[2]
    torch.testing.assert_close(L.teacher_confidence_weights(lps, gid, power=0.0), torch.tensor([1, 1, 1, 0, 1.0]))
    w2 = L.teacher_confidence_weights(lps, gid, power=2.0)
    torch.testing.assert_close(w2[:2], 2 * c**2 / (c**2).sum())


def _micro_batch_grads(model_h, head, teacher_h, teacher_head, masks, kind, split):
    """Gradient of the global-mean loss accumulated over micro-batches of `split` sequences."""
    head.grad = None
    model_h.grad = None
    n_global = L.global_token_count(masks)
    for i in range(0, len(masks), split):
        mb = slice(i, i + split)
        sel = torch.cat(masks[mb]).bool()
        rows = model_h[mb].reshape(-1, model_h.shape[-1])[sel]
        t_rows = teacher_h[mb].reshape(-1, teacher_h.shape[-1])[sel]
        loss = L.chunked_divergence(rows, head, teacher_hidden_NH=t_rows, teacher_head_VH=teacher_head, kind=kind,
                                    chunk_size=3)
        L.normalize_by_tokens(loss, n_global).backward()
    return model_h.grad.clone(), head.grad.clone()


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_global_normalisation_gives_the_same_gradient_for_any_micro_batching(kind):
    g = torch.Generator().manual_seed(4)
    e, t, h, v = 4, 6, 8, 30
    model_h = torch.randn(e, t, h, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    teacher_h = torch.randn(e, t, 10, generator=g, dtype=torch.float64)
    teacher_head = torch.randn(v, 10, generator=g, dtype=torch.float64)
    masks = [torch.tensor(m) for m in ([1, 1, 0, 0, 1, 1], [0, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1])]
    # whole-batch mean over the student tokens, by plain autograd
    sel = torch.cat(masks).bool()
    ref = L.divergence(model_h.reshape(-1, h)[sel] @ head.T, teacher_h.reshape(-1, 10)[sel] @ teacher_head.T, kind).mean()
    ref_grads = torch.autograd.grad(ref, (model_h, head))
    for split in (1, 2, e):
        grads = _micro_batch_grads(model_h, head, teacher_h, teacher_head, masks, kind, split)
        for a, b in zip(grads, ref_grads):
            assert (a - b).abs().max() < 1e-12, split
    assert L.normalize_by_tokens(torch.tensor(0.0), 0).item() == 0.0
