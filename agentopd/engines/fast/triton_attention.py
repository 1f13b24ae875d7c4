"""Triton paged attention kernels for the fast engine (CUDA; the interpreter runs them on CPU in fp32).

    o_NHD = decode_attention(q_NHD, k_cache, v_cache, page_table_RP, ctx_lens_R, scale, num_splits)
    o_NHD = prefill_attention(q_NHD, k_cache, v_cache, batch, scale)  # any rows; one-query rows first

All compute exactly what `attention.reference_attention` defines (causal attention of each row's
queries over its paged context, grouped query heads); tests/test_fast_engine.py checks them against
it under `TRITON_INTERPRET=1`, and its GPU tests check the engine built on them against teacher forcing.

- Decode (one query per row): one program per (row, kv head, split). It loads the G query heads that
  share the kv head (padded to 16 rows, so QK^T and PV run on `tl.dot`), walks its share of the row's
  context 64 tokens (4 pages) at a time through the page table (data, so a captured CUDA graph serves
  any lengths), and keeps an online softmax in fp32. Splitting the context (split-KV) keeps the GPU
  busy when rows x kv heads is small; a second small kernel merges the splits by their log-sum-exp.
  Grid and split count depend only on the row count, not on lengths. On an H100 it reads K/V at
  79-95% of the copy bandwidth at 256 rows (benchmarks/results/engine_gpu.md). An fp8 pool's blocks are read
  up to the queries' dtype as they load: half the bytes a token, the same products.
- Prefill (a chunk of new tokens per row): one program per (block of queries of one row, kv head) holding
  the queries of the group's query heads together (tile row = token x head), so each K/V block is loaded once
  per group; flash-attention style with `tl.dot`, causal by position over the paged context.
- A mixed step (rows of one query beside prompt chunks) puts its one-query rows first; in the same launch
  they run the decode kernel's program (no split), not a prefill block that would spend a whole tile of
  query rows, and a K/V load per query head, on each of them.

Legend: N flat tokens, R rows, P pages per row, S splits, Hq / Hkv heads, G = Hq / Hkv, D head dim.
"""

from __future__ import annotations

import numpy as np
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
    def _attend(q, K, V, PT, prow, t0, t1, h, scale, stride_kt, stride_kh, stride_pr,
                ROWS_Q: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                PRECISION: tl.constexpr):
        # the query tile q [ROWS_Q, D] over context tokens t0..t1-1 of page-table row prow, kv head h, BLOCK_N tokens
        # at a time, online softmax in fp32: (running max, running sum, unnormalised output)
        offs_d = tl.arange(0, D)
        m = tl.full([ROWS_Q], float("-inf"), tl.float32)
        l = tl.zeros([ROWS_Q], tl.float32)
        acc = tl.zeros([ROWS_Q, D], tl.float32)
        for start in range(t0, t1, BLOCK_N):
            offs_t = start + tl.arange(0, BLOCK_N)
            tmask = offs_t < t1
            page = tl.load(PT + prow * stride_pr + offs_t // PAGE_SIZE, mask=tmask, other=0)
            slot = page.to(tl.int64) * PAGE_SIZE + offs_t % PAGE_SIZE
            kv_off = slot[:, None] * stride_kt + h * stride_kh + offs_d[None, :]
            k = tl.load(K + kv_off, mask=tmask[:, None], other=0.0).to(q.dtype)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            qk = tl.where(tmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(qk - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            v = tl.load(V + kv_off, mask=tmask[:, None], other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        return m, l, acc

    @triton.jit
    def _decode_program(Q, K, V, PT, CTX, O, OP, LSE, START, scale, r, h, s,
                        stride_qn, stride_qh, stride_kt, stride_kh, stride_pr, stride_on, stride_oh,
                        stride_pr_, stride_ph, stride_ps, stride_lr, stride_lh,
                        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                        BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
                        CASCADE: tl.constexpr):
        # row r (its one query is token r) x kv head h x split s of the row's context; with CASCADE, of the part
        # after START[r] (the shared prompt before it is the prefix programs' slot SPLITS of the partials)
        ctx = tl.load(CTX + r)
        first = 0
        if CASCADE:
            first = tl.load(START + r)
        per_split = tl.cdiv(tl.cdiv(ctx - first, BLOCK_N), SPLITS) * BLOCK_N
        t0 = first + s * per_split
        t1 = tl.minimum(t0 + per_split, ctx)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D)
        heads = h * G + offs_g
        gmask = offs_g < G
        q = tl.load(Q + r * stride_qn + heads[:, None] * stride_qh + offs_d[None, :], mask=gmask[:, None], other=0.0)
        m, l, acc = _attend(q, K, V, PT, r, t0, t1, h, scale, stride_kt, stride_kh, stride_pr,
                            G_PAD, D, PAGE_SIZE, BLOCK_N, PRECISION)
        has = l > 0
        out = acc / tl.where(has, l, 1.0)[:, None]
        if SPLITS == 1 and not CASCADE:
            tl.store(O + r * stride_on + heads[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                     mask=gmask[:, None])
        else:
            lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
            tl.store(OP + r * stride_pr_ + heads[:, None] * stride_ph + s * stride_ps + offs_d[None, :], out,
                     mask=gmask[:, None])
            tl.store(LSE + r * stride_lr + heads * stride_lh + s, lse, mask=gmask)
            if CASCADE:
                if s == 0:
                    if first == 0:  # no shared prompt: the prefix slot weighs nothing in the merge
                        tl.store(LSE + r * stride_lr + heads * stride_lh + SPLITS,
                                 tl.full([G_PAD], float("-inf"), tl.float32), mask=gmask)

    @triton.jit
    def _prefix_program(Q, K, V, PT, TROWS, TLEN, OP, LSE, scale, t, h,
                        stride_qn, stride_qh, stride_kt, stride_kh, stride_pr,
                        stride_pr_, stride_ph, stride_ps, stride_lr, stride_lh,
                        G: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                        SPLITS: tl.constexpr, PRECISION: tl.constexpr, ROWS: tl.constexpr, M: tl.constexpr):
        # tile t: up to ROWS rows whose first TLEN[t] context tokens are the same pages, x kv head h. Tile row i is
        # (row TROWS[t, i // G], query head h * G + i % G): every K/V block of the shared prompt is loaded once for
        # all of them, and each (row, head) gets its partial over the prompt in slot SPLITS
        n = tl.load(TLEN + t)
        if n > 0:
            offs_i = tl.arange(0, M)
            rr = tl.load(TROWS + t * ROWS + offs_i // G, mask=offs_i < ROWS * G, other=-1)
            valid = rr >= 0
            rr = tl.maximum(rr, 0)
            heads = h * G + offs_i % G
            offs_d = tl.arange(0, D)
            q = tl.load(Q + rr[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=valid[:, None], other=0.0)
            r0 = tl.load(TROWS + t * ROWS)  # the pages are the same in every row of the tile: the first row's
            m, l, acc = _attend(q, K, V, PT, r0, 0, n, h, scale, stride_kt, stride_kh, stride_pr,
                                M, D, PAGE_SIZE, BLOCK_N, PRECISION)
            out = acc / l[:, None]
            tl.store(OP + rr[:, None] * stride_pr_ + heads[:, None] * stride_ph + SPLITS * stride_ps + offs_d[None, :],
                     out, mask=valid[:, None])
            tl.store(LSE + rr * stride_lr + heads * stride_lh + SPLITS, m + tl.log(l), mask=valid)

    @triton.jit
    def _decode_kernel(Q, K, V, PT, CTX, O, OP, LSE, START, TROWS, TLEN, scale, n_rows,
                       stride_qn, stride_qh, stride_kt, stride_kh, stride_pr, stride_on, stride_oh,
                       stride_pr_, stride_ph, stride_ps, stride_lr, stride_lh,
                       G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                       BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
                       CASCADE: tl.constexpr, ROWS: tl.constexpr, M: tl.constexpr):
        # programs 0..n_rows-1 along axis 0: (row, kv head, split); with CASCADE the next ones (split 0 only) are the
        # shared-prompt tiles, in the same launch so that both kinds fill the GPU together
        pid = tl.program_id(0)
        if pid < n_rows:
            _decode_program(Q, K, V, PT, CTX, O, OP, LSE, START, scale, pid, tl.program_id(1), tl.program_id(2),
                            stride_qn, stride_qh, stride_kt, stride_kh, stride_pr, stride_on, stride_oh,
                            stride_pr_, stride_ph, stride_ps, stride_lr, stride_lh,
                            G, G_PAD, D, PAGE_SIZE, BLOCK_N, SPLITS, PRECISION, CASCADE)
        elif CASCADE:
            if tl.program_id(2) == 0:
                _prefix_program(Q, K, V, PT, TROWS, TLEN, OP, LSE, scale, pid - n_rows, tl.program_id(1),
                                stride_qn, stride_qh, stride_kt, stride_kh, stride_pr,
                                stride_pr_, stride_ph, stride_ps, stride_lr, stride_lh,
                                G, D, PAGE_SIZE, BLOCK_N, SPLITS, PRECISION, ROWS, M)

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
                       mask=(smask & (w > 0))[:, None], other=0.0)  # a slot of weight 0 may hold anything
        out = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
        tl.store(O + r * stride_on + h * stride_oh + offs_d, out.to(O.dtype.element_ty))

    @triton.jit
    def _prefill_program(Q, K, V, O, PT, BLK_ROW, BLK_START, Q_END, CTX, scale, blk, hq0,
                         stride_qn, stride_qh, stride_kt, stride_kh, stride_on, stride_oh, stride_pr,
                         G: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        # block `blk`: BLOCK_M // HEADS query tokens of one row x query heads hq0.. hq0 + HEADS - 1 of one kv head
        # (tile row i is token i // HEADS, head i % HEADS), so the kv head's K/V blocks are loaded once for all
        r = tl.load(BLK_ROW + blk)
        qs = tl.load(BLK_START + blk)
        qe = tl.load(Q_END + r)
        ctx = tl.load(CTX + r)
        kvh = hq0 // G
        offs_i = tl.arange(0, BLOCK_M)
        tok = qs + offs_i // HEADS
        head = hq0 + offs_i % HEADS
        mmask = tok < qe
        qpos = ctx - (qe - tok)
        offs_d = tl.arange(0, D)
        q = tl.load(Q + tok[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :], mask=mmask[:, None],
                    other=0.0)
        hi = ctx - qe + tl.minimum(qs + BLOCK_M // HEADS, qe)  # keys at positions < hi are needed
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for start in range(0, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            nmask = offs_n < hi
            page = tl.load(PT + r * stride_pr + offs_n // PAGE_SIZE, mask=nmask, other=0)
            slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
            kv_off = slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
            k = tl.load(K + kv_off, mask=nmask[:, None], other=0.0).to(q.dtype)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            causal = (offs_n[None, :] <= qpos[:, None]) & nmask[None, :]
            qk = tl.where(causal, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(V + kv_off, mask=nmask[:, None], other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(O + tok[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=mmask[:, None])

    @triton.jit
    def _prefill_kernel(Q, K, V, O, PT, BLK_ROW, BLK_START, Q_END, COUNTS, CTX, scale,
                        stride_qn, stride_qh, stride_kt, stride_kh, stride_on, stride_oh, stride_pr,
                        n_kv, G: tl.constexpr, G_PAD: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr,
                        PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        DEC_BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        # COUNTS = (n_dec, n_blocks), on the device, so a captured graph serves any step of its size: programs
        # 0..n_dec-1 along axis 0 take one-query rows (a mixed step's decode rows, row r = token r), each over one kv
        # head (axis 1 < n_kv); the next n_blocks take blocks of prompt chunks; any others (a captured grid's
        # spare programs) do nothing. One launch a layer serves both kinds.
        pid = tl.program_id(0)
        j = tl.program_id(1)
        n_dec = tl.load(COUNTS)
        if pid < n_dec:
            if j < n_kv:
                _decode_program(Q, K, V, PT, CTX, O, O, O, CTX, scale, pid, j, 0,
                                stride_qn, stride_qh, stride_kt, stride_kh, stride_pr, stride_on, stride_oh,
                                0, 0, 0, 0, 0, G, G_PAD, D, PAGE_SIZE, DEC_BLOCK_N, 1, PRECISION, False)
        elif pid - n_dec < tl.load(COUNTS + 1):
            _prefill_program(Q, K, V, O, PT, BLK_ROW, BLK_START, Q_END, CTX, scale, pid - n_dec,
                             j * HEADS, stride_qn, stride_qh, stride_kt, stride_kh, stride_on, stride_oh, stride_pr,
                             G, HEADS, D, PAGE_SIZE, BLOCK_M, BLOCK_N, PRECISION)


def decode_splits(rows: int, kv_heads: int, num_sms: int = 132, max_splits: int = 16) -> int:
    """Split-KV factor for a decode grid of rows x kv heads: enough programs for ~4 per SM."""
    return max(1, min(max_splits, -(-4 * num_sms // (rows * kv_heads))))


def _group_pad(group: int) -> int:
    """Rows of a decode program's query tile: the kv head's query heads, padded (tl.dot needs 16 rows)."""
    return max(16, triton.next_power_of_2(group))


def prefix_tile(group: int) -> tuple[int, int]:
    """(rows, tile rows) of a shared-prompt program: rows x the group's query heads in one `tl.dot` tile of >= 16."""
    rows = max(2, 16 // group)
    return rows, max(16, 1 << (rows * group - 1).bit_length())


def decode_attention(q_NHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table_RP: torch.Tensor,
                     ctx_lens_R: torch.Tensor, scale: float, num_splits: int = 1, block_n: int = 64,
                     cascade: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One query per row (row r = token r): [R, Hq, D] attention output, split-KV, merged by log-sum-exp.

    `cascade` = (start_R, tile_rows_TK, tile_len_T) (`shared_prefix.tiles`): row r attends to its own context from
    start_R[r] on, and the first tile_len_T[t] tokens of the rows tile_rows_TK[t] (-1: none), the same pages in each,
    are read once per tile for all of them (a task's prompt its samples share); both parts merge as splits do."""
    R, Hq, D = q_NHD.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    o_NHD = torch.empty_like(q_NHD)
    slots = num_splits + (cascade is not None)
    if slots > 1:
        part_RHSD = torch.empty(R, Hq, slots, D, device=q_NHD.device, dtype=torch.float32)
        lse_RHS = torch.empty(R, Hq, slots, device=q_NHD.device, dtype=torch.float32)
    else:
        part_RHSD = lse_RHS = o_NHD.new_empty(1, 1, 1, 1)
    rows, tile_m = prefix_tile(G)
    if cascade is not None:
        start_R, tiles_TK, tile_len_T = cascade
        if tiles_TK.shape[1] != rows:
            raise ValueError(f"decode_attention: shared-prompt tiles of {tiles_TK.shape[1]} rows, the kernel's are {rows}")
        extra = tile_len_T.shape[0]
    else:
        start_R = tiles_TK = tile_len_T = ctx_lens_R
        extra = 0
    precision = "ieee" if q_NHD.dtype == torch.float32 else "tf32"
    _decode_kernel[(R + extra, Hkv, num_splits)](
        q_NHD, k_cache, v_cache, page_table_RP, ctx_lens_R, o_NHD, part_RHSD, lse_RHS, start_R, tiles_TK, tile_len_T,
        scale, R, q_NHD.stride(0), q_NHD.stride(1), k_cache.stride(0), k_cache.stride(1), page_table_RP.stride(0),
        o_NHD.stride(0), o_NHD.stride(1), part_RHSD.stride(0), part_RHSD.stride(1), part_RHSD.stride(2),
        lse_RHS.stride(0), lse_RHS.stride(1),
        G=G, G_PAD=_group_pad(G), D=D, PAGE_SIZE=PAGE, BLOCK_N=block_n, SPLITS=num_splits, PRECISION=precision,
        CASCADE=cascade is not None, ROWS=rows, M=tile_m, num_warps=4, num_stages=2,
    )
    if slots > 1:
        _combine_kernel[(R, Hq)](
            part_RHSD, lse_RHS, o_NHD, part_RHSD.stride(0), part_RHSD.stride(1), part_RHSD.stride(2),
            lse_RHS.stride(0), lse_RHS.stride(1), o_NHD.stride(0), o_NHD.stride(1),
            D=D, SPLITS=slots, S_PAD=triton.next_power_of_2(slots), num_warps=4,
        )
    return o_NHD


PREFILL = {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 3, "heads": None}  # heads None: the group
# (block_m 64 = 32 tokens x 2 query heads on Qwen3-0.6B: the fastest of 30 configurations on an H100 summed over
# three step shapes, 0.56 ms a layer against 0.85 for one program a query head: benchmarks/results/engine_gpu.md)


def block_tokens(q_heads: int, kv_heads: int, **config) -> tuple[int, int]:
    """(query tokens, query heads) of one prefill block: block_m tile rows = tokens x heads that share a kv head
    (default: the whole group when its size is a power of two, so each K/V block is loaded once per group)."""
    cfg = {**PREFILL, **config}
    G = q_heads // kv_heads
    heads = cfg["heads"] or (G if G & (G - 1) == 0 else 1)
    if G % heads or heads & (heads - 1) or cfg["block_m"] % heads:
        raise ValueError(f"prefill_attention: heads={heads} must be a power of two dividing the group size {G} "
                         f"and block_m={cfg['block_m']}")
    return cfg["block_m"] // heads, heads


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


def meta_size(blocks: int, rows: int) -> int:
    """Length of `prefill_meta`'s array for that many blocks and rows."""
    return 2 * _pad4(blocks) + _pad4(rows) + 4


def prefill_meta(q_starts: list[int], q_lens: list[int], n_dec: int, tokens: int, max_blocks: int | None = None,
                 max_rows: int | None = None) -> np.ndarray:
    """The prefill kernel's step metadata, one int32 array: block rows, block first tokens (blocks of `tokens`
    queries of the rows after the first n_dec), each row's end token, then (n_dec, number of blocks). With
    max_blocks / max_rows, the parts are sized for those (a captured graph's buffers). Each part starts at a
    multiple of 16 bytes: Triton compiles a kernel once per alignment of its pointers, and the eager path must not
    meet a new one mid-run."""
    blk_row, blk_start = [], []
    for r in range(n_dec, len(q_lens)):
        starts = range(q_starts[r], q_starts[r] + q_lens[r], tokens)
        blk_row += [r] * len(starts)
        blk_start += starts
    b, rows = max_blocks or len(blk_row), max_rows or len(q_lens)
    if len(blk_row) > b or len(q_lens) > rows:
        raise ValueError(f"prefill_meta: {len(blk_row)} blocks / {len(q_lens)} rows exceed {b} / {rows}")
    b4 = _pad4(b)
    meta = np.zeros(meta_size(b, rows), dtype=np.int32)
    meta[: len(blk_row)] = blk_row
    meta[b4 : b4 + len(blk_start)] = blk_start
    meta[2 * b4 : 2 * b4 + len(q_lens)] = np.add(q_starts, q_lens)
    meta[-4:-2] = n_dec, len(blk_row)
    return meta


def split_meta(meta: torch.Tensor, blocks: int, rows: int) -> tuple[torch.Tensor, ...]:
    """Views of `prefill_meta`'s parts in a device tensor: block rows, block starts, row ends, counts."""
    b4, r4 = _pad4(blocks), _pad4(rows)
    return meta[:b4], meta[b4 : 2 * b4], meta[2 * b4 : 2 * b4 + r4], meta[-4:-2]


def prefill_attention(q_NHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
                      scale: float, **config) -> torch.Tensor:
    """Any rows: [N, Hq, D] causal attention of each row's new tokens over its paged context.

    Rows 0..batch.decode_rows-1 (a mixed step's one-query rows, row r = token r) take the decode kernel's path,
    one program a (row, kv head); the others are cut into blocks (`block_tokens`). Both kinds of program run in
    one launch. The step's metadata is built once for all layers (batch.memo), or given there by a captured graph
    (`graphs.MixedGraphs`: its buffers, and a grid for its largest step)."""
    cfg = {**PREFILL, **config}
    N, Hq, D = q_NHD.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    tokens, heads = block_tokens(Hq, Hkv, **config)
    key = ("prefill", tokens)
    if key not in batch.memo:  # the same for every layer of the step
        meta = prefill_meta(batch.q_starts, batch.q_lens, batch.decode_rows, tokens)
        blocks = int(meta[-3])
        dev_meta = torch.from_numpy(meta).to(q_NHD.device, non_blocking=True)
        batch.memo[key] = (*split_meta(dev_meta, blocks, len(batch.q_lens)), batch.decode_rows + blocks)
    blk_row, blk_start, q_end_R, counts, grid = batch.memo[key]
    o_NHD = torch.empty_like(q_NHD)
    precision = "ieee" if q_NHD.dtype == torch.float32 else "tf32"
    _prefill_kernel[(grid, Hq // heads)](
        q_NHD, k_cache, v_cache, o_NHD, batch.page_table_RP, blk_row, blk_start, q_end_R, counts, batch.ctx_lens_R,
        scale, q_NHD.stride(0), q_NHD.stride(1), k_cache.stride(0), k_cache.stride(1), o_NHD.stride(0),
        o_NHD.stride(1), batch.page_table_RP.stride(0), Hkv,
        G=G, G_PAD=_group_pad(G), HEADS=heads, D=D, PAGE_SIZE=PAGE, BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"], DEC_BLOCK_N=64, PRECISION=precision, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return o_NHD
