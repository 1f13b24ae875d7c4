"""The trainer's loss dispatch: one micro-batch's final hidden states -> summed loss + summed stats (what a
run optimises, `run.objective`, is agentopd.objectives; the loss functions themselves are agentopd.losses).

    loss_sum, stats = micro_batch_loss(hidden_NH, head_VH, mb, cfg, teacher_head_VH=None)

`hidden_NH` are the student's final hidden states at the micro-batch's loss positions and
`head_VH` its lm_head weight; full (N, V) logits are never built — the vocabulary-sized work
runs chunk-wise in `agentopd.losses` (divergences, top-k) or in `logprob.chunked_token_logprobs`
(sampled-token policy gradient, GRPO, SFT). Everything returned is a SUM over the micro-batch's
loss tokens; the trainer divides by the global student-token count.

Per loss kind (cfg.loss):
    sampled_k1/k3   advantage = -(reverse-KL estimate from sampled teacher/sampler logprobs)
    xtok_k1         as sampled_k1; each token's teacher logprob is sampler logprob + its span's advantage
                    [+ task_reward_coef * GRPO advantage], IS or PPO-clip policy gradient
    forward_kl, reverse_kl, jsd   chunked full-vocabulary divergence to the teacher, whose logits
                    are recomputed per chunk from its cached hidden states and lm_head
    topk_forward_kl forward KL to the teacher's top-k with a tail bucket
    xtok_full       a teacher with another tokenizer: mapped top-k KL at 1:1 span starts, ULD at the other span
                    starts (trainer.xtok_fallback), from rows agentopd.crosstok.project encodes
    sft             -sum(weight * log p_student(token))
    grpo            policy gradient with the GRPO advantage only
For every kind but the sampled ones and grpo, task_reward_coef > 0 adds a GRPO policy-gradient
term with advantage task_reward_coef * A. Per-token weights (episode weight x reward weighting)
multiply every term.

Legend: N = loss tokens of the micro-batch, H = student hidden, V = vocab, K = teacher top-k.
"""

from __future__ import annotations

import torch

from agentopd.batch import MicroBatch
from agentopd.trainer.config import LossKind, TrainerConfig
from agentopd.trainer.logprob import chunked_token_logprobs

Stats = dict[str, torch.Tensor]

# How the trainer reduces a statistic over micro-batches and ranks: by default a sum divided by
# the global student-token count; these are divided by the summed "pg/weight" or take the max.
WEIGHTED_BY_PG = ("pg/clip_fraction", "pg/ratio_mean")
MAXIMA = ("pg/ratio_max",)


def _pg(logprobs_N, mb: MicroBatch, advantages_N, cfg: TrainerConfig) -> tuple[torch.Tensor, Stats]:
    from agentopd import losses

    loss_sum, stats = losses.policy_gradient_loss(
        logprobs_N,
        mb.old_logprobs_N,
        advantages_N,
        weights_N=mb.weights_N,
        mode=str(cfg.pg_mode),
        clip_eps=cfg.clip_eps,
        clip_eps_high=cfg.clip_eps_high,
        is_cap=cfg.is_cap,
    )
    # the library reports weighted means over the micro-batch: keep weighted sums (WEIGHTED_BY_PG; MAXIMA are reduced by max)
    weight = stats["tokens"].detach().float()
    return loss_sum, {
        "pg/clip_fraction": stats["clip_fraction"].float() * weight,
        "pg/ratio_mean": stats["ratio_mean"].float() * weight,
        "pg/ratio_max": stats["ratio_max"].float(),
        "pg/weight": weight,
    }


def _need(value, name: str, kind: LossKind):
    if value is None:
        raise ValueError(f"loss={kind.value} needs {name} on every TrainSample / train_step (got None)")
    return value


def _teacher_hidden(mb: MicroBatch, cfg: TrainerConfig) -> torch.Tensor:
    """The teacher's hidden states for a full-vocabulary loss; with `teacher_temperature` scaled by
    temperature / teacher_temperature, so that the loss's division of the teacher's logits by `temperature`
    gives logits / teacher_temperature (the lm_head is linear without bias)."""
    hidden_NH = _need(mb.teacher_hidden_NH, "teacher_hidden", cfg.loss)
    if cfg.teacher_temperature is None or cfg.teacher_temperature == cfg.temperature:
        return hidden_NH
    return hidden_NH * (cfg.temperature / cfg.teacher_temperature)


def _xtok_full(hidden_NH: torch.Tensor, head_VH: torch.Tensor, mb: MicroBatch, cfg: TrainerConfig) -> tuple[torch.Tensor, Stats]:
    """xtok_full: the full-distribution term at span starts (agentopd.losses.crosstok.cross_full_from_rows), the
    student's logits built chunk by chunk of tokens (the autograd graph keeps each chunk's logits: memory grows
    with N x V, fine for the embedded vocabularies; a bounded-memory autograd function is what remains)."""
    from agentopd.losses.crosstok import cross_full_from_rows

    ids_NK = _need(mb.teacher_topk_ids_NK, "teacher_topk_ids", cfg.loss)
    lps_NK = _need(mb.teacher_topk_logprobs_NK, "teacher_topk_logprobs", cfg.loss)
    total = hidden_NH.new_zeros((), dtype=torch.float32)
    sums: Stats = {}
    for a in range(0, hidden_NH.shape[0], cfg.chunk_size):
        b = a + cfg.chunk_size
        logits_NV = (hidden_NH[a:b] @ head_VH.T).float() / cfg.temperature
        loss_N, st = cross_full_from_rows(logits_NV, ids_NK[a:b], lps_NK[a:b], cfg.xtok_fallback)
        total = total + (loss_N * mb.weights_N[a:b]).sum()
        for k, name in (("starts", "xtok/start_share"), ("mapped", "xtok/mapped_share")):  # of the student tokens
            sums[name] = sums.get(name, 0.0) + st[k].detach()
    return total, sums


def micro_batch_loss(
    hidden_NH: torch.Tensor,
    head_VH: torch.Tensor,
    mb: MicroBatch,
    cfg: TrainerConfig,
    *,
    teacher_head_VH: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Summed loss (with grad to hidden_NH and head_VH) and summed statistics of one micro-batch."""
    kind = cfg.loss
    stats: Stats = {}
    needs_logprobs = kind.is_sampled or kind in (LossKind.SFT, LossKind.GRPO) or cfg.task_reward_coef > 0
    logprobs_N = None
    if needs_logprobs:
        logprobs_N, entropy_N = chunked_token_logprobs(
            hidden_NH, head_VH, mb.targets_N, temperature=cfg.temperature, chunk_size=cfg.chunk_size
        )
        stats["train/entropy"] = entropy_N.sum()
        stats["train/logprob"] = logprobs_N.detach().sum()
        stats["train/logprob_diff_sampler"] = (logprobs_N.detach() - mb.old_logprobs_N).abs().sum()
    if mb.teacher_logprobs_N is not None:
        # k1 estimate of KL(student || teacher) on the sampled tokens (sampler logprobs)
        stats["train/kl_k1"] = (mb.old_logprobs_N - mb.teacher_logprobs_N).sum()

    if kind.is_sampled:
        from agentopd import losses

        teacher_N = _need(mb.teacher_logprobs_N, "teacher_logprobs", kind)
        # xtok_k1: the runner put each token's span advantage into its teacher logprob (agentopd.crosstok.project)
        estimator = "k3" if kind == LossKind.SAMPLED_K3 else "k1"
        adv_N = losses.opd_advantages(teacher_N, mb.old_logprobs_N, estimator=estimator)
        if cfg.task_reward_coef > 0:
            adv_N = adv_N + cfg.task_reward_coef * mb.advantages_N
        stats["train/advantage"] = adv_N.detach().sum()
        loss_sum, pg_stats = _pg(logprobs_N, mb, adv_N, cfg)
        return loss_sum, stats | pg_stats
    if kind == LossKind.GRPO:
        loss_sum, pg_stats = _pg(logprobs_N, mb, mb.advantages_N, cfg)
        return loss_sum, stats | pg_stats

    if kind == LossKind.SFT:
        loss_sum = -(mb.weights_N * logprobs_N).sum()
    elif kind.is_full_vocab:
        from agentopd import losses

        loss_sum = losses.chunked_divergence(
            hidden_NH,
            head_VH,
            teacher_hidden_NH=_teacher_hidden(mb, cfg),
            teacher_head_VH=_need(teacher_head_VH, "teacher_head_VH", kind),
            kind=str(kind),
            beta=cfg.beta,
            temperature=cfg.temperature,
            weights_N=mb.weights_N,
            chunk_size=cfg.chunk_size,
        )
    elif kind == LossKind.TOPK_FORWARD_KL:
        from agentopd import losses

        loss_sum = losses.topk_forward_kl_hidden(
            hidden_NH,
            head_VH,
            _need(mb.teacher_topk_ids_NK, "teacher_topk_ids", kind),
            _need(mb.teacher_topk_logprobs_NK, "teacher_topk_logprobs", kind),
            temperature=cfg.temperature,
            weights_N=mb.weights_N,
            chunk_size=cfg.chunk_size,
        )
    elif kind == LossKind.XTOK_FULL:
        loss_sum, xstats = _xtok_full(hidden_NH, head_VH, mb, cfg)
        stats |= xstats
    else:
        raise AssertionError(f"unhandled loss kind {kind}")
    if kind != LossKind.SFT:
        stats["train/distill_loss"] = loss_sum.detach()
    if cfg.task_reward_coef > 0:
        task_sum, pg_stats = _pg(logprobs_N, mb, cfg.task_reward_coef * mb.advantages_N, cfg)
        stats = stats | pg_stats
        loss_sum = loss_sum + task_sum
    return loss_sum, stats
