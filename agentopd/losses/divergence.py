"""Full-vocabulary divergences between a student and a teacher next-token distribution.

Reference implementation (plain autograd over full logits) plus the per-chunk math that the
chunked autograd function in `chunked.py` reuses, with closed-form gradients.

Legend: N tokens (student tokens selected by the response mask), C tokens of one chunk,
V vocabulary, K top-k. `s` = student, `t` = teacher, `lp` = log-probabilities, `p` = probs.

With temperature T the distributions are  p_s = softmax(z_s / T),  p_t = softmax(z_t / T)
(TRL's `generalized_jsd_loss` convention; no T^2 factor is applied).

    forward KL   KL(p_t || p_s) = sum_v p_t (log p_t - log p_s)      (mass-covering)
    reverse KL   KL(p_s || p_t) = sum_v p_s (log p_s - log p_t)      (mode-seeking)
    JSD(beta)    beta * KL(p_t || m) + (1 - beta) * KL(p_s || m),    m = beta p_t + (1 - beta) p_s

JSD beta limits (TRL / Liger convention, tested): beta == 0 is computed as forward KL and
beta == 1 as reverse KL exactly. The generalized JSD itself vanishes at both ends; its
first-order behaviour is JSD(beta) / beta -> forward KL as beta -> 0 and
JSD(beta) / (1 - beta) -> reverse KL as beta -> 1. log m is formed in log space,
logaddexp(lp_s + log(1 - beta), lp_t + log beta), so it never underflows.

Closed-form gradients with respect to the scaled student logits u = z_s / T (the chunked
backward multiplies by 1 / T):
    forward KL   p_s - p_t
    reverse KL   p_s * (lp_s - lp_t - KL(p_s || p_t))
    JSD(beta)    (1 - beta) * p_s * (lp_s - log m - KL(p_s || m))
"""

from __future__ import annotations

import math
from enum import StrEnum

import torch
import torch.nn.functional as F
from torch import Tensor


class Divergence(StrEnum):
    """Which full-vocabulary divergence to train on."""

    FORWARD_KL = "forward_kl"  # KL(teacher || student)
    REVERSE_KL = "reverse_kl"  # KL(student || teacher)
    JSD = "jsd"  # generalized JSD(beta), TRL convention


def resolve_kind(kind: Divergence | str, beta: float) -> Divergence:
    """Validate `kind` / `beta`; JSD with beta 0 or 1 becomes forward / reverse KL."""
    try:
        kind = Divergence(kind)
    except ValueError:
        raise ValueError(f"kind={kind!r} is not one of {[k.value for k in Divergence]}") from None
    if kind is Divergence.JSD:
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta={beta} must lie in [0, 1] for kind='jsd'")
        if beta == 0.0:
            return Divergence.FORWARD_KL
        if beta == 1.0:
            return Divergence.REVERSE_KL
    return kind


def check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype losses accumulate in: fp32, or fp64 when the inputs are fp64."""
    return torch.promote_types(dtype, torch.float32)


def divergence_terms(
    s_lp_NV: Tensor,
    t_lp_NV: Tensor,
    kind: Divergence,
    beta: float,
    support_NV: Tensor | None = None,
) -> Tensor:
    """Per-token divergence from log-probabilities (autograd-friendly).

    `support_NV` (bool) restricts the sum to a support on which both log-probabilities were
    normalised; outside it the log-probabilities may be -inf and contribute exactly 0
    (with zero, never NaN, gradients).
    """
    s_p_NV, t_p_NV = s_lp_NV.exp(), t_lp_NV.exp()
    if support_NV is not None:
        s_lp_NV = s_lp_NV.masked_fill(~support_NV, 0.0)
        t_lp_NV = t_lp_NV.masked_fill(~support_NV, 0.0)
    if kind is Divergence.FORWARD_KL:
        return (t_p_NV * (t_lp_NV - s_lp_NV)).sum(-1)
    if kind is Divergence.REVERSE_KL:
        return (s_p_NV * (s_lp_NV - t_lp_NV)).sum(-1)
    log_m_NV = torch.logaddexp(s_lp_NV + math.log1p(-beta), t_lp_NV + math.log(beta))
    kl_t_N = (t_p_NV * (t_lp_NV - log_m_NV)).sum(-1)
    kl_s_N = (s_p_NV * (s_lp_NV - log_m_NV)).sum(-1)
    return beta * kl_t_N + (1.0 - beta) * kl_s_N


def divergence(
    student_logits_NV: Tensor,
    teacher_logits_NV: Tensor,
    kind: Divergence | str,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> Tensor:
    """Reference per-token divergence, div_N, with plain autograd over full logits.

    Computes in fp32 (fp64 if given fp64). Use `chunked_divergence` for training: this one
    materialises several N x V tensors and keeps them for backward.
    """
    kind = resolve_kind(kind, beta)
    check_temperature(temperature)
    if student_logits_NV.shape != teacher_logits_NV.shape:
        raise ValueError(
            f"student logits {tuple(student_logits_NV.shape)} and teacher logits "
            f"{tuple(teacher_logits_NV.shape)} differ in shape"
        )
    dt = acc_dtype(student_logits_NV.dtype)
    s_lp_NV = F.log_softmax(student_logits_NV.to(dt) / temperature, dim=-1)
    t_lp_NV = F.log_softmax(teacher_logits_NV.to(dt) / temperature, dim=-1)
    return divergence_terms(s_lp_NV, t_lp_NV, kind, beta)


def _log_softmax_(x_CV: Tensor) -> Tensor:
    """log_softmax in place (reuses the logits buffer)."""
    return x_CV.sub_(torch.logsumexp(x_CV, dim=-1, keepdim=True))


@torch.no_grad()
def divergence_and_grad(
    s_scaled_CV: Tensor, t_scaled_CV: Tensor, kind: Divergence, beta: float, need_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """Per-token divergence and, optionally, its gradient wrt the scaled student logits.

    Inputs are temperature-scaled logits in the accumulation dtype and are CONSUMED (overwritten
    in place): this runs once per chunk, and reusing the two logits buffers keeps the peak at
    about five C x V tensors (JSD; four for the KLs).
    """
    s_lp = _log_softmax_(s_scaled_CV)
    t_lp = _log_softmax_(t_scaled_CV)
    if kind is Divergence.FORWARD_KL:
        t_p = t_lp.exp()
        div_C = (t_p * t_lp.sub_(s_lp)).sum(-1)
        if not need_grad:
            return div_C, None
        return div_C, s_lp.exp_().sub_(t_p)
    if kind is Divergence.REVERSE_KL:
        s_p = s_lp.exp()
        logr = s_lp.sub_(t_lp)
        div_C = (s_p * logr).sum(-1)
        if not need_grad:
            return div_C, None
        return div_C, logr.sub_(div_C[:, None]).mul_(s_p)
    log_m = torch.logaddexp(s_lp + math.log1p(-beta), t_lp + math.log(beta))
    t_p = t_lp.exp()
    kl_t_C = (t_p * t_lp.sub_(log_m)).sum(-1)
    del t_p
    s_p = s_lp.exp()
    s_minus_m = s_lp.sub_(log_m)
    del log_m
    kl_s_C = (s_p * s_minus_m).sum(-1)
    div_C = beta * kl_t_C + (1.0 - beta) * kl_s_C
    if not need_grad:
        return div_C, None
    return div_C, s_minus_m.sub_(kl_s_C[:, None]).mul_(s_p).mul_(1.0 - beta)
