"""A cross-tokenizer teacher's scores of its own stream, brought back onto the student's tokens.

    al = align_episode(ep, student_tok, teacher_tok)
    (t_scores,) = teacher.score([al.teacher_stream])                  # any Teacher: local, Ray actor or server
    xs = project(al, ep.tokens, t_scores)
    xs.train      # TeacherScores on the student's stream: what the trainer's xtok_k1 reads
    xs.store      # per student token teacher "logprobs" whose k1 sums to each span's k1 (kl/* metrics, store, viewer)
    xs.span_kl    # per span: log p_old(span) - log p_t(span); xs.turn_kl: their sum per turn

The trainer trains xtok_k1 as it trains sampled_k1 (advantage = teacher logprob - sampler logprob per token), so
each token's teacher logprob in `train` is set to  old_i + A_s,  A_s = log p_t(span) - log p_old(span): every
token of a span carries its span's advantage (agentopd.losses.crosstok (a)). A token of an inexact span (a
cut-off UTF-8 tail) gets A = 0: no signal. `store` splits A_s evenly over the span's tokens instead, so sums of
per-token k1 (the kl/* metrics, the store's kl_mean, the viewer) are sums of span k1, not span k1 x span length.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from agentopd.crosstok.align import Alignment
from agentopd.losses.crosstok import NOT_A_START
from agentopd.teacher.base import TeacherScores
from agentopd.types import TokenStream


@dataclass
class Projected:
    train: TeacherScores
    store: list[float]
    span_kl: list[float]
    turn_kl: dict[int, float]


def project(al: Alignment, stream: TokenStream, teacher_scores: TeacherScores, map_W: Tensor | None = None) -> Projected:
    """Span log-probabilities of both sides, and the student-side records built from them (module docstring); with
    the teacher's top-k and the vocabulary map, `train` also carries xtok_full's rows (`topk_rows`)."""
    n = al.num_spans
    t_lp, s_lp, size = [0.0] * n, [0.0] * n, [0] * n
    for sid, lp in zip(al.teacher_span_R, teacher_scores.logprobs):
        if sid >= 0:
            t_lp[sid] += lp
    for sid, lp in zip(al.student_span_R, stream.logprobs):
        if sid >= 0:
            s_lp[sid] += lp
            size[sid] += 1
    adv = [(t - s) if exact else 0.0 for t, s, exact in zip(t_lp, s_lp, al.span_exact)]
    train, store = [], []
    for sid, lp in zip(al.student_span_R, stream.logprobs):
        train.append(lp + adv[sid] if sid >= 0 else 0.0)
        store.append(lp + adv[sid] / size[sid] if sid >= 0 else 0.0)
    span_kl = [-a for a in adv]
    turn_kl: dict[int, float] = {}
    for k, kl in zip(al.span_turn, span_kl):
        turn_kl[k] = turn_kl.get(k, 0.0) + kl
    scores = TeacherScores(train)
    if teacher_scores.topk_ids is not None and map_W is not None:
        scores.topk_ids, scores.topk_logprobs = topk_rows(al, teacher_scores, map_W, len(stream.response_mask))
    return Projected(scores, store, span_kl, turn_kl)


def topk_rows(al: Alignment, teacher_scores: TeacherScores, map_W: Tensor, num_response: int) -> tuple[list[list[int]], list[list[float]]]:
    """xtok_full's rows per student response token (encoding: agentopd.losses.crosstok.NOT_A_START): at the first
    student token of each exact span, the teacher's top-k at the span's first teacher token (both predict the
    span's first token after the same text), ids mapped to the student's when the span is 1:1, all -1 when not
    (ULD); NOT_A_START rows elsewhere."""
    assert teacher_scores.topk_ids is not None and teacher_scores.topk_logprobs is not None
    k = len(teacher_scores.topk_ids[0]) if teacher_scores.topk_ids else 1
    ids = [[NOT_A_START] * k for _ in range(num_response)]
    lps = [[0.0] * k for _ in range(num_response)]
    first_t: dict[int, int] = {}
    for j, sid in enumerate(al.teacher_span_R):
        if sid >= 0:
            first_t.setdefault(sid, j)
    seen: set[int] = set()
    for r, sid in enumerate(al.student_span_R):
        if sid < 0 or sid in seen or not al.span_exact[sid]:
            continue
        seen.add(sid)
        j = first_t[sid]
        t_ids = teacher_scores.topk_ids[j]
        ids[r] = [int(map_W[w]) for w in t_ids] if al.span_one_to_one[sid] else [-1] * k
        lps[r] = list(teacher_scores.topk_logprobs[j])
    return ids, lps


def cross_metrics(aligned: list[Alignment], projected: list[Projected]) -> dict[str, float]:
    """The step's alignment metrics: xtok/aligned_share and xtok/one_to_one_share (of the student's tokens),
    xtok/spans_per_token, xtok/kl_span (mean span k1), xtok/kl_turn/<k> (mean over episodes of turn k's summed
    span k1: the per-turn reverse-KL estimate over the turn's text)."""
    tokens = sum(al.shares()["tokens"] for al in aligned)
    if not tokens:
        return {}
    out = {
        "xtok/aligned_share": sum(al.shares()["aligned"] * al.shares()["tokens"] for al in aligned) / tokens,
        "xtok/one_to_one_share": sum(al.shares()["one_to_one"] * al.shares()["tokens"] for al in aligned) / tokens,
        "xtok/spans_per_token": sum(al.num_spans for al in aligned) / tokens,
    }
    spans = [kl for xs in projected for kl in xs.span_kl]
    if spans:
        out["xtok/kl_span"] = sum(spans) / len(spans)
    by_turn: dict[int, list[float]] = {}
    for xs in projected:
        for k, kl in xs.turn_kl.items():
            by_turn.setdefault(k, []).append(kl)
    for k, kls in sorted(by_turn.items()):
        out[f"xtok/kl_turn/{k}"] = sum(kls) / len(kls)
    return out
