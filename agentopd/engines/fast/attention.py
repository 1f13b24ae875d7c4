"""Paged attention for the fast engine: the batch description and the pure-torch reference.

A step's tokens are one flat batch of N tokens made of R rows (one row = consecutive new tokens
of one sequence). Row r's queries are tokens `q_start[r] : q_start[r] + q_len[r]`; after this
step's K/V are written, the row's context holds `ctx_len[r]` tokens laid out in pages
`page_table[r, :]` of the pool (slot = page * PAGE + offset). Query j of a row sits at position
`ctx_len - q_len + j` and attends to every context position <= its own (causal).

`paged_attention(q, k_cache, v_cache, batch, scale)` dispatches: the Triton kernels
(`triton_attention.py`) on CUDA, `reference_attention` (torch SDPA over gathered pages) on CPU
and wherever Triton is missing. The reference is the definition the kernels are tested against. A pool in
fp8 (`kv_cache.kv_dtype`) is read up to the queries' dtype before the products, by the reference and the kernels alike.

Legend: N flat tokens, R rows, P pages per row (table width), T context tokens, Hq / Hkv query /
kv heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

PAGE = 16  # tokens per KV page
FP8 = torch.float8_e4m3fn  # a pool's fp8 element type (engine.kv_cache_dtype=fp8: kv_cache.kv_dtype)


@dataclass
class AttnBatch:
    positions_N: torch.Tensor  # int64, position of each new token
    slots_N: torch.Tensor  # int64, pool slot its K/V is written to
    page_table_RP: torch.Tensor  # int32
    ctx_lens_R: torch.Tensor  # int32, context length after this step
    q_starts_R: torch.Tensor  # int32, first flat token of each row
    q_lens: list[int] = field(default_factory=list)  # host copies (reference path, kernel grids)
    q_starts: list[int] = field(default_factory=list)
    ctx_lens: list[int] = field(default_factory=list)
    decode: bool = False  # every row has one query, row r = token r
    decode_rows: int = 0  # a mixed step: rows 0..decode_rows-1 have one query each (row r = token r)
    num_splits: int = 1  # split-KV factor of the decode kernel (fixed per captured graph)
    cascade: tuple | None = None  # decode: (start_R, tile_rows_TK, tile_len_T), shared prompts read once (shared_prefix.py)
    memo: dict = field(default_factory=dict)  # per-step kernel metadata, built once for all layers


def slot_table(page_table_RP: torch.Tensor, width: int) -> torch.Tensor:
    """[R, width] pool slots of context positions 0..width-1 of each row."""
    t = torch.arange(width, device=page_table_RP.device)
    return page_table_RP[:, t // PAGE].long() * PAGE + t % PAGE


def gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for any index shape (index_select: 2-7x faster than advanced indexing on CPU). An fp8 pool is
    gathered as bytes (CPU torch has no fp8 index_select) and returned as fp8."""
    src = cache.view(torch.uint8) if cache.dtype == FP8 else cache
    return src.index_select(0, slots.reshape(-1)).view(cache.dtype).view(*slots.shape, *cache.shape[1:])


def reference_attention(q_NHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
                        scale: float) -> torch.Tensor:
    """Causal attention of every row's queries over its paged context (torch SDPA, grouped heads)."""
    if "ref" not in batch.memo:  # gathers' indices and masks, the same for every layer of the step
        batch.memo["ref"] = _reference_plan(batch, q_NHD.device)
    dec, rest = batch.memo["ref"]
    if dec is not None:  # one-query rows together, contexts padded to the longest
        tok_R, slots_RT, valid_RT = dec
        k = gather(k_cache, slots_RT).transpose(1, 2).to(q_NHD.dtype)  # [R, Hkv, T, D] (an fp8 pool read up)
        v = gather(v_cache, slots_RT).transpose(1, 2).to(q_NHD.dtype)
        q = (q_NHD if batch.decode else q_NHD[tok_R])[:, :, None]  # [R, Hq, 1, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=valid_RT, scale=scale, enable_gqa=True)
        if batch.decode:  # row r is token r: nothing to scatter
            return o[:, :, 0]
    out_NHD = torch.empty_like(q_NHD)
    if dec is not None:
        out_NHD[tok_R] = o[:, :, 0]
    for start, n, slots_T, mask_nT in rest:
        k = gather(k_cache, slots_T).transpose(0, 1)[None].to(q_NHD.dtype)  # [1, Hkv, T, D]
        v = gather(v_cache, slots_T).transpose(0, 1)[None].to(q_NHD.dtype)
        q = q_NHD[start : start + n].transpose(0, 1)[None]  # [1, Hq, n, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_nT, scale=scale, enable_gqa=True)
        out_NHD[start : start + n] = o[0].transpose(0, 1)
    return out_NHD


def _reference_plan(batch: AttnBatch, device: torch.device):
    dec = None
    rows = [r for r, n in enumerate(batch.q_lens) if n == 1]
    if rows:
        width = max(batch.ctx_lens[r] for r in rows)
        slots_RT = slot_table(batch.page_table_RP[rows], width)
        ctx_R = torch.tensor([batch.ctx_lens[r] for r in rows], device=device)
        valid_RT = torch.arange(width, device=device)[None] < ctx_R[:, None]
        tok_R = None if batch.decode else torch.tensor([batch.q_starts[r] for r in rows], device=device)
        dec = (tok_R, slots_RT, valid_RT[:, None, None])
    rest = []
    for r, n in enumerate(batch.q_lens):
        if n > 1:
            ctx = batch.ctx_lens[r]
            slots_T = slot_table(batch.page_table_RP[r : r + 1], ctx)[0]
            qpos = torch.arange(ctx - n, ctx, device=device)
            rest.append((batch.q_starts[r], n, slots_T, torch.arange(ctx, device=device)[None] <= qpos[:, None]))
    return dec, rest


def paged_attention(q_NHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
                    scale: float) -> torch.Tensor:
    if q_NHD.is_cuda:
        from agentopd.engines.fast import triton_attention

        if triton_attention.available():
            if batch.decode:
                return triton_attention.decode_attention(q_NHD, k_cache, v_cache, batch.page_table_RP,
                                                         batch.ctx_lens_R, scale, batch.num_splits,
                                                         cascade=batch.cascade)
            return triton_attention.prefill_attention(q_NHD, k_cache, v_cache, batch, scale)
    return reference_attention(q_NHD, k_cache, v_cache, batch, scale)
