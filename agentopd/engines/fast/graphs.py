"""CUDA graphs of the fast engine's steps: decode steps, one per batch-size bucket, and steps that feed prompt
chunks (`MixedGraphs`, at the end), one per bucket of the step's token count.

    graphs = DecodeGraphs(runner, max_rows=256, max_pages=256)   # captures every bucket (seconds)
    logits_RV = graphs.run(ids_R, positions_R, slots_R, page_table_RP, ctx_lens_R)

A decode step of R rows replays the graph of the smallest bucket >= R. Everything that changes
between steps — token ids, positions, write slots, page tables, context lengths — lives in static
buffers that `run` fills before the replay, so one capture serves any lengths and any pages
(the attention kernel's grid depends on the bucket only). Padding rows read and write the scratch
page 0 and are dropped from the output. Weights are updated in place (model.py), so graphs stay
valid across `update_weights`.

Legend: R rows, P pages per row, V vocabulary.
"""

from __future__ import annotations

import numpy as np
import torch

from agentopd.engines.fast.attention import AttnBatch
from agentopd.engines.fast.model import ModelRunner
from agentopd.engines.fast.triton_attention import decode_splits, prefix_tile

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def _capture(step, pool, dev) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Run `step` once on a side stream (Triton compiles, the allocator settles), then capture it into a CUDA graph
    that shares the memory pool `pool` (None: a new one); returns the graph and the tensor `step` returned."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    return graph, out


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_rows: int, max_pages: int, shared_prompts: bool = False) -> None:
        dev = runner.device
        self.buckets = [b for b in BUCKETS if b < max_rows] + [max_rows]
        self.ids = torch.zeros(max_rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=dev)
        self.slots = torch.zeros(max_rows, dtype=torch.long, device=dev)
        self.page_table = torch.zeros(max_rows, max_pages, dtype=torch.int32, device=dev)
        self.ctx_lens = torch.ones(max_rows, dtype=torch.int32, device=dev)
        q_starts = torch.arange(max_rows, dtype=torch.int32, device=dev)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        # shared_prompts: each row's own part's start, and the tiles of rows that share a prompt's pages
        # (shared_prefix.tiles; a bucket of b rows has room for b // 2 tiles of >= 2 rows), read once a tile
        self.shared = shared_prompts
        self.tile_k = prefix_tile(runner.shape.q_heads // runner.shape.kv_heads)[0]
        tiles = max(1, max_rows // 2)
        self.start = torch.zeros(max_rows, dtype=torch.int32, device=dev)
        self.tile_len = torch.zeros(tiles, dtype=torch.int32, device=dev)
        self.tile_rows = torch.full((tiles, self.tile_k), -1, dtype=torch.int32, device=dev)
        self._loaded: tuple | None = None  # (tiles, rows, bucket) the buffers hold: the engine keeps a step's tiles
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # views of one buffer: a step's logits are sampled before the next replay
        out = torch.empty(max_rows, runner.lm_head.shape[0], dtype=torch.float32, device=dev)
        self._inputs: list = []  # tensors the graphs read: they must outlive the capture
        pool = None
        for b in reversed(self.buckets):  # largest first: the smaller ones reuse its memory pool
            nt = max(1, b // 2)
            batch = AttnBatch(self.positions[:b], self.slots[:b], self.page_table[:b], self.ctx_lens[:b], q_starts[:b],
                              decode=True, num_splits=decode_splits(b, runner.shape.kv_heads, sms),
                              cascade=(self.start[:b], self.tile_rows[:nt], self.tile_len[:nt]) if shared_prompts else None)
            sample_idx = torch.arange(b, device=dev)
            self._inputs.append((batch, sample_idx))
            self.graphs[b], self.logits[b] = _capture(
                lambda: runner.forward(self.ids[:b], batch, sample_idx, out[:b]), pool, dev)
            pool = self.graphs[b].pool()
        torch.cuda.synchronize(dev)

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def run(self, ids_R: torch.Tensor, positions_R: torch.Tensor, slots_R: torch.Tensor, page_table_RP: torch.Tensor,
            ctx_lens_R: torch.Tensor, shared: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> torch.Tensor:
        """Replay the smallest bucket's graph for these rows; `shared` (graphs built with shared_prompts): the step's
        `shared_prefix.tiles`, None for none."""
        r, p = page_table_RP.shape
        b = self.bucket(r)
        if self.shared:
            self._load_tiles(r, b, shared)
        self.ids[:r].copy_(ids_R, non_blocking=True)
        self.positions[:r].copy_(positions_R, non_blocking=True)
        self.slots[:r].copy_(slots_R, non_blocking=True)
        self.page_table[:r, :p].copy_(page_table_RP, non_blocking=True)
        self.ctx_lens[:r].copy_(ctx_lens_R, non_blocking=True)
        if b > r:  # padding rows: one token of context on the scratch page
            self.ids[r:b].zero_()
            self.positions[r:b].zero_()
            self.slots[r:b].zero_()
            self.page_table[r:b, 0] = 0
            self.ctx_lens[r:b] = 1
        self.graphs[b].replay()
        return self.logits[b][:r]

    def _load_tiles(self, r: int, b: int, shared) -> None:
        """The bucket's start / tile buffers from the step's tiles in one host-to-device copy; a bucket's spare tiles
        have no tokens (their programs do nothing), its padding rows start at 0. Nothing is copied when the buffers
        already hold these tiles for these rows (the engine hands the same tuple while the same sequences decode)."""
        if self._loaded is not None and self._loaded[0] is shared and self._loaded[1:] == (r, b):
            return
        self._loaded = (shared, r, b)
        nt = max(1, b // 2)
        meta = np.zeros(b + nt + nt * self.tile_k, dtype=np.int32)
        meta[b + nt :] = -1
        if shared is not None:
            start, rows, lens = shared
            meta[:r] = start
            meta[b : b + len(lens)] = lens
            meta[b + nt : b + nt + rows.size] = rows.reshape(-1)
        dev = torch.from_numpy(meta).to(self.start.device, non_blocking=True)
        self.start[:b].copy_(dev[:b])
        self.tile_len[:nt].copy_(dev[b : b + nt])
        self.tile_rows[:nt].copy_(dev[b + nt :].view(nt, self.tile_k))


MIXED_BUCKETS = (512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


class _Staging:
    """Pinned host buffers for a step's host-to-device copies. A copy from pageable memory may wait for the GPU's
    queue, which a step planned ahead must not; each buffer is reused only once its last copy is done (the ring
    spans more steps than can be in flight)."""

    def __init__(self, dtype: torch.dtype, slots: int) -> None:
        self.dtype, self.bufs, self.events, self.i = dtype, [None] * slots, [None] * slots, 0

    def copy(self, src: np.ndarray, dst: torch.Tensor) -> None:
        i = self.i = (self.i + 1) % len(self.bufs)
        if self.events[i] is not None:
            self.events[i].synchronize()
        if self.bufs[i] is None or self.bufs[i].numel() < src.size:
            self.bufs[i] = torch.empty(max(src.size, 4096), dtype=self.dtype, pin_memory=True)
        buf = self.bufs[i][: src.size]
        buf.numpy()[:] = src.reshape(-1)
        dst.copy_(buf.view(src.shape), non_blocking=True)
        self.events[i] = torch.cuda.Event()
        self.events[i].record()


class MixedGraphs:
    """CUDA graphs of the steps that feed prompt chunks (returning turns' observations, new prompts), beside any
    one-query rows, one per bucket of the step's token count:

        mixed = MixedGraphs(runner, max_rows=256, max_pages=256, max_tokens=8192)
        bucket = mixed.load(flat_3N, table_RW, ctx_lens, q_starts, q_lens, n_dec, sample_idx)
        logits_SV = mixed.replay(bucket, len(sample_idx))

    Eagerly, such a step launches ~10 kernels a layer from Python; at a few hundred rows the host's launches took
    longer than the GPU's work. Captured, the step is one replay. What varies lives in static buffers: the tokens
    (ids, positions, slots; padding tokens write the scratch page 0 and are never read), the page table, context
    lengths, the sampled rows (logits of max_rows rows are computed, the first S returned; every bucket writes
    them into one buffer), and the prefill
    kernel's block list and counts (`triton_attention.prefill_meta`), so one grid, sized for the bucket's largest
    step, serves any step of the bucket and its spare programs do nothing.

    Legend: N tokens (3N: ids, positions, slots), R rows, W page-table width, S sampled rows, V vocabulary.
    """

    def __init__(self, runner: ModelRunner, max_rows: int, max_pages: int, max_tokens: int) -> None:
        from agentopd.engines.fast.triton_attention import block_tokens, meta_size, split_meta

        dev = runner.device
        self.buckets = [b for b in MIXED_BUCKETS if b < max_tokens] + [max_tokens]
        self.max_tokens, self.max_rows = max_tokens, max_rows
        s = runner.shape
        self.block_tokens, _ = block_tokens(s.q_heads, s.kv_heads)
        self.i64 = torch.zeros(3 * max_tokens + max_rows, dtype=torch.long, device=dev)
        self.flat = self.i64[: 3 * max_tokens].view(3, max_tokens)  # ids, positions, slots
        self.sample_idx = self.i64[3 * max_tokens :]
        self.page_table = torch.zeros(max_rows, max_pages, dtype=torch.int32, device=dev)
        q_starts = torch.zeros(max_rows, dtype=torch.int32, device=dev)  # (read by no kernel: the block list is)
        self.i32: dict[int, torch.Tensor] = {}  # per bucket: the prefill kernel's metadata, then context lengths
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # one buffer for every bucket, as in DecodeGraphs
        out = torch.empty(max_rows, runner.lm_head.shape[0], dtype=torch.float32, device=dev)
        self._inputs: list = []
        self._stage64, self._stage32 = _Staging(torch.long, 4), _Staging(torch.int32, 8)
        pool = None
        for b in reversed(self.buckets):  # largest first: the smaller ones reuse its memory pool
            blocks = self.max_blocks(b)
            size = meta_size(blocks, max_rows)
            self.i32[b] = torch.zeros(size + max_rows, dtype=torch.int32, device=dev)  # counts 0: a no-op
            meta, ctx_lens = self.i32[b][:size], self.i32[b][size:]
            batch = AttnBatch(self.flat[1, :b], self.flat[2, :b], self.page_table, ctx_lens, q_starts)
            batch.memo[("prefill", self.block_tokens)] = (*split_meta(meta, blocks, max_rows), max_rows + blocks)
            self._inputs.append(batch)
            self.graphs[b], self.logits[b] = _capture(
                lambda: runner.forward(self.flat[0, :b], batch, self.sample_idx, out), pool, dev)
            pool = self.graphs[b].pool()
        torch.cuda.synchronize(dev)

    def max_blocks(self, tokens: int) -> int:
        """Prefill blocks a step of `tokens` tokens in at most max_rows rows can need (one partial block a row)."""
        return tokens // self.block_tokens + self.max_rows

    def fits(self, tokens: int, rows: int) -> bool:
        return tokens <= self.max_tokens and rows <= self.max_rows

    def load(self, flat_3N: np.ndarray, table_RW: np.ndarray, ctx_lens: list[int], q_starts: list[int],
             q_lens: list[int], n_dec: int, sample_idx: list[int]) -> int:
        """Fill the static buffers for this step; returns its bucket. The ids are `flat_ids` (rows that feed a
        token still on the device are filled in there by the caller), then `replay(bucket, S)`."""
        from agentopd.engines.fast.triton_attention import prefill_meta

        n, r = flat_3N.shape[1], len(q_lens)
        b = next(x for x in self.buckets if x >= n)
        i64 = np.zeros(self.i64.numel(), dtype=np.int64)  # padding tokens: id 0, position 0, scratch slot 0
        i64[: 3 * self.max_tokens].reshape(3, self.max_tokens)[:, :n] = flat_3N
        i64[3 * self.max_tokens : 3 * self.max_tokens + len(sample_idx)] = sample_idx
        self._stage64.copy(i64, self.i64)
        i32 = np.ones(self.i32[b].numel(), dtype=np.int32)
        i32[: -self.max_rows] = prefill_meta(q_starts, q_lens, n_dec, self.block_tokens, self.max_blocks(b),
                                             self.max_rows)
        i32[len(i32) - self.max_rows : len(i32) - self.max_rows + r] = ctx_lens
        self._stage32.copy(i32, self.i32[b])
        self._stage32.copy(np.ascontiguousarray(table_RW), self.page_table[:r, : table_RW.shape[1]])
        return b

    @property
    def flat_ids(self) -> torch.Tensor:
        return self.flat[0]

    def replay(self, bucket: int, sampled: int) -> torch.Tensor:
        """[S, V] logits of the step `load` prepared."""
        self.graphs[bucket].replay()
        return self.logits[bucket][:sampled]
