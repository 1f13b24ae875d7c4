"""Sampled-token reverse KL as a per-token advantage, trained with a policy-gradient loss.

The cheapest on-policy distillation signal: the teacher scores only the token the student
sampled (so it can be a remote server). Legend: N student tokens (mask 1).

Estimators of the reverse KL  KL(p_s || p_t) = E_{x ~ p_s}[log p_s(x) - log p_t(x)]
from one sample x ~ p_s, with log r = log p_t(x) - log p_s(x) (Schulman's k1 / k3):
    k1 = -log r                 unbiased, can be negative per token
    k3 = (r - 1) - log r        unbiased, always >= 0, lower variance when p_s ~ p_t
The distillation advantage is the negative estimate evaluated with the *sampler's*
logprobs: A = -(k(teacher, sampler)); k1 gives A = log p_t(x) - log p_old(x).

Caution (tested): only k1 as an advantage gives the reverse-KL gradient,
E_s[k1 grad log p_s] = grad KL(p_s || p_t). Using k3 as the advantage drops the
(1 - r) grad log p_s term of its own derivative, and E_s[k3 grad log p_s] =
grad KL(p_s || p_t) - grad KL(p_t || p_s): it *ascends* the forward KL. Use k3 for
estimates and diagnostics (>= 0, low variance), k1 for training.

Policy-gradient losses (SUMS over tokens, weighted; ratio = exp(logp - logp_old)):
    "is"        L = -sum_n w_n * min(ratio_n, is_cap) * A_n, gradient
                -sum w * min(ratio, cap) * A * grad logp (truncated importance sampling;
                is_cap=None means no cap). With one update per batch, ratio = 1 and the
                gradient is the on-policy REINFORCE gradient of the reverse KL.
    "ppo_clip"  L = -sum_n w_n * min(ratio_n A_n, clip(ratio_n, 1 - eps, 1 + eps_high) A_n)
                (eps_high defaults to eps; a larger eps_high is the DAPO "clip-higher").
"""

from __future__ import annotations

from enum import StrEnum

import torch
from torch import Tensor


class KLEstimator(StrEnum):
    K1 = "k1"
    K3 = "k3"


class PGMode(StrEnum):
    IS = "is"  # (truncated) importance sampling
    PPO_CLIP = "ppo_clip"


def _enum(cls, value, name: str):
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not one of {[m.value for m in cls]}") from None


def sampled_kl(
    student_logprobs_N: Tensor, teacher_logprobs_N: Tensor, estimator: KLEstimator | str = "k1"
) -> Tensor:
    """Per-token reverse-KL estimate kl_N for tokens sampled from the student (see module doc)."""
    estimator = _enum(KLEstimator, estimator, "estimator")
    if student_logprobs_N.shape != teacher_logprobs_N.shape:
        raise ValueError(
            f"student logprobs {tuple(student_logprobs_N.shape)} != teacher logprobs "
            f"{tuple(teacher_logprobs_N.shape)}"
        )
    log_r_N = teacher_logprobs_N - student_logprobs_N
    if estimator is KLEstimator.K1:
        return -log_r_N
    return torch.expm1(log_r_N) - log_r_N


def opd_advantages(
    teacher_logprobs_N: Tensor, old_logprobs_N: Tensor, estimator: KLEstimator | str = "k1"
) -> Tensor:
    """adv_N = -(reverse KL estimate) with the sampler's logprobs; k1: teacher - sampler logprob.

    Detached: an advantage is a constant of the policy-gradient loss.
    """
    return -sampled_kl(old_logprobs_N.detach(), teacher_logprobs_N.detach(), estimator)


def policy_gradient_loss(
    logprobs_N: Tensor,
    old_logprobs_N: Tensor,
    advantages_N: Tensor,
    weights_N: Tensor | None = None,
    mode: PGMode | str = "is",
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    is_cap: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """(loss_sum, stats): the weighted SUM of the per-token loss of `mode` (module docstring).

    stats (detached 0-d tensors, weighted by weights_N): "clip_fraction" (share of tokens whose
    clipped or capped branch is active, i.e. whose gradient is altered), "ratio_mean",
    "ratio_max" (over tokens of weight > 0), "tokens" (weight sum). A zero weight masks a token.
    """
    mode = _enum(PGMode, mode, "mode")
    if not logprobs_N.shape == old_logprobs_N.shape == advantages_N.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs_N.shape)}, old_logprobs {tuple(old_logprobs_N.shape)} and "
            f"advantages {tuple(advantages_N.shape)} must have one shape"
        )
    if clip_eps < 0 or (clip_eps_high is not None and clip_eps_high < 0):
        raise ValueError(f"clip_eps={clip_eps} / clip_eps_high={clip_eps_high} must be >= 0")
    if is_cap is not None and is_cap <= 0:
        raise ValueError(f"is_cap={is_cap} must be > 0")
    w_N = torch.ones_like(logprobs_N) if weights_N is None else weights_N.to(logprobs_N.dtype)
    adv_N = advantages_N.detach().to(logprobs_N.dtype)
    ratio_N = torch.exp(logprobs_N - old_logprobs_N.detach())
    if mode is PGMode.IS:
        if is_cap is None:
            per_tok_N, altered_N = -ratio_N * adv_N, torch.zeros_like(ratio_N, dtype=torch.bool)
        else:
            # value min(ratio, cap) * A; gradient min(ratio, cap) * A * grad logp
            scale_N = (ratio_N.clamp(max=is_cap) / ratio_N).detach()
            per_tok_N, altered_N = -ratio_N * scale_N * adv_N, ratio_N.detach() > is_cap
    else:
        high = clip_eps if clip_eps_high is None else clip_eps_high
        unclipped_N = ratio_N * adv_N
        clipped_N = ratio_N.clamp(1.0 - clip_eps, 1.0 + high) * adv_N
        per_tok_N = -torch.minimum(unclipped_N, clipped_N)
        altered_N = (clipped_N < unclipped_N).detach()
    loss = (per_tok_N * w_N).sum()
    with torch.no_grad():
        tokens = w_N.sum()
        denom = tokens.clamp(min=torch.finfo(w_N.dtype).tiny)
        stats = {
            "clip_fraction": (altered_N.to(w_N.dtype) * w_N).sum() / denom,
            "ratio_mean": (ratio_N * w_N).sum() / denom,
            "ratio_max": ratio_N[w_N > 0].max() if bool((w_N > 0).any()) else ratio_N.new_zeros(()),
            "tokens": tokens,
        }
    return loss, stats
