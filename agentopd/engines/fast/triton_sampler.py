"""A fused Triton sampler: the same draws and logprobs as sampler.py in two passes over the logits.

    tokens_B, logprobs_B = fused_sample(logits_BV, temp_B, keys_B, greedy_B)

One program per row. Pass 1 computes the row's log-sum-exp of `logits / T` (online max and sum);
pass 2 forms `logprob = logits / T - lse` (T = 1 for greedy rows) and takes the argmax of `logprob` (greedy rows) or of
`logprob - log(-log(u_v))` (sampled rows), with u_v the same lowbias32 counter hash of (row key,
token) as `sampler.uniforms`, in native uint32 arithmetic. The reported logprob is that row's
`logprob` at the chosen token. Rows with top-k / top-p use the torch sampler (sampler.py), which
this kernel matches except for rounding of the log-sum-exp (~1e-7) — so a near-tie could in
principle resolve differently between CPU and GPU, never between two batches on one device.

Legend: B rows, V vocabulary.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _mix32(x):
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _sample_kernel(LOGITS, TEMP, KEYS, GREEDY, TOKENS, LOGPROBS, V, stride_b, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        t = tl.load(TEMP + b)
        row = LOGITS + b.to(tl.int64) * stride_b
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            x = tl.load(row + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32) / t
            m_new = tl.maximum(m, x)
            alpha = tl.where(m == m_new, 1.0, tl.exp(m - m_new))  # -inf lanes stay 0, never nan
            s = s * alpha + tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
            m = m_new
        mx = tl.max(m, 0)
        lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), 0))
        greedy = tl.load(GREEDY + b) != 0
        key = tl.load(KEYS + b).to(tl.uint32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_lp = tl.zeros([BLOCK], tl.float32)
        best_tok = tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            tok = start + offs
            valid = tok < V
            lp = tl.load(row + tok, mask=valid, other=float("-inf")).to(tl.float32) / t - lse
            tkey = _mix32((tok.to(tl.uint32) * 0x9E37 + 0x85EB))
            h = _mix32(key ^ tkey)
            u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            score = tl.where(greedy, lp, lp - tl.log(-tl.log(u)))
            score = tl.where(valid, score, float("-inf"))
            better = score > best  # strict: the first maximal token wins within a lane, as argmax does
            best = tl.where(better, score, best)
            best_lp = tl.where(better, lp, best_lp)
            best_tok = tl.where(better, tok, best_tok)
        top = tl.max(best, 0)
        # among lanes holding the maximum, the smallest token id (torch.argmax's tie rule)
        tok = tl.min(tl.where(best == top, best_tok, 2147483647), 0)
        lp = tl.max(tl.where((best == top) & (best_tok == tok), best_lp, float("-inf")), 0)
        tl.store(TOKENS + b, tok)
        tl.store(LOGPROBS + b, lp)


def fused_sample(logits_BV: torch.Tensor, temp_B: torch.Tensor, keys_B: torch.Tensor,
                 greedy_B: torch.Tensor, block: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen token (int32) and its logprob (fp32) per row; see the module docstring."""
    B, V = logits_BV.shape
    tokens_B = torch.empty(B, dtype=torch.int32, device=logits_BV.device)
    logprobs_B = torch.empty(B, dtype=torch.float32, device=logits_BV.device)
    _sample_kernel[(B,)](logits_BV, temp_B, keys_B, greedy_B, tokens_B, logprobs_B, V, logits_BV.stride(0),
                         BLOCK=block, num_warps=8)
    return tokens_B, logprobs_B
