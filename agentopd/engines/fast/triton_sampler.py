"""A fused Triton sampler: the draws and logprobs of sampler.py in one pass over the logits.

    tokens_B, logprobs_B = fused_sample(logits_BV, temp_B, keys_B, greedy_B)

One program per (row, vocabulary chunk) computes the chunk's softmax statistics of `x / T` (online
max and sum of exp) and its best race score: `x / T` for greedy rows (T = 1), `x / T - log(-log u_v)`
for sampled rows, u_v the same lowbias32 counter hash of (row key, token) as `sampler.uniforms`, in
native uint32 arithmetic. Subtracting the row's log-sum-exp does not change which token wins, so a
second, tiny kernel merges the chunks: lse, the winning token (smallest id among equal scores, as
argmax), and its logprob `x / T - lse`. Rows with top-k / top-p use the torch sampler (sampler.py), which
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
    def _partial_kernel(LOGITS, TEMP, KEYS, GREEDY, PM, PS, PBEST, PTOK, V, stride_b,
                        CHUNKS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """One (row, vocabulary chunk): the chunk's softmax statistics (max, sum of exp) and its
        best race score x/T - log(-log u) (greedy rows: x/T) with the token holding it."""
        b = tl.program_id(0)
        c = tl.program_id(1)
        t = tl.load(TEMP + b)
        greedy = tl.load(GREEDY + b) != 0
        key = tl.load(KEYS + b).to(tl.uint32)
        row = LOGITS + b.to(tl.int64) * stride_b
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_tok = tl.zeros([BLOCK], tl.int32)
        for start in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
            tok = start + offs
            valid = tok < V
            x = tl.load(row + tok, mask=valid, other=float("-inf")).to(tl.float32) / t
            m_new = tl.maximum(m, x)
            s = s * tl.where(m == m_new, 1.0, tl.exp(m - m_new)) + tl.where(valid, tl.exp(x - m_new), 0.0)
            m = m_new
            h = _mix32(key ^ _mix32(tok.to(tl.uint32) * 0x9E37 + 0x85EB))
            u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            score = tl.where(valid, tl.where(greedy, x, x - tl.log(-tl.log(u))), float("-inf"))
            better = score > best  # strict: a lane keeps its first (smallest) maximal token
            best = tl.where(better, score, best)
            best_tok = tl.where(better, tok, best_tok)
        mx = tl.max(m, 0)
        ssum = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - mx)), 0)
        top = tl.max(best, 0)
        tl.store(PM + b * CHUNKS + c, mx)
        tl.store(PS + b * CHUNKS + c, ssum)
        tl.store(PBEST + b * CHUNKS + c, top)
        tl.store(PTOK + b * CHUNKS + c, tl.min(tl.where(best == top, best_tok, 2147483647), 0))

    @triton.jit
    def _final_kernel(LOGITS, TEMP, PM, PS, PBEST, PTOK, TOKENS, LOGPROBS, stride_b,
                      CHUNKS: tl.constexpr, C_PAD: tl.constexpr):
        """Merge a row's chunks: the log-sum-exp, the winning token, its logprob x/T - lse."""
        b = tl.program_id(0)
        offs = tl.arange(0, C_PAD)
        cmask = offs < CHUNKS
        m = tl.load(PM + b * CHUNKS + offs, mask=cmask, other=float("-inf"))
        s = tl.load(PS + b * CHUNKS + offs, mask=cmask, other=0.0)
        mx = tl.max(m, 0)
        lse = mx + tl.log(tl.sum(tl.where(cmask, s * tl.exp(m - mx), 0.0), 0))
        best = tl.load(PBEST + b * CHUNKS + offs, mask=cmask, other=float("-inf"))
        toks = tl.load(PTOK + b * CHUNKS + offs, mask=cmask, other=2147483647)
        top = tl.max(best, 0)
        tok = tl.min(tl.where(best == top, toks, 2147483647), 0)
        x = tl.load(LOGITS + b.to(tl.int64) * stride_b + tok).to(tl.float32) / tl.load(TEMP + b)
        tl.store(TOKENS + b, tok)
        tl.store(LOGPROBS + b, x - lse)


def fused_sample(logits_BV: torch.Tensor, temp_B: torch.Tensor, keys_B: torch.Tensor,
                 greedy_B: torch.Tensor, chunk: int = 8192, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen token (int32) and its logprob (fp32) per row; see the module docstring."""
    B, V = logits_BV.shape
    chunks = triton.cdiv(V, chunk)
    dev = logits_BV.device
    pm, ps, pbest = (torch.empty(B, chunks, dtype=torch.float32, device=dev) for _ in range(3))
    ptok = torch.empty(B, chunks, dtype=torch.int32, device=dev)
    _partial_kernel[(B, chunks)](logits_BV, temp_B, keys_B, greedy_B, pm, ps, pbest, ptok, V, logits_BV.stride(0),
                                 CHUNKS=chunks, CHUNK=chunk, BLOCK=block, num_warps=4)
    tokens_B = torch.empty(B, dtype=torch.int32, device=dev)
    logprobs_B = torch.empty(B, dtype=torch.float32, device=dev)
    _final_kernel[(B,)](logits_BV, temp_B, pm, ps, pbest, ptok, tokens_B, logprobs_B, logits_BV.stride(0),
                        CHUNKS=chunks, C_PAD=triton.next_power_of_2(chunks), num_warps=1)
    return tokens_B, logprobs_B
