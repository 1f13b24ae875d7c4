"""Per-row sampling math shared by the in-process engines.

`sample_rows(logits_BV, params, generators)` picks one next token per row, each row with its
own `SamplingParams` and its own `torch.Generator`, and returns the tokens with the logprob
the Engine protocol asks for (engines/base.py): `log_softmax(logits / T)[token]` in fp32 over
the full vocabulary, T = 1 for greedy rows. Top-k / top-p only narrow the set sampled from;
they are not renormalised into the reported logprob.

Legend: B rows in the batch, V vocabulary size.
"""

from __future__ import annotations

import torch

from agentopd.engines.base import SamplingParams, logprob_temperature


def filter_logprobs(logprobs_V: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logprobs with everything outside top-k and the top-p nucleus set to -inf.

    Top-k keeps the k most likely tokens (0 = off). Top-p keeps the smallest set of most likely
    tokens whose probability reaches `top_p` (the token that crosses it is kept, so at least
    one token always survives).
    """
    out_V = logprobs_V
    if 0 < top_k < out_V.numel():
        kth = torch.topk(out_V, top_k).values[-1]
        out_V = out_V.masked_fill(out_V < kth, float("-inf"))
    if top_p < 1.0:
        sorted_V, order_V = torch.sort(out_V, descending=True)
        probs_V = sorted_V.softmax(-1)
        mass_before_V = probs_V.cumsum(-1) - probs_V  # probability of strictly more likely tokens
        drop_V = mass_before_V >= top_p
        out_V = out_V.masked_fill(drop_V.scatter(0, order_V, drop_V), float("-inf"))
    return out_V


def sample_rows(
    logits_BV: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> tuple[list[int], list[float]]:
    """One next token per row and its protocol logprob; `params[i]` and `generators[i]` drive row i."""
    assert logits_BV.dim() == 2 and logits_BV.shape[0] == len(params) == len(generators)
    temps = [logprob_temperature(p.temperature) for p in params]
    temp_B1 = torch.tensor(temps, dtype=torch.float32, device=logits_BV.device)[:, None]
    logprobs_BV = torch.log_softmax(logits_BV.float() / temp_B1, dim=-1)
    tokens_B = logprobs_BV.argmax(dim=-1)  # greedy rows keep this
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    if sampled:
        rows = torch.tensor(sampled, device=logits_BV.device)
        kept_SV = logprobs_BV[rows]
        for j, i in enumerate(sampled):
            if params[i].top_k > 0 or params[i].top_p < 1.0:
                kept_SV[j] = filter_logprobs(kept_SV[j], params[i].top_k, params[i].top_p)
        # Inverse-CDF sampling: one uniform per row from that row's generator, the rest batched.
        u_S = torch.cat([torch.rand(1, generator=generators[i], dtype=torch.float64, device=logits_BV.device)
                         for i in sampled])
        cdf_SV = kept_SV.exp().double().cumsum(dim=-1)
        target_S1 = (u_S * cdf_SV[:, -1])[:, None]
        # side=right never lands on a zero-probability token; the clamp only guards u*total rounding up.
        picked_S = torch.searchsorted(cdf_SV, target_S1, right=True)[:, 0].clamp(max=cdf_SV.shape[1] - 1)
        tokens_B[rows] = picked_S
    chosen_B = logprobs_BV.gather(1, tokens_B[:, None])[:, 0]
    return tokens_B.tolist(), chosen_B.tolist()
