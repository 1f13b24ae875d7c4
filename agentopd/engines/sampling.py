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

from agentopd.engines.base import SamplingParams


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
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    temp_B1 = torch.tensor(temps, dtype=torch.float32, device=logits_BV.device)[:, None]
    logprobs_BV = torch.log_softmax(logits_BV.float() / temp_B1, dim=-1)
    tokens_B = logprobs_BV.argmax(dim=-1)  # greedy rows keep this
    for i, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature == 0:
            continue
        lp_V = filter_logprobs(logprobs_BV[i], p.top_k, p.top_p)
        tokens_B[i] = torch.multinomial(lp_V.exp(), 1, generator=gen)[0]
    chosen_B = logprobs_BV.gather(1, tokens_B[:, None])[:, 0]
    return tokens_B.tolist(), chosen_B.tolist()
