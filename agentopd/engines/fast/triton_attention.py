"""Triton paged attention kernels for the fast engine (CUDA; the interpreter runs them on CPU in fp32).

    o_NHD = decode_attention(q_NHD, k_cache, v_cache, page_table_RP, ctx_lens_R, scale, num_splits)
    o_NHD = prefill_attention(q_NHD, k_cache, v_cache, batch, scale)

Both compute exactly what `attention.reference_attention` defines (causal attention of each row's
queries over its paged context, grouped query heads); tests/test_fast_engine.py checks them against
it under `TRITON_INTERPRET=1`, and its GPU tests check the engine built on them against teacher forcing.

- Decode (one query per row): one program per (row, kv head, split). It loads the G query heads that
  share the kv head (padded to 16 rows, so QK^T and PV run on `tl.dot`), walks its share of the row's
  context 64 tokens (4 pages) at a time through the page table (data, so a captured CUDA graph serves
  any lengths), and keeps an online softmax in fp32. Splitting the context (split-KV) keeps the GPU
  busy when rows x kv heads is small; a second small kernel merges the splits by their log-sum-exp.
  Grid and split count depend only on the row count, not on lengths. On an H100 it reads K/V at
  79-95% of the copy bandwidth at 256 rows (benchmarks/results/engine_gpu.md).
- Prefill (a chunk of new tokens per row): one program per (block of BLOCK_M queries of one row,
  query head), flash-attention style with `tl.dot`, causal by position over the paged context.

Legend: N flat tokens, R rows, P pages per row, S splits, Hq / Hkv heads, G = Hq / Hkv, D head dim.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch reference serves
    triton = None

from agentopd.engines.fast.attention import PAGE, AttnBatch


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _decode_kernel(Q, K, V, PT, CTX, O, OP, LSE, scale,
                       stride_qn, stride_qh, stride_kt, stride_kh, stride_pr, stride_on, stride_oh,
                       stride_pr_, stride_ph, stride_ps, stride_lr, stride_lh,
                       G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                       BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        ctx = tl.load(CTX + r)
        per_split = tl.cdiv(tl.cdiv(ctx, BLOCK_N), SPLITS) * BLOCK_N
        t0 = s * per_split
        t1 = tl.minimum(t0 + per_split, ctx)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D)
        heads = h * G + offs_g
        gmask = offs_g < G
        q = tl.load(Q + r * stride_qn + heads[:, None] * stride_qh + offs_d[None, :], mask=gmask[:, None], other=0.0)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for start in range(t0, t1, BLOCK_N):
            offs_t = start + tl.arange(0, BLOCK_N)
            tmask = offs_t < t1
            page = tl.load(PT + r * stride_pr + offs_t // PAGE_SIZE, mask=tmask, other=0)
            slot = page.to(tl.int64) * PAGE_SIZE + offs_t % PAGE_SIZE
            kv_off = slot[:, None] * stride_kt + h * stride_kh + offs_d[None, :]
            k = tl.load(K + kv_off, mask=tmask[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            qk = tl.where(tmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(qk - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            v = tl.load(V + kv_off, mask=tmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        has = l > 0
        out = acc / tl.where(has, l, 1.0)[:, None]
        if SPLITS == 1:
            tl.store(O + r * stride_on + heads[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                     mask=gmask[:, None])
        else:
            lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
            tl.store(OP + r * stride_pr_ + heads[:, None] * stride_ph + s * stride_ps + offs_d[None, :], out,
                     mask=gmask[:, None])
            tl.store(LSE + r * stride_lr + heads * stride_lh + s, lse, mask=gmask)

    @triton.jit
    def _combine_kernel(OP, LSE, O, stride_pr, stride_ph, stride_ps, stride_lr, stride_lh, stride_on, stride_oh,
                        D: tl.constexpr, SPLITS: tl.constexpr, S_PAD: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, S_PAD)
        offs_d = tl.arange(0, D)
        smask = offs_s < SPLITS
        lse = tl.load(LSE + r * stride_lr + h * stride_lh + offs_s, mask=smask, other=float("-inf"))
        w = tl.exp(lse - tl.max(lse, 0))
        part = tl.load(OP + r * stride_pr + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                       mask=smask[:, None], other=0.0)
        out = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
        tl.store(O + r * stride_on + h * stride_oh + offs_d, out.to(O.dtype.element_ty))

    @triton.jit
    def _prefill_kernel(Q, K, V, O, PT, BLK_ROW, BLK_START, Q_END, CTX, scale,
                        stride_qn, stride_qh, stride_kt, stride_kh, stride_on, stride_oh, stride_pr,
                        G: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        blk = tl.program_id(0)
        hq = tl.program_id(1)
        r = tl.load(BLK_ROW + blk)
        qs = tl.load(BLK_START + blk)
        qe = tl.load(Q_END + r)
        ctx = tl.load(CTX + r)
        kvh = hq // G
        offs_m = qs + tl.arange(0, BLOCK_M)
        mmask = offs_m < qe
        qpos = ctx - (qe - offs_m)
        offs_d = tl.arange(0, D)
        q = tl.load(Q + offs_m[:, None] * stride_qn + hq * stride_qh + offs_d[None, :], mask=mmask[:, None], other=0.0)
        hi = ctx - qe + tl.minimum(qs + BLOCK_M, qe)  # keys at positions < hi are needed
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for start in range(0, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            nmask = offs_n < hi
            page = tl.load(PT + r * stride_pr + offs_n // PAGE_SIZE, mask=nmask, other=0)
            slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
            kv_off = slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
            k = tl.load(K + kv_off, mask=nmask[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            causal = (offs_n[None, :] <= qpos[:, None]) & nmask[None, :]
            qk = tl.where(causal, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(V + kv_off, mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(O + offs_m[:, None] * stride_on + hq * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=mmask[:, None])


def decode_splits(rows: int, kv_heads: int, num_sms: int = 132, max_splits: int = 16) -> int:
    """Split-KV factor for a decode grid of rows x kv heads: enough programs for ~4 per SM."""
    return max(1, min(max_splits, -(-4 * num_sms // (rows * kv_heads))))


def decode_attention(q_NHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table_RP: torch.Tensor,
                     ctx_lens_R: torch.Tensor, scale: float, num_splits: int = 1, block_n: int = 64) -> torch.Tensor:
    """One query per row (row r = token r): [R, Hq, D] attention output, split-KV, merged by log-sum-exp."""
    R, Hq, D = q_NHD.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    g_pad = max(16, triton.next_power_of_2(G))  # tl.dot needs 16 rows: the kv head's G query heads, padded
    o_NHD = torch.empty_like(q_NHD)
    if num_splits > 1:
        part_RHSD = torch.empty(R, Hq, num_splits, D, device=q_NHD.device, dtype=torch.float32)
        lse_RHS = torch.empty(R, Hq, num_splits, device=q_NHD.device, dtype=torch.float32)
    else:
        part_RHSD = lse_RHS = o_NHD.new_empty(1, 1, 1, 1)
    precision = "ieee" if q_NHD.dtype == torch.float32 else "tf32"
    _decode_kernel[(R, Hkv, num_splits)](
        q_NHD, k_cache, v_cache, page_table_RP, ctx_lens_R, o_NHD, part_RHSD, lse_RHS, scale,
        q_NHD.stride(0), q_NHD.stride(1), k_cache.stride(0), k_cache.stride(1), page_table_RP.stride(0),
        o_NHD.stride(0), o_NHD.stride(1), part_RHSD.stride(0), part_RHSD.stride(1), part_RHSD.stride(2),
        lse_RHS.stride(0), lse_RHS.stride(1),
        G=G, G_PAD=g_pad, D=D, PAGE_SIZE=PAGE, BLOCK_N=block_n, SPLITS=num_splits, PRECISION=precision,
        num_warps=4, num_stages=2,
    )
    if num_splits > 1:
        _combine_kernel[(R, Hq)](
            part_RHSD, lse_RHS, o_NHD, part_RHSD.stride(0), part_RHSD.stride(1), part_RHSD.stride(2),
            lse_RHS.stride(0), lse_RHS.stride(1), o_NHD.stride(0), o_NHD.stride(1),
            D=D, SPLITS=num_splits, S_PAD=triton.next_power_of_2(num_splits), num_warps=4,
        )
    return o_NHD


def prefill_attention(q_NHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
                      scale: float, block_m: int = 64, block_n: int = 64) -> torch.Tensor:
    """Any rows (chunks of new tokens): [N, Hq, D] causal attention over each row's paged context."""
    N, Hq, D = q_NHD.shape
    Hkv = k_cache.shape[1]
    key = ("prefill_blocks", block_m)
    if key not in batch.memo:  # the same for every layer of the step
        blk_row, blk_start, q_end = [], [], []
        for r, (start, n) in enumerate(zip(batch.q_starts, batch.q_lens)):
            q_end.append(start + n)
            for j in range(0, n, block_m):
                blk_row.append(r)
                blk_start.append(start + j)
        meta = torch.tensor([blk_row, blk_start], dtype=torch.int32).to(q_NHD.device, non_blocking=True)
        batch.memo[key] = (meta, torch.tensor(q_end, dtype=torch.int32).to(q_NHD.device, non_blocking=True))
    meta, q_end_R = batch.memo[key]
    o_NHD = torch.empty_like(q_NHD)
    precision = "ieee" if q_NHD.dtype == torch.float32 else "tf32"
    _prefill_kernel[(meta.shape[1], Hq)](
        q_NHD, k_cache, v_cache, o_NHD, batch.page_table_RP, meta[0], meta[1], q_end_R, batch.ctx_lens_R, scale,
        q_NHD.stride(0), q_NHD.stride(1), k_cache.stride(0), k_cache.stride(1), o_NHD.stride(0), o_NHD.stride(1),
        batch.page_table_RP.stride(0),
        G=Hq // Hkv, D=D, PAGE_SIZE=PAGE, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision, num_warps=4,
    )
    return o_NHD
