"""Divergences on a truncated support: teacher top-k with a tail bucket, and the TCAD options
support-symmetric truncation and coverage-aware regularisation.

All take full student logits (one chunk, or a whole small batch); `chunked.py` wraps them so
they run chunk by chunk from hidden states. Legend: N tokens, V vocab, K top-k.
Student distribution: p_s = softmax(z_s / T). Teacher top-k log-probabilities are taken as
given (already at the temperature the user wants; servers return them at T = 1).

Top-k forward KL with a tail bucket (for teachers behind a server that return top-k only):
    S = teacher top-k ids,  q_i = exp(teacher_topk_logprob_i) for i in S,
    q_tail = 1 - sum_{i in S} q_i,   s_tail = sum_{v not in S} p_s(v)
    KL_topk = sum_{i in S} q_i (log q_i - log p_s(i)) + q_tail (log q_tail - log s_tail)
This is the forward KL between the two distributions coarse-grained to K + 1 outcomes, so
KL_topk <= KL(p_t || p_s), with equality when K = V (the tail is empty). s_tail is computed as
logsumexp over the non-top-k logits (never as 1 - sum, which cancels catastrophically).

Support-symmetric truncation (TCAD): U = top-k(p_t) ∪ top-k(p_s) per token; both
distributions are renormalised on U and the chosen divergence is taken on U:
    p^U(v) = p(v) / sum_{u in U} p(u)  for v in U,   D_U = D(p_s^U, p_t^U)
Neither model's high-probability tokens are dropped (truncating on the teacher's top-k alone
hides where the student puts mass that the teacher does not). Gradients flow only through U.

Coverage-aware regulariser (TCAD): the student's missing mass on the teacher's top-k,
    R = -log sum_{i in S} p_s(i)   (>= 0; 0 iff the student puts all its mass on S)
It complements a mode-seeking reverse KL, which alone may abandon teacher modes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from agentopd.losses.divergence import (
    Divergence,
    acc_dtype,
    check_temperature,
    divergence_terms,
    resolve_kind,
)


def _check_topk(student_logits_NV: Tensor, ids_NK: Tensor, logprobs_NK: Tensor | None) -> None:
    n, v = student_logits_NV.shape
    if ids_NK.dim() != 2 or ids_NK.shape[0] != n:
        raise ValueError(f"teacher_topk_ids {tuple(ids_NK.shape)} must be (N={n}, K)")
    if logprobs_NK is not None and logprobs_NK.shape != ids_NK.shape:
        raise ValueError(
            f"teacher_topk_logprobs {tuple(logprobs_NK.shape)} != teacher_topk_ids {tuple(ids_NK.shape)}"
        )
    if ids_NK.shape[1] > v:
        raise ValueError(f"K={ids_NK.shape[1]} exceeds the vocabulary V={v}")


def topk_forward_kl_per_token(
    student_logits_NV: Tensor,
    teacher_topk_ids_NK: Tensor,
    teacher_topk_logprobs_NK: Tensor,
    temperature: float = 1.0,
) -> Tensor:
    """KL_topk per token (formula in the module docstring), with autograd."""
    check_temperature(temperature)
    _check_topk(student_logits_NV, teacher_topk_ids_NK, teacher_topk_logprobs_NK)
    dt = acc_dtype(student_logits_NV.dtype)
    u_NV = student_logits_NV.to(dt) / temperature
    lse_N = torch.logsumexp(u_NV, dim=-1)
    ids_NK = teacher_topk_ids_NK.long()
    q_lp_NK = teacher_topk_logprobs_NK.to(dt)
    s_lp_NK = u_NV.gather(1, ids_NK) - lse_N[:, None]
    kl_N = (q_lp_NK.exp() * (q_lp_NK - s_lp_NK)).sum(-1)
    if ids_NK.shape[1] == u_NV.shape[1]:
        return kl_N  # K = V: no tail
    in_topk_NV = torch.zeros_like(u_NV, dtype=torch.bool).scatter_(1, ids_NK, True)
    s_tail_lp_N = torch.logsumexp(u_NV.masked_fill(in_topk_NV, float("-inf")), dim=-1) - lse_N
    q_tail_N = (-torch.expm1(torch.logsumexp(q_lp_NK, dim=-1))).clamp(min=0.0)
    return kl_N + torch.xlogy(q_tail_N, q_tail_N) - q_tail_N * s_tail_lp_N


def topk_forward_kl(
    student_logits_NV: Tensor,
    teacher_topk_ids_NK: Tensor,
    teacher_topk_logprobs_NK: Tensor,
    temperature: float = 1.0,
    weights_N: Tensor | None = None,
) -> Tensor:
    """Sum over tokens of weights_n * KL_topk_n (tail bucket included). Returns a scalar SUM."""
    kl_N = topk_forward_kl_per_token(
        student_logits_NV, teacher_topk_ids_NK, teacher_topk_logprobs_NK, temperature
    )
    return kl_N.sum() if weights_N is None else (kl_N * weights_N.to(kl_N.dtype)).sum()


def support_union_topk(
    student_logits_NV: Tensor,
    teacher_logits_NV: Tensor,
    *,
    k: int,
    kind: Divergence | str = Divergence.REVERSE_KL,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> Tensor:
    """Per-token divergence restricted to U = top-k(teacher) ∪ top-k(student), both renormalised
    on U (support-symmetric truncation, TCAD). Returns div_N with autograd."""
    kind = resolve_kind(kind, beta)
    check_temperature(temperature)
    v = student_logits_NV.shape[-1]
    if not 1 <= k <= v:
        raise ValueError(f"k={k} must lie in [1, V={v}]")
    dt = acc_dtype(student_logits_NV.dtype)
    u_s_NV = student_logits_NV.to(dt) / temperature
    u_t_NV = teacher_logits_NV.to(dt) / temperature
    union_NV = torch.zeros_like(u_s_NV, dtype=torch.bool)
    union_NV.scatter_(1, u_s_NV.detach().topk(k, dim=-1).indices, True)
    union_NV.scatter_(1, u_t_NV.topk(k, dim=-1).indices, True)
    s_lp_NV = F.log_softmax(u_s_NV.masked_fill(~union_NV, float("-inf")), dim=-1)
    t_lp_NV = F.log_softmax(u_t_NV.masked_fill(~union_NV, float("-inf")), dim=-1)
    return divergence_terms(s_lp_NV, t_lp_NV, kind, beta, support_NV=union_NV)


def coverage_per_token(
    student_logits_NV: Tensor, teacher_topk_ids_NK: Tensor, temperature: float = 1.0
) -> Tensor:
    """R_n = -log sum_{i in teacher top-k} p_s(i) per token, with autograd (>= 0)."""
    check_temperature(temperature)
    _check_topk(student_logits_NV, teacher_topk_ids_NK, None)
    u_NV = student_logits_NV.to(acc_dtype(student_logits_NV.dtype)) / temperature
    lse_N = torch.logsumexp(u_NV, dim=-1)
    covered_lse_N = torch.logsumexp(u_NV.gather(1, teacher_topk_ids_NK.long()), dim=-1)
    return (lse_N - covered_lse_N).clamp(min=0.0)


def coverage_regularizer(
    student_logits_NV: Tensor,
    teacher_topk_ids_NK: Tensor,
    temperature: float = 1.0,
    weights_N: Tensor | None = None,
) -> Tensor:
    """Sum over tokens of weights_n * R_n (coverage-aware regulariser, TCAD). Scalar SUM."""
    r_N = coverage_per_token(student_logits_NV, teacher_topk_ids_NK, temperature)
    return r_N.sum() if weights_N is None else (r_N * weights_N.to(r_N.dtype)).sum()
