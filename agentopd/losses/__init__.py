"""agentopd's loss library (docs/design.md 5): pure functions, every loss masked and returning a SUM.

The trainer selects the N student tokens (response mask 1) of a micro-batch, calls one of
these, and divides by `global_token_count(...)` (all micro-batches, all ranks) so the
gradient does not depend on micro-batching or world size:

    from agentopd import losses
    n_global = losses.global_token_count([mb.loss_mask_1T for mb in micro_batches])
    for mb in micro_batches:
        h_NH = model.model(**mb.inputs).last_hidden_state[0, mb.loss_mask_1T[0].bool()]
        loss = losses.chunked_divergence(h_NH, model.lm_head.weight, teacher_hidden_NH=mb.teacher_hidden_NH,
                                         teacher_head_VH=teacher_head, kind="jsd", beta=0.5)
        losses.normalize_by_tokens(loss, n_global).backward()

Modules:
    divergence  forward KL, reverse KL, generalized JSD(beta): reference + closed-form per-chunk math
    chunked     the chunked autograd function (bounded forward AND backward memory) and its entry points
    fused       the CUDA default of chunked_divergence: both lm_heads + one Triton kernel per chunk
                (loss and logits-gradient in one pass, gradients in forward); the torch path is the reference
    topk        top-k forward KL with a tail bucket; TCAD support-symmetric truncation and coverage regulariser
    policy      sampled-token k1/k3 reverse KL as advantages; importance-sampling / PPO-clip losses
    weighting   reward_beta weights, GRPO advantages, TCAD teacher-confidence weights, global normalisation
    crosstok    a teacher with another tokenizer: span k1 advantages, mapped top-k KL at 1:1 spans, ULD fallback
"""

from agentopd.losses.chunked import (
    chunked_divergence,
    chunked_divergence_per_token,
    chunked_head_loss,
    chunked_head_per_token,
    coverage_regularizer_hidden,
    topk_forward_kl_hidden,
)
from agentopd.losses.crosstok import FullKind, cross_full_per_token, span_k1_advantages, vocab_map
from agentopd.losses.divergence import Divergence, divergence
from agentopd.losses.policy import (
    KLEstimator,
    PGMode,
    opd_advantages,
    policy_gradient_loss,
    sampled_kl,
)
from agentopd.losses.topk import (
    coverage_per_token,
    coverage_regularizer,
    support_union_topk,
    topk_forward_kl,
    topk_forward_kl_per_token,
)
from agentopd.losses.weighting import (
    global_token_count,
    grpo_advantages,
    normalize_by_tokens,
    reward_weights,
    teacher_confidence_weights,
)

__all__ = [
    "Divergence",
    "FullKind",
    "KLEstimator",
    "PGMode",
    "chunked_divergence",
    "chunked_divergence_per_token",
    "chunked_head_loss",
    "chunked_head_per_token",
    "coverage_per_token",
    "coverage_regularizer",
    "coverage_regularizer_hidden",
    "cross_full_per_token",
    "divergence",
    "global_token_count",
    "grpo_advantages",
    "normalize_by_tokens",
    "opd_advantages",
    "policy_gradient_loss",
    "reward_weights",
    "sampled_kl",
    "span_k1_advantages",
    "support_union_topk",
    "teacher_confidence_weights",
    "topk_forward_kl",
    "topk_forward_kl_hidden",
    "topk_forward_kl_per_token",
    "vocab_map",
]
