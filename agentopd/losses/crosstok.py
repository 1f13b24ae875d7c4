"""Losses over cross-tokenizer spans (agentopd.crosstok.align): a teacher whose tokenizer differs from the student's.

Legend: N student tokens (mask 1), S spans, K teacher top-k, V student vocabulary, W teacher vocabulary.
A span s covers student tokens x_a..x_b and teacher tokens y_c..y_d spelling the same bytes after the same text.

(a) Sampled-token k1 on span log-probabilities (exact, no vocabulary map):
    log p_s(span) = sum_{i in s} log p_s(x_i | ...),   log p_t(span) = sum_{j in s} log p_t(y_j | ...)
    k1_s = log p_s(span) - log p_t(span)          (a one-sample estimate of the reverse KL over span texts)
    A_i  = -k1_s(sampler logprobs)  for every student token i of span s
  trained as sampled_k1 is (agentopd.losses.policy: policy_gradient_loss with these advantages). A span is one
  action: E_s[A_s grad log p_s(span)] = grad of the span-level reverse KL, and grad log p_s(span) is the sum of
  its tokens' grad log p_s: hence every token of the span carries the span's advantage. With one tokenizer every
  span is one token and this is sampled_k1 exactly (tested). The teacher's log-probability of the span is the
  probability of *its* tokenization of the text only (one of several spelling the same bytes): a lower bound
  of log p_t(text), as the student's is.

(b) Full-distribution term at span starts (the first student token and the first teacher token of a span are
  predicted from the same text, so their distributions are over "what comes next"):
    vocabulary map  m: teacher id -> student id of the same bytes (None where the student has no such token)
    mapped KL (1:1 spans, where one student and one teacher token spell the span): the teacher's top-k,
      mapped, with everything unmapped or outside the top-k pooled in one tail outcome:
        q_v = sum_{k: m(y_k) = v} p_t(y_k),  q_tail = 1 - sum_v q_v,  s_tail = 1 - sum_{v mapped} p_s(v)
        KL_map = sum_v q_v (log q_v - log p_s(v)) + q_tail (log q_tail - log s_tail)
      the forward KL between both distributions coarse-grained to the same |map(top-k)| + 1 outcomes
      (<= the forward KL over strings; 0 when they agree on the mapped tokens).
    ULD fallback (the other span starts; Boizard et al. 2024, TRL's GOLD): vocabularies do not match there, so
      compare sorted probabilities, an upper-bounded transport distance that needs no map:
        ULD = sum_{r < K} |p_s^(r) - p_t^(r)| + |(1 - sum_{r<K} p_s^(r)) - (1 - sum_{r<K} p_t^(r))|
      where p^(r) is the r-th largest probability; with K >= both vocabularies this is GOLD's padded L1.
  Which applies is a per-position choice (`full_kind`: 1:1 mapped KL, else ULD, or "none" outside 1:1).
All return SUMs over tokens (the trainer divides by the global student-token count, docs/design.md 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

import torch
from torch import Tensor

NEG_INF = float("-inf")


class FullKind(StrEnum):
    """What the full-distribution term does at a span start that is not a mapped 1:1 position."""

    ULD = "uld"  # sorted-probability L1 (GOLD's fallback)
    NONE = "none"  # nothing: only mapped 1:1 positions are trained


def span_sum(values_N: Tensor, span_N: Tensor, num_spans: int) -> Tensor:
    """values_S: the sum of each span's token values (span_N: the span of each token, 0..num_spans-1)."""
    assert values_N.shape == span_N.shape, (values_N.shape, span_N.shape)
    return values_N.new_zeros(num_spans).index_add(0, span_N.long(), values_N)


def span_k1_advantages(old_logprobs_N: Tensor, teacher_span_logprobs_S: Tensor, span_N: Tensor) -> Tensor:
    """adv_N: each student token carries its span's -k1 = log p_t(span) - log p_old(span) (detached; module doc (a))."""
    old_S = span_sum(old_logprobs_N.detach(), span_N, teacher_span_logprobs_S.shape[0])
    return (teacher_span_logprobs_S.detach().to(old_S.dtype) - old_S)[span_N.long()]


def vocab_map(student_bytes: Sequence[bytes], teacher_bytes: Sequence[bytes]) -> tuple[Tensor, float]:
    """(map_W, share): map_W[w] = the student id spelling teacher id w's bytes, -1 where none (injective: a second
    teacher id of the same bytes maps to -1); share = mapped teacher ids / W (the shared-vocabulary share)."""
    by_bytes: dict[bytes, int] = {}
    for i, b in enumerate(student_bytes):
        if b:
            by_bytes.setdefault(b, i)
    out = torch.full((len(teacher_bytes),), -1, dtype=torch.long)
    used: set[int] = set()
    for w, b in enumerate(teacher_bytes):
        v = by_bytes.get(b)
        if v is not None and v not in used:
            out[w] = v
            used.add(v)
    return out, float(len(used)) / max(1, len(teacher_bytes))


def mapped_topk_kl_per_token(
    student_logits_NV: Tensor, teacher_topk_ids_NK: Tensor, teacher_topk_logprobs_NK: Tensor, map_W: Tensor | None
) -> tuple[Tensor, Tensor]:
    """(KL_map per token, mapped teacher mass per token): module doc (b), with autograd through the student.
    map_W=None: the ids are student ids already (-1: no student spelling)."""
    lp_NV = torch.log_softmax(student_logits_NV.float(), dim=-1)
    sid_NK = map_W[teacher_topk_ids_NK.long()] if map_W is not None else teacher_topk_ids_NK.long()  # None: ids already mapped
    ok_NK = sid_NK >= 0
    safe_NK = sid_NK.clamp(min=0)
    q_lp_NK = teacher_topk_logprobs_NK.float().masked_fill(~ok_NK, NEG_INF)
    q_NK = q_lp_NK.exp()
    s_lp_NK = lp_NV.gather(1, safe_NK)
    kl_N = torch.where(ok_NK, q_NK * (q_lp_NK - s_lp_NK), 0.0).sum(-1)
    mapped_NV = torch.zeros_like(lp_NV).scatter_add(1, safe_NK, ok_NK.to(lp_NV.dtype)) > 0
    s_tail_lp_N = torch.logsumexp(lp_NV.masked_fill(mapped_NV, NEG_INF), dim=-1)
    q_mass_N = q_NK.sum(-1)
    q_tail_N = (1.0 - q_mass_N).clamp(min=0.0)
    # every student token mapped (s_tail empty): the teacher's tail is rounding only, dropped as topk.py does at K = V
    has_tail_N = torch.isfinite(s_tail_lp_N)
    tail_N = torch.xlogy(q_tail_N, q_tail_N) - q_tail_N * torch.where(has_tail_N, s_tail_lp_N, 0.0)
    return kl_N + torch.where(has_tail_N, tail_N, 0.0), q_mass_N.detach()


def uld_per_token(student_logits_NV: Tensor, teacher_topk_logprobs_NK: Tensor) -> Tensor:
    """ULD_K per token (module doc (b)): L1 between the K largest probabilities of each side, plus their tails."""
    k = teacher_topk_logprobs_NK.shape[1]
    p_NV = torch.softmax(student_logits_NV.float(), dim=-1)
    s_NK = p_NV.topk(min(k, p_NV.shape[1]), dim=-1).values
    if s_NK.shape[1] < k:
        s_NK = torch.nn.functional.pad(s_NK, (0, k - s_NK.shape[1]))
    q_NK = teacher_topk_logprobs_NK.float().exp().sort(dim=-1, descending=True).values
    return (s_NK - q_NK).abs().sum(-1) + ((1.0 - s_NK.sum(-1)) - (1.0 - q_NK.sum(-1))).abs()


def cross_full_per_token(
    student_logits_NV: Tensor,
    teacher_topk_ids_NK: Tensor,
    teacher_topk_logprobs_NK: Tensor,
    map_W: Tensor,
    one_to_one_N: Tensor,
    full_kind: FullKind | str = FullKind.ULD,
) -> tuple[Tensor, dict[str, Tensor]]:
    """(loss_N, stats) at N span starts: KL_map where one_to_one_N (and the student's token maps), else ULD (or 0
    with full_kind="none"). stats: "mapped_share" (positions given KL_map / N), "mapped_mass" (mean teacher mass
    the map keeps at those positions)."""
    full_kind = FullKind(full_kind)
    one_N = one_to_one_N.bool()
    kl_N, mass_N = mapped_topk_kl_per_token(student_logits_NV, teacher_topk_ids_NK, teacher_topk_logprobs_NK, map_W)
    other_N = uld_per_token(student_logits_NV, teacher_topk_logprobs_NK) if full_kind is FullKind.ULD else torch.zeros_like(kl_N)
    loss_N = torch.where(one_N, kl_N, other_N)
    n = max(1, one_N.numel())
    stats = {
        "mapped_share": one_N.float().sum() / n,
        "mapped_mass": (mass_N * one_N).sum() / one_N.sum().clamp(min=1),
    }
    return loss_N, stats


# The trainer's encoding of xtok_full targets (agentopd.crosstok.project): per student token a row of K teacher top-k
# entries whose ids are student ids (-1: no student token spells the teacher's); a 1:1 span start has its mapped ids,
# another span start all -1 (ULD: only the sorted probabilities count), any other token all NOT_A_START.
NOT_A_START = -2


def cross_full_from_rows(
    student_logits_NV: Tensor, ids_NK: Tensor, logprobs_NK: Tensor, full_kind: FullKind | str = FullKind.ULD
) -> tuple[Tensor, dict[str, Tensor]]:
    """(loss_N, stats) from the encoded rows above: KL_map where a row has a mapped id, ULD (or 0: "none") at the
    other span starts, 0 elsewhere. stats (sums): "starts", "mapped" (positions given KL_map), "mapped_mass"."""
    full_kind = FullKind(full_kind)
    start_N = (ids_NK != NOT_A_START).all(-1)
    mapped_N = start_N & (ids_NK >= 0).any(-1)
    lps_NK = torch.where(start_N[:, None], logprobs_NK.float(), 0.0)
    kl_N, mass_N = mapped_topk_kl_per_token(student_logits_NV, ids_NK.clamp(min=-1), lps_NK, None)
    uld_N = uld_per_token(student_logits_NV, lps_NK) if full_kind is FullKind.ULD else torch.zeros_like(kl_N)
    loss_N = torch.where(mapped_N, kl_N, torch.where(start_N, uld_N, 0.0))
    stats = {"starts": start_N.float().sum(), "mapped": mapped_N.float().sum(), "mapped_mass": (mass_N * mapped_N).sum()}
    return loss_N, stats
