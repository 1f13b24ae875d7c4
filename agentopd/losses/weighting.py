"""Episode weights and advantages, and the global token normalisation every loss relies on.

Legend: E episodes in the batch, N student tokens. A "group" is the set of episodes that
share a prompt (group_ids_E); without group ids the whole batch is one group.

reward_weights (reward_beta):     w_e = n_g * softmax_{e' in g}(r_e' / beta)_e
    mean 1 within each group g (size n_g): beta -> inf gives all ones, beta -> 0 puts the
    whole group's weight n_g on its best episode(s) (split evenly on ties).
grpo_advantages (task reward):    A_e = (r_e - mean_g r) / (std_g r + eps)
    population std (correction 0); normalize_std=False leaves r_e - mean_g r; a group of
    one episode gets A = 0.
teacher_confidence_weights (TCAD): c_e = exp(mean_{n in e} log p_t(x_n)), the geometric
    mean teacher probability of the student's tokens of episode e, and
    w_e = n_g * softmax_{e' in g}(power * log c_e')_e  = n_g c_e^power / sum_g c^power
    (per-prompt power weighting: mean 1 per group; power 0 gives ones, power > 0 favours
    trajectories the teacher is confident about). Episodes without student tokens get
    weight 0 and do not count in n_g.

Normalisation (docs/design.md 5): every loss returns a SUM over its tokens. The trainer computes
`global_token_count` once per step (all micro-batches, all ranks) and backpropagates
`normalize_by_tokens(loss_sum, count)` per micro-batch; the accumulated gradient then equals
that of the whole-batch mean, whatever the micro-batching or world size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def _group_index(group_ids_E: Tensor | None, e: int, device) -> tuple[Tensor, int]:
    if group_ids_E is None:
        return torch.zeros(e, dtype=torch.long, device=device), 1
    if tuple(group_ids_E.shape) != (e,):
        raise ValueError(f"group_ids {tuple(group_ids_E.shape)} must be (E={e},)")
    _, inverse_E = torch.unique(group_ids_E, return_inverse=True)
    return inverse_E, int(inverse_E.max()) + 1 if e else 0


def _group_softmax_times_size(scores_E: Tensor, group_ids_E: Tensor | None, valid_E: Tensor | None = None) -> Tensor:
    """n_g * softmax of scores within each group (invalid entries: weight 0, not counted)."""
    e = scores_E.shape[0]
    g_E, n_groups = _group_index(group_ids_E, e, scores_E.device)
    valid_E = torch.ones(e, dtype=torch.bool, device=scores_E.device) if valid_E is None else valid_E
    scores_E = scores_E.masked_fill(~valid_E, float("-inf"))
    max_G = torch.full((n_groups,), float("-inf"), dtype=scores_E.dtype, device=scores_E.device)
    max_G = max_G.scatter_reduce(0, g_E, scores_E, reduce="amax")
    exp_E = torch.exp(scores_E - max_G[g_E].nan_to_num(neginf=0.0)).masked_fill(~valid_E, 0.0)
    sum_G = torch.zeros(n_groups, dtype=scores_E.dtype, device=scores_E.device).index_add_(0, g_E, exp_E)
    count_G = torch.zeros(n_groups, dtype=scores_E.dtype, device=scores_E.device).index_add_(
        0, g_E, valid_E.to(scores_E.dtype)
    )
    return torch.where(valid_E, exp_E / sum_G[g_E].clamp(min=torch.finfo(scores_E.dtype).tiny) * count_G[g_E], 0.0)


def reward_weights(rewards_E: Tensor, group_ids_E: Tensor | None = None, beta: float = 1.0) -> Tensor:
    """weights_E = n_g * softmax(rewards / beta) per group (or batch); mean 1 per group."""
    if not beta > 0:
        raise ValueError(f"reward_beta={beta} must be > 0 (use None in the config to turn it off)")
    rewards_E = rewards_E.to(torch.promote_types(rewards_E.dtype, torch.float32))
    return _group_softmax_times_size(rewards_E / beta, group_ids_E)


def grpo_advantages(
    rewards_E: Tensor, group_ids_E: Tensor, eps: float = 1e-6, normalize_std: bool = True
) -> Tensor:
    """adv_E = (r - mean_g r) / (std_g r + eps) per group (std optional, population std)."""
    rewards_E = rewards_E.to(torch.promote_types(rewards_E.dtype, torch.float32))
    g_E, n_groups = _group_index(group_ids_E, rewards_E.shape[0], rewards_E.device)
    zeros_G = torch.zeros(n_groups, dtype=rewards_E.dtype, device=rewards_E.device)
    count_G = zeros_G.index_add(0, g_E, torch.ones_like(rewards_E))
    mean_G = zeros_G.index_add(0, g_E, rewards_E) / count_G
    centered_E = rewards_E - mean_G[g_E]
    if not normalize_std:
        return centered_E
    std_G = (zeros_G.index_add(0, g_E, centered_E**2) / count_G).sqrt()
    return centered_E / (std_G[g_E] + eps)


def teacher_confidence_weights(
    teacher_logprobs: Sequence[Tensor], group_ids_E: Tensor | None = None, power: float = 1.0
) -> Tensor:
    """TCAD trajectory weights from each episode's teacher logprobs of its student tokens.

    `teacher_logprobs[e]` holds the teacher log-probability of every student (mask-1) token of
    episode e. Formula in the module docstring; mean 1 per group over non-empty episodes.
    """
    if not teacher_logprobs:
        return torch.zeros(0)
    lengths = [int(t.numel()) for t in teacher_logprobs]
    mean_lp_E = torch.stack(
        [t.detach().double().mean() if n else torch.zeros((), dtype=torch.float64) for t, n in zip(teacher_logprobs, lengths)]
    )
    valid_E = torch.tensor([n > 0 for n in lengths])
    if group_ids_E is not None:
        group_ids_E = group_ids_E.cpu()
    return _group_softmax_times_size(power * mean_lp_E, group_ids_E, valid_E).float()


def global_token_count(loss_masks: Sequence[Tensor], *, group: dist.ProcessGroup | None = None) -> int:
    """Number of student tokens (mask 1) over these micro-batches and, when torch.distributed is
    initialised, over all ranks of `group` (an all_reduce; every rank must call it)."""
    local = sum(int(m.sum().item()) for m in loss_masks)
    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend(group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        count = torch.tensor([local], dtype=torch.int64, device=device)
        dist.all_reduce(count, group=group)
        return int(count.item())
    return local


def normalize_by_tokens(loss_sum: Tensor, global_tokens: int) -> Tensor:
    """loss_sum / global token count (a step with no student token gives 0, not NaN)."""
    if global_tokens < 0:
        raise ValueError(f"global_tokens={global_tokens} must be >= 0")
    return loss_sum / max(global_tokens, 1)
