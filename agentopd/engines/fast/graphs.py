"""CUDA graphs of the fast engine's decode step, one per batch-size bucket.

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

import torch

from agentopd.engines.fast.attention import AttnBatch
from agentopd.engines.fast.model import ModelRunner
from agentopd.engines.fast.triton_attention import decode_splits

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_rows: int, max_pages: int) -> None:
        dev = runner.device
        self.buckets = [b for b in BUCKETS if b < max_rows] + [max_rows]
        self.ids = torch.zeros(max_rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=dev)
        self.slots = torch.zeros(max_rows, dtype=torch.long, device=dev)
        self.page_table = torch.zeros(max_rows, max_pages, dtype=torch.int32, device=dev)
        self.ctx_lens = torch.ones(max_rows, dtype=torch.int32, device=dev)
        q_starts = torch.arange(max_rows, dtype=torch.int32, device=dev)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._inputs: list = []  # tensors the graphs read: they must outlive the capture
        pool = None
        for b in reversed(self.buckets):  # largest first: the smaller ones reuse its memory pool
            batch = AttnBatch(self.positions[:b], self.slots[:b], self.page_table[:b], self.ctx_lens[:b], q_starts[:b],
                              decode=True, num_splits=decode_splits(b, runner.shape.kv_heads, sms))
            sample_idx = torch.arange(b, device=dev)
            self._inputs.append((batch, sample_idx))
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up: Triton compiles, allocator settles
                runner.forward(self.ids[:b], batch, sample_idx)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = runner.forward(self.ids[:b], batch, sample_idx)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(dev)

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def run(self, ids_R: torch.Tensor, positions_R: torch.Tensor, slots_R: torch.Tensor, page_table_RP: torch.Tensor,
            ctx_lens_R: torch.Tensor) -> torch.Tensor:
        r, p = page_table_RP.shape
        b = self.bucket(r)
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
