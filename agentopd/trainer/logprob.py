"""Chunked selected-token log-probabilities from final hidden states and the lm_head weight.

    logprobs_N, entropy_N = chunked_token_logprobs(hidden_NH, head_VH, targets_N, temperature=1.0)

Equals `log_softmax(hidden_NH @ head_VH.T / temperature).gather(targets_N)` (and the entropy of
that distribution), but (N, V) logits exist only `chunk_size` rows at a time, in forward and
backward: a custom autograd Function saves its inputs and recomputes each chunk's logits in
backward. Gradients flow to `hidden_NH` and `head_VH`; `entropy_N` carries none (a metric).
The matmuls run in the inputs' dtype (bf16 on GPU: tensor cores) and everything after them in
fp32, as in `agentopd.losses`; hidden and head must share a dtype. Used by the sampled-token losses
(policy gradient, GRPO) and SFT cross-entropy.

Legend: N = selected tokens, H = hidden size, V = vocabulary, C = chunk rows.
"""

from __future__ import annotations

import torch


class _ChunkedTokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, head_VH, targets_N, temperature, chunk_size):
        n = hidden_NH.shape[0]
        logprobs_N = hidden_NH.new_empty(n, dtype=torch.float32)
        entropy_N = hidden_NH.new_empty(n, dtype=torch.float32)
        for s in range(0, n, chunk_size):
            logits_CV = (hidden_NH[s : s + chunk_size] @ head_VH.T).float() / temperature
            lse_C = logits_CV.logsumexp(-1)
            logprobs_N[s : s + chunk_size] = logits_CV.gather(-1, targets_N[s : s + chunk_size, None])[:, 0] - lse_C
            probs_CV = (logits_CV - lse_C[:, None]).exp()
            entropy_N[s : s + chunk_size] = lse_C - (probs_CV * logits_CV).sum(-1)
        ctx.save_for_backward(hidden_NH, head_VH, targets_N)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(entropy_N)
        return logprobs_N, entropy_N

    @staticmethod
    def backward(ctx, grad_N, _grad_entropy):
        hidden_NH, head_VH, targets_N = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        dt = hidden_NH.dtype
        grad_hidden_NH = torch.zeros_like(hidden_NH) if ctx.needs_input_grad[0] else None
        grad_head_VH = torch.zeros_like(head_VH, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for s in range(0, hidden_NH.shape[0], chunk_size):
            h_CH = hidden_NH[s : s + chunk_size]
            g_C = grad_N[s : s + chunk_size].float()
            # d logprob[t] / d logits = onehot(t) - softmax(logits); chain through 1/temperature
            g_CV = -torch.softmax((h_CH @ head_VH.T).float() / temperature, -1) * g_C[:, None]
            g_CV.scatter_add_(-1, targets_N[s : s + chunk_size, None], g_C[:, None])
            g_CV = (g_CV / temperature).to(dt)
            if grad_hidden_NH is not None:
                grad_hidden_NH[s : s + chunk_size] = g_CV @ head_VH
            if grad_head_VH is not None:
                grad_head_VH += (g_CV.T @ h_CH).float()
        return (
            grad_hidden_NH,
            grad_head_VH.to(head_VH.dtype) if grad_head_VH is not None else None,
            None,
            None,
            None,
        )


def chunked_token_logprobs(
    hidden_NH: torch.Tensor,
    head_VH: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_N with grad, entropy_N without) of `targets_N` under softmax(hidden @ head.T / T)."""
    assert hidden_NH.shape[0] == targets_N.shape[0], (hidden_NH.shape, targets_N.shape)
    assert hidden_NH.shape[1] == head_VH.shape[1], (hidden_NH.shape, head_VH.shape)
    assert hidden_NH.dtype == head_VH.dtype, (hidden_NH.dtype, head_VH.dtype)
    return _ChunkedTokenLogprob.apply(hidden_NH, head_VH, targets_N, float(temperature), int(chunk_size))
