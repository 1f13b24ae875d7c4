"""Which decode rows share a prompt's pages: the tiles the decode kernel reads a shared prompt once for.

    start_R, tiles_TK, tile_len_T = tiles(table_RW, ctx_lens, rows=8)

The samples of one task (rollout.n) begin with the same prompt, and the prefix cache (kv_cache.PageAllocator) gives
them the same pages for it. A decode step reads every row's whole context; at the README's GPU example (8 samples of
a ~380-token prompt, ~900 tokens of mean context) ~40% of the K/V bytes it reads are those prompts, each read once
per sample. `tiles` finds them in the step's page table: rows sorted by their pages, neighbours' common leading
pages, rows cut into tiles of up to `rows` whose leading pages are the same; the kernel
(`triton_attention.decode_attention(..., cascade=...)`) reads a tile's shared pages once for all its rows and each
row's own pages after them, and merges both by log-sum-exp as its splits are merged.

Only pages before the one holding a row's newest token are shared (the prefix cache shares full pages that nobody
writes); a tile shares at least `min_tokens`, less is not worth a program. Rows in no tile start at 0.

Legend: R rows, W table width (pages), T tiles, K rows a tile.
"""

from __future__ import annotations

import numpy as np

from agentopd.engines.fast.attention import PAGE

MIN_TOKENS = 64  # one block of the kernel's loop: a shared prompt shorter than that is read per row


def tiles(table_RW: np.ndarray, ctx_lens, rows: int, min_tokens: int = MIN_TOKENS
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start_R, tiles_TK, tile_len_T), int32: each row's first token of its own part (0 outside a tile), the rows of
    each tile (-1 padded to `rows`), and the tokens each tile's rows share."""
    R, W = table_RW.shape
    ctx = np.asarray(ctx_lens, dtype=np.int64)
    start = np.zeros(R, dtype=np.int32)
    empty = np.zeros((0, rows), dtype=np.int32), np.zeros(0, dtype=np.int32)
    if R < 2:
        return (start, *empty)
    full = np.minimum((ctx - 1) // PAGE, W)  # pages before the newest token's: written, never written again
    cols = int(full.max())
    if cols * PAGE < min_tokens:
        return (start, *empty)
    table = np.where(np.arange(cols)[None, :] < full[:, None], table_RW[:, :cols], -1)  # a row's other pages unshared
    order = np.lexsort(table.T[::-1])  # rows with the same leading pages side by side
    t = table[order]
    same = (t[1:] == t[:-1]) & (t[1:] >= 0)
    lcp = np.where(same.all(axis=1), cols, same.argmin(axis=1)).tolist()  # pages row k+1 shares with row k
    spans = []  # (first, last, pages) in `order`
    least, i = -(-min_tokens // PAGE), 0
    while i < R - 1:
        if lcp[i] < least:
            i += 1
            continue
        j, shared = i + 1, lcp[i]  # rows i..j of `order` share `shared` pages; a row that shares fewer (another
        while j < R - 1 and j - i + 1 < rows and lcp[j] >= shared:  # prompt with the same start) opens a tile
            j += 1
        spans.append((i, j, shared))
        i = j + 1
    if not spans:
        return (start, *empty)
    first, last, pages = (np.asarray(c) for c in zip(*spans))
    k = np.arange(rows)
    pos = first[:, None] + k[None, :]
    inside = pos <= last[:, None]
    tiles_TK = np.where(inside, order[np.minimum(pos, R - 1)], -1).astype(np.int32)
    start[tiles_TK[inside]] = np.repeat(pages * PAGE, inside.sum(axis=1))
    return start, tiles_TK, (pages * PAGE).astype(np.int32)
