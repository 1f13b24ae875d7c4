"""Property tests of the full-vocabulary divergences, the chunked autograd function, top-k and TCAD.

Legend: N tokens, H student hidden, H_t teacher hidden, V vocab, K top-k.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentopd import losses as L
from agentopd.losses import Divergence

KINDS = [k.value for k in Divergence]


def _inputs(seed, n=23, h=8, ht=12, v=40, dtype=torch.float64, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g, dtype=dtype) * scale)  # noqa: E731
    return dict(
        h=r(n, h).requires_grad_(True),
        w=(r(v, h) / math.sqrt(h)).requires_grad_(True),
        b=r(v).requires_grad_(True),
        th=r(n, ht),
        tw=r(v, ht) / math.sqrt(ht),
        weights=torch.rand(n, generator=g, dtype=dtype),
    )


def _ref_sum(x, kind, beta, temperature, teacher_logits=None):
    s = x["h"] @ x["w"].T + x["b"]
    t = x["th"] @ x["tw"].T if teacher_logits is None else teacher_logits
    return (L.divergence(s, t, kind, beta=beta, temperature=temperature) * x["weights"]).sum()


@pytest.mark.parametrize("kind", KINDS)
@given(seed=st.integers(0, 2**16), beta=st.floats(0.05, 0.95), temperature=st.sampled_from([0.5, 1.0, 2.0]))
@settings(max_examples=15, deadline=None)
def test_zero_with_zero_gradient_when_student_equals_teacher(kind, seed, beta, temperature):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(9, 31, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    div = L.divergence(logits, logits.detach().clone(), kind, beta=beta, temperature=temperature)
    (grad,) = torch.autograd.grad(div.sum(), logits)
    assert div.abs().max() < 1e-12 and grad.abs().max() < 1e-12
    # the chunked path, teacher == student given as the same hidden states + head
    x = _inputs(seed)
    out = L.chunked_divergence(x["h"], x["w"], teacher_hidden_NH=x["h"].detach(), teacher_head_VH=x["w"].detach(),
                               kind=kind, beta=beta, temperature=temperature, chunk_size=5)
    gh, gw = torch.autograd.grad(out, (x["h"], x["w"]))
    assert abs(out.item()) < 1e-12 and gh.abs().max() < 1e-12 and gw.abs().max() < 1e-12


@given(seed=st.integers(0, 2**16))
@settings(max_examples=20, deadline=None)
def test_divergences_are_nonnegative_and_jsd_is_bounded(seed):
    g = torch.Generator().manual_seed(seed)
    s, t = torch.randn(2, 7, 25, generator=g, dtype=torch.float64) * 4
    for kind in KINDS:
        assert (L.divergence(s, t, kind) >= -1e-12).all()
    # JSD(beta) <= h(beta) = -beta log beta - (1-beta) log(1-beta) (mixture entropy bound)
    beta = 0.3
    assert (L.divergence(s, t, "jsd", beta=beta) <= -beta * math.log(beta) - (1 - beta) * math.log(1 - beta) + 1e-12).all()


def test_jsd_beta_limits_equal_forward_and_reverse_kl():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 11, 30, generator=g, dtype=torch.float64) * 2
    fkl, rkl = L.divergence(s, t, "forward_kl"), L.divergence(s, t, "reverse_kl")
    # exact endpoints (TRL / Liger convention): beta=0 -> KL(t||s), beta=1 -> KL(s||t)
    torch.testing.assert_close(L.divergence(s, t, "jsd", beta=0.0), fkl, rtol=0, atol=0)
    torch.testing.assert_close(L.divergence(s, t, "jsd", beta=1.0), rkl, rtol=0, atol=0)
    # continuous limits: JSD/beta -> forward KL (beta->0), JSD/(1-beta) -> reverse KL (beta->1)
    # the error vanishes as beta -> 0 (O(beta) once beta * max(p_t / p_s) << 1)
    errs_f, errs_r = [], []
    for eps in (1e-3, 1e-5, 1e-7):
        errs_f.append(((L.divergence(s, t, "jsd", beta=eps) / eps - fkl).abs() / fkl).max().item())
        errs_r.append(((L.divergence(s, t, "jsd", beta=1 - eps) / eps - rkl).abs() / rkl).max().item())
    for errs in (errs_f, errs_r):
        assert errs[2] < 1e-3 and errs[1] < 0.1 * errs[0] and errs[2] < 0.1 * errs[1], errs
    # forward / reverse are swapped by exchanging the roles
    torch.testing.assert_close(L.divergence(t, s, "forward_kl"), rkl)


def test_temperature_divides_logits():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(2, 5, 20, generator=g, dtype=torch.float64)
    for kind in KINDS:
        torch.testing.assert_close(L.divergence(s, t, kind, temperature=2.0), L.divergence(s / 2, t / 2, kind))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("teacher", ["hidden", "logits"])
def test_chunked_equals_unchunked_values_and_gradients(dtype, tol, kind, teacher):
    x = _inputs(7, dtype=dtype)
    for beta, temperature in [(0.5, 1.0), (0.2, 1.7)]:
        ref = _ref_sum(x, kind, beta, temperature)
        ref_grads = torch.autograd.grad(ref, (x["h"], x["w"], x["b"]))
        teacher_kw = (
            dict(teacher_hidden_NH=x["th"], teacher_head_VH=x["tw"])
            if teacher == "hidden"
            else dict(teacher_logits_NV=(x["th"] @ x["tw"].T))
        )
        for chunk_size in (1, 4, 7, 23, 1024):  # 7 does not divide N=23
            out = L.chunked_divergence(x["h"], x["w"], **teacher_kw, kind=kind, beta=beta, temperature=temperature,
                                       weights_N=x["weights"], chunk_size=chunk_size, student_head_bias_V=x["b"])
            grads = torch.autograd.grad(out, (x["h"], x["w"], x["b"]))
            scale = max(1.0, abs(ref.item()))
            assert abs(out.item() - ref.item()) <= tol * scale, (chunk_size, out.item(), ref.item())
            for a, r in zip(grads, ref_grads):
                assert (a - r).abs().max().item() <= tol * max(1.0, r.abs().max().item()), chunk_size
            per_tok = L.chunked_divergence_per_token(x["h"], x["w"], **teacher_kw, kind=kind, beta=beta,
                                                     temperature=temperature, chunk_size=chunk_size,
                                                     student_head_bias_V=x["b"])
            assert per_tok.shape == (23,) and not per_tok.requires_grad
            assert abs((per_tok * x["weights"]).sum().item() - ref.item()) <= tol * scale


def test_chunked_leaves_teacher_inputs_untouched_and_without_grad():
    x = _inputs(3)
    t_logits = x["th"] @ x["tw"].T
    before = t_logits.clone()
    out = L.chunked_divergence(x["h"], x["w"], teacher_logits_NV=t_logits, kind="jsd", temperature=2.0, chunk_size=4)
    out.backward()
    assert torch.equal(t_logits, before)
    with pytest.raises(ValueError, match="exactly one"):
        L.chunked_divergence(x["h"], x["w"], kind="jsd")
    with pytest.raises(ValueError, match="kind="):
        L.chunked_divergence(x["h"], x["w"], teacher_logits_NV=t_logits, kind="tvd")
    with pytest.raises(ValueError, match="beta="):
        L.divergence(t_logits, t_logits, "jsd", beta=1.5)


def test_chunked_bf16_inputs_accumulate_in_fp32():
    x = _inputs(5, dtype=torch.float32)
    h = x["h"].detach().bfloat16().requires_grad_(True)
    w = x["w"].detach().bfloat16().requires_grad_(True)
    out = L.chunked_divergence(h, w, teacher_hidden_NH=x["th"].bfloat16(), teacher_head_VH=x["tw"].bfloat16(),
                               kind="reverse_kl", chunk_size=6)
    assert out.dtype == torch.float32
    out.backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    ref = (L.divergence(h.float() @ w.float().T, x["th"].bfloat16().float() @ x["tw"].bfloat16().float().T,
                        "reverse_kl")).sum()
    assert abs(out.item() - ref.item()) < 0.05 * max(1.0, ref.item())


@pytest.mark.parametrize("kind", KINDS)
def test_masking_removes_exactly_the_masked_tokens(kind):
    x = _inputs(11)
    mask = torch.zeros(23, dtype=torch.bool)
    mask[[0, 3, 4, 9, 15, 22]] = True
    common = dict(teacher_hidden_NH=x["th"], teacher_head_VH=x["tw"], kind=kind, chunk_size=4)
    # a 0/1 weight on all rows == selecting the rows
    as_weights = L.chunked_divergence(x["h"], x["w"], weights_N=mask.double(), **common)
    g_weights = torch.autograd.grad(as_weights, (x["h"], x["w"]))
    sel = dict(common, teacher_hidden_NH=x["th"][mask])
    selected = L.chunked_divergence(x["h"][mask], x["w"], **sel)
    g_sel = torch.autograd.grad(selected, (x["h"], x["w"]))
    assert abs(as_weights.item() - selected.item()) < 1e-12
    assert (g_weights[0] - g_sel[0]).abs().max() < 1e-12 and (g_weights[1] - g_sel[1]).abs().max() < 1e-12
    assert (g_weights[0][~mask] == 0).all()
    # changing the masked-out tokens changes nothing
    h2 = x["h"].detach().clone()
    h2[~mask] = torch.randn(int((~mask).sum()), 8, dtype=torch.float64) * 10
    again = L.chunked_divergence(h2, x["w"], weights_N=mask.double(), **common)
    assert abs(again.item() - as_weights.item()) < 1e-12


def _sorted_topk(t_logits, k, temperature=1.0):
    lp = torch.log_softmax(t_logits / temperature, -1)
    vals, ids = lp.topk(k, dim=-1)
    return ids, vals


def test_topk_forward_kl_tail_bucket_is_exact_when_k_equals_v_and_a_lower_bound_otherwise():
    g = torch.Generator().manual_seed(2)
    s = (torch.randn(13, 30, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    t = torch.randn(13, 30, generator=g, dtype=torch.float64) * 2
    full = L.divergence(s, t, "forward_kl")
    ids, lps = _sorted_topk(t, 30)
    exact = L.topk_forward_kl_per_token(s, ids, lps)
    torch.testing.assert_close(exact, full, rtol=1e-12, atol=1e-12)
    g_full, g_exact = (torch.autograd.grad(v.sum(), s)[0] for v in (full, exact))
    torch.testing.assert_close(g_exact, g_full, rtol=1e-10, atol=1e-12)
    prev = torch.zeros(13, dtype=torch.float64)
    for k in (1, 3, 10, 29):  # coarse-graining: monotone in K, below the full KL
        ids, lps = _sorted_topk(t, k)
        kl_k = L.topk_forward_kl_per_token(s, ids, lps).detach()
        assert (kl_k <= full + 1e-12).all() and (kl_k >= prev - 1e-12).all()
        prev = kl_k
    # zero when the student equals the teacher, for any K
    ids, lps = _sorted_topk(t, 5)
    assert L.topk_forward_kl_per_token(t, ids, lps).abs().max() < 1e-12
    w = torch.rand(13, generator=g, dtype=torch.float64)
    torch.testing.assert_close(L.topk_forward_kl(s, ids, lps, weights_N=w), (L.topk_forward_kl_per_token(s, ids, lps) * w).sum())


@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_topk_and_coverage_hidden_chunked_match_reference(temperature):
    x = _inputs(4)
    s_logits = x["h"] @ x["w"].T
    ids, lps = _sorted_topk(x["th"] @ x["tw"].T, 6)
    ref = L.topk_forward_kl(s_logits, ids, lps, temperature, weights_N=x["weights"])
    ref_g = torch.autograd.grad(ref, (x["h"], x["w"]))
    out = L.topk_forward_kl_hidden(x["h"], x["w"], ids, lps, temperature, weights_N=x["weights"], chunk_size=5)
    g = torch.autograd.grad(out, (x["h"], x["w"]))
    assert abs(out.item() - ref.item()) < 1e-10
    assert all((a - b).abs().max() < 1e-10 for a, b in zip(g, ref_g))
    ref = L.coverage_regularizer(x["h"] @ x["w"].T, ids, temperature, weights_N=x["weights"])
    ref_g = torch.autograd.grad(ref, (x["h"], x["w"]))
    out = L.coverage_regularizer_hidden(x["h"], x["w"], ids, temperature, weights_N=x["weights"], chunk_size=5)
    g = torch.autograd.grad(out, (x["h"], x["w"]))
    assert abs(out.item() - ref.item()) < 1e-10
    assert all((a - b).abs().max() < 1e-10 for a, b in zip(g, ref_g))


@pytest.mark.parametrize("kind", KINDS)
def test_support_union_topk(kind):
    x = _inputs(9)
    s, t = x["h"] @ x["w"].T, x["th"] @ x["tw"].T
    # K = V: no truncation, equals the full divergence
    torch.testing.assert_close(L.support_union_topk(s, t, k=40, kind=kind), L.divergence(s, t, kind))
    # K < V: a divergence between the two renormalised distributions on the union
    div_N = L.support_union_topk(s, t, k=3, kind=kind)
    assert torch.isfinite(div_N).all() and (div_N >= -1e-12).all()
    (g,) = torch.autograd.grad(div_N.sum(), x["h"])
    assert torch.isfinite(g).all()
    n = 0
    union = torch.zeros_like(s, dtype=torch.bool)
    union.scatter_(1, s.topk(3, -1).indices, True).scatter_(1, t.topk(3, -1).indices, True)
    big = torch.where(union[n], 0.0, -1e4)
    torch.testing.assert_close(div_N[n:n + 1], L.divergence((s[n] + big)[None], (t[n] + big)[None], kind), rtol=1e-9, atol=1e-9)
    # chunked variant == reference
    out = L.chunked_divergence(x["h"], x["w"], teacher_hidden_NH=x["th"], teacher_head_VH=x["tw"], kind=kind,
                               support_k=3, chunk_size=4)
    g_chunk = torch.autograd.grad(out, x["h"])[0]
    assert abs(out.item() - div_N.sum().item()) < 1e-10 and (g_chunk - g).abs().max() < 1e-10


def test_coverage_regularizer_properties():
    g = torch.Generator().manual_seed(3)
    s = torch.randn(6, 20, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 20, (6, 4), generator=g)
    ids = torch.stack([torch.randperm(20, generator=g)[:4] for _ in range(6)])
    r = L.coverage_per_token(s, ids)
    p = torch.softmax(s, -1)
    torch.testing.assert_close(r, -torch.log(p.gather(1, ids).sum(-1)))
    assert (r >= 0).all()
    full = torch.stack([torch.randperm(20, generator=g) for _ in range(6)])
    assert L.coverage_per_token(s, full).abs().max() < 1e-12


@pytest.mark.parametrize("kind", KINDS)
def test_grad_in_forward_matches_recompute(kind):
    x = _inputs(12)
    common = dict(teacher_hidden_NH=x["th"], teacher_head_VH=x["tw"], kind=kind, beta=0.3, temperature=1.3,
                  weights_N=x["weights"], chunk_size=6, student_head_bias_V=x["b"])
    ref = L.chunked_divergence(x["h"], x["w"], **common)
    ref_g = torch.autograd.grad(ref * 2.5, (x["h"], x["w"], x["b"]))
    out = L.chunked_divergence(x["h"], x["w"], grad_in_forward=True, **common)
    g = torch.autograd.grad(out * 2.5, (x["h"], x["w"], x["b"]))  # upstream gradient 2.5 is applied
    assert abs(out.item() - ref.item()) < 1e-12
    assert all((a - b).abs().max() < 1e-12 for a, b in zip(g, ref_g))
    with torch.no_grad():  # no gradient wanted: plain forward
        assert abs(L.chunked_divergence(x["h"], x["w"], grad_in_forward=True, **common).item() - ref.item()) < 1e-12


@pytest.mark.slow
def test_compiled_chunk_math_matches_eager():
    x = _inputs(13, dtype=torch.float32)
    common = dict(teacher_hidden_NH=x["th"], teacher_head_VH=x["tw"], kind="jsd", chunk_size=8)
    ref = L.chunked_divergence(x["h"], x["w"], **common)
    ref_g = torch.autograd.grad(ref, (x["h"], x["w"]))
    out = L.chunked_divergence(x["h"], x["w"], compiled=True, **common)
    g = torch.autograd.grad(out, (x["h"], x["w"]))
    assert abs(out.item() - ref.item()) < 1e-4 * max(1.0, abs(ref.item()))
    assert all((a - b).abs().max() < 1e-5 for a, b in zip(g, ref_g))



def test_empty_micro_batch_gives_zero_and_zero_gradient():
    h = torch.zeros(0, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    out = L.chunked_divergence(h, w, teacher_logits_NV=torch.zeros(0, 20, dtype=torch.float64), kind="jsd")
    out.backward()
    assert out.item() == 0.0 and w.grad.abs().sum().item() == 0.0
