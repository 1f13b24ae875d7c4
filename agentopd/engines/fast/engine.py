"""FastEngine: paged KV cache kept across an episode's turns, continuous batching, exact logprobs.

    engine = FastEngine("path/or/hub-id", device="cuda", dtype=torch.bfloat16, max_batch_size=256)
    result = await engine.generate(GenerateRequest(prompt_ids, SamplingParams(temperature=1.0), "episode-7"))
    engine.release("episode-7")                       # the episode ended: its pages may be reclaimed
    await engine.update_weights(trainer_state_dict)   # HF names; copied in place
    await engine.close()

The same async Engine protocol as HFEngine (engines/base.py). `generate()` queues a request and
awaits its future; one worker thread runs steps while any work is left: the scheduler
(scheduler.py) picks the step's tokens (decodes, prompt chunks, newcomers), the model runner
(model.py) runs them as one flat batch over the paged pool (kv_cache.py) — on a GPU a captured CUDA
graph, per bucket of rows for decode steps and of tokens for steps that feed prompt chunks
(graphs.py) — and the sampler (sampler.py) draws each row's next
token with its exact logprob. A finished request's future is resolved at once, from the worker,
while the others keep running. Cancelled callers' rows are dropped at the next step.

Episodes that share a prompt start (a system prompt, tool schemas) share its pages: the scheduler
computes it once (scheduler.py), the pool holds one copy, and a decode step's rows read it mostly
from the GPU's L2 cache (benchmarks/results/engine_gpu.md, H100: 256 rows at context 2,048 whose
first half is shared step in 15.4 ms against 21.5 ms with a copy each). With `shared_prompts` (default: wherever the
Triton decode kernel runs) a decode step reads such pages once for each tile of up to 16 / group rows that share them
(shared_prefix.py): a task's 8 samples of a 384-token prompt at ~1,024 tokens, 1.7B shape, 256 rows on an H200, 1.12x
the generated tokens/s; 0.98x where nothing is shared (the merge; benchmarks/results/shared_prompt_gpu.md).

Knobs beyond the shared ones (device, dtype, max_batch_size, seed, vocab_size): `max_model_len`,
`num_pages` (pool size; default: the pool `kv_cache_gb` GiB holds on a GPU, room for
max_batch_size full contexts of up to 2048 tokens on CPU, at least one of max_model_len), `kv_cache_dtype` ("auto": the
model's; "fp8": float8_e4m3fn, half the bytes a token of bf16, so a pool of the same GiB holds twice the tokens; its
decode step reads half the K/V but measured 6-12% slower on an H200, the kernels' conversions costing more than the
bytes saved; the sampled tokens then come from attention over rounded K/V), `token_budget` (new tokens per step),
`cuda_graphs`, `overlap` (plan and queue the next step before reading this one's sampled tokens, so the host's
work hides behind the GPU's; default: on a GPU), `share_weights` (serve a loaded model on its own weights instead of
a copy: the model keeps working on the same memory, e.g. a teacher's scorer beside its play engine).

`sleep()` frees the KV pool and the step graphs (their cached pages are dropped) for a trainer on the
same GPU; `wake()` allocates and captures them again (seconds on a GPU: every bucket).

`update_weights` stops admitting new requests, waits for the running ones to finish, copies the
tensors in place, drops every cached page (their K/V belong to the old weights) and bumps
`weight_version` (reported in each result's info, with `prefix_hit_tokens` and `preemptions`). `timings` adds up
the worker's seconds per phase (schedule; prepare = inputs; step = queuing the model and sampler, and waiting for
the sampled tokens; advance = bookkeeping after queuing and after reading) and counts steps and the rows of decode
steps (their mean: how full the decode batch stayed), for benchmarks and the run's `rollout/engine_*` metrics.

Legend: N flat tokens, R rows, P pages per row, V vocabulary.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from agentopd.engines.base import FinishReason, GenerateRequest, GenerateResult, sampled_vocab
from agentopd.engines.fast import shared_prefix, triton_attention
from agentopd.engines.fast.attention import PAGE, AttnBatch
from agentopd.engines.fast.kv_cache import KVPool, PageAllocator, kv_dtype
from agentopd.engines.fast.model import ModelRunner
from agentopd.engines.fast.sampler import sample_on_device
from agentopd.engines.fast.scheduler import Scheduler, Seq
from agentopd.engines.loop import LoopEngine


def _resolve(seq: Seq, version: int) -> None:
    if seq.future.done():
        return
    info = {"weight_version": version, "prefix_hit_tokens": seq.prefix_hit, "preemptions": seq.preemptions}
    seq.future.set_result(GenerateResult(list(seq.out_ids), list(seq.out_logprobs),
                                         seq.finish or FinishReason.ABORT, info))


class _Launched:
    """A step queued on the device: its rows, the rows that sample, and their tokens and logprobs on the way
    to the host (a pinned copy and an event on CUDA, so reading them waits for this step only)."""

    def __init__(self, rows: list[tuple[Seq, int]], samplers: list[Seq], decode: bool) -> None:
        self.rows, self.samplers, self.decode = rows, samplers, decode
        self.tokens: torch.Tensor | None = None  # [S] on the device: what a following step feeds
        self._host: torch.Tensor | None = None
        self._event: Any = None

    def fetch(self, logprobs: torch.Tensor) -> None:
        both = torch.stack([self.tokens, logprobs])
        if both.is_cuda:
            self._host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            self._host.copy_(both, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = both

    def collect(self) -> dict[Seq, tuple[int, float]]:
        if self._host is None:
            return {}
        if self._event is not None:
            self._event.synchronize()
        tokens, logprobs = self._host.tolist()
        return {seq: (int(tok), lp) for seq, tok, lp in zip(self.samplers, tokens, logprobs) if seq.finish is None}


def _on_priority_stream(device: torch.device) -> None:
    """The worker thread's initializer: its current stream (thread-local) becomes one of the device's highest priority."""
    torch.cuda.set_stream(torch.cuda.Stream(device, priority=-100))  # out of range: the highest there is


class FastEngine(LoopEngine):
    """A Qwen3/Qwen2/Llama-style model served to many concurrent episodes (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        max_batch_size: int = 64,
        seed: int | None = None,
        max_model_len: int | None = None,
        num_pages: int | None = None,
        kv_cache_gb: float = 16.0,
        kv_cache_dtype: str | None = None,
        token_budget: int | None = None,
        cuda_graphs: bool = True,
        overlap: bool | None = None,
        vocab_size: int | None = None,
        share_weights: bool = False,
        priority_stream: bool = False,
        shared_prompts: bool | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if isinstance(model, str):
            if share_weights:
                raise ValueError("share_weights=True shares a loaded model's weights: pass the model, not a reference")
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype or "auto")
        if device is None:
            device = next(model.parameters()).device
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        self.max_model_len = max_model_len or int(getattr(model.config, "max_position_embeddings", 4096))
        self.runner = ModelRunner.from_hf(model, device=self.device, dtype=dtype, max_len=self.max_model_len,
                                          share=share_weights)
        self.vocab_size = sampled_vocab(vocab_size, self.runner.lm_head.shape[0])  # engines/base.py: padding rows unsampled
        s = self.runner.shape
        self.kv_dtype = kv_dtype(kv_cache_dtype, self.runner.dtype)
        need = -(-self.max_model_len // PAGE) + 1
        if num_pages is None:
            if on_gpu:
                per_page = KVPool.bytes_per_token(s.layers, s.kv_heads, s.head_dim, self.kv_dtype) * PAGE
                num_pages = int(kv_cache_gb * 2**30) // per_page
            else:  # and never less than one whole context (a real model's 32,768 positions with a small batch)
                num_pages = max(max_batch_size * -(-min(self.max_model_len, 2048) // PAGE) + 1, need)
        if num_pages < need:
            raise ValueError(f"num_pages={num_pages} cannot hold one context of max_model_len={self.max_model_len} "
                             f"tokens ({need} pages of {PAGE}): raise num_pages / kv_cache_gb or lower max_model_len")
        self.num_pages, self._pages_per_row, self._cuda_graphs = num_pages, need, on_gpu and cuda_graphs
        # decode steps read a prompt that rows share (the samples of a task) once for them all: the Triton kernel's
        # (shared_prefix.py); None = wherever that kernel runs
        triton_decode = on_gpu and triton_attention.available()
        if shared_prompts and not triton_decode:
            raise ValueError("shared_prompts=True needs the Triton decode kernel: a CUDA device with triton installed")
        self.shared_prompts = triton_decode if shared_prompts is None else shared_prompts
        self._tile_k = triton_attention.prefix_tile(s.q_heads // s.kv_heads)[0] if self.shared_prompts else 0
        self._tiles_key, self._tiles = None, None  # the last decode step's rows and their tiles
        self.overlap = on_gpu if overlap is None else overlap
        self.pages = PageAllocator(num_pages)
        self.max_batch_size = max_batch_size
        self.scheduler = Scheduler(self.pages, max_batch_size, token_budget or (8192 if on_gpu else 512),
                                   self.max_model_len)
        self.kv_pool: KVPool | None = None  # the K/V pages' tensors (kv_cache.py); None while asleep
        self._allocate()
        self._table = np.zeros((max_batch_size, need), dtype=np.int32)  # page-table rows of live sequences
        self._free_rows = list(range(max_batch_size - 1, -1, -1))
        self.weight_version = 0
        self._seeds = random.Random(seed)
        self._lock = threading.Lock()  # scheduler state: worker steps vs. the event loop's add/release
        # the one worker thread (LoopEngine); with `priority_stream` (on a GPU) its kernels go to a stream of the highest
        # priority, so that work of lower priority beside it (teacher.overlap's scoring) yields the SMs block by block
        self._high = high = priority_stream and on_gpu
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fast-engine",
                                        initializer=_on_priority_stream if high else None, initargs=(self.device,) if high else ())  # fmt: skip
        if high:
            torch.cuda.synchronize(self.device)  # what start-up queued on the default stream is done before the worker's stream reads it
        self._init_loop()
        self.timings = {"schedule": 0.0, "prepare": 0.0, "step": 0.0, "advance": 0.0, "steps": 0, "decode_steps": 0,
                        "decode_rows": 0, "overlapped_steps": 0, "mixed_graph_steps": 0, "preemptions": 0,
                        "shared_prompt_rows": 0}  # seconds, counts

    # ---- the protocol -------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if (early := self._refuse(request)) is not None:
            return early
        self._ensure_task()
        seed = request.params.seed if request.params.seed is not None else self._seeds.getrandbits(63)
        seq = Seq(request, seed, list(request.token_ids), asyncio.get_running_loop().create_future())
        with self._lock:
            self.scheduler.add(seq)
        self._wake.set()
        try:
            return await seq.future
        except asyncio.CancelledError:
            seq.cancelled = True  # the worker drops the row at its next step
            raise

    def release(self, episode_id: str) -> None:
        """The episode ended: its held pages go back (full ones stay in the prefix cache, idle)."""
        with self._lock:
            self.scheduler.release_episode(episode_id)

    async def close(self) -> None:
        await self._stop_task()
        with self._lock:
            for seq in list(self.scheduler.waiting) + self.scheduler.running:
                if seq.future is not None and not seq.future.done() and not seq.future.get_loop().is_closed():
                    seq.future.get_loop().call_soon_threadsafe(_resolve, seq, self.weight_version)
        self._pool.shutdown(wait=True)

    def stats(self) -> dict[str, int]:
        """Page accounting (tests, benchmarks): pool size, free, idle cached, held by sequences."""
        with self._lock:
            held = sum(1 for r in self.pages.ref if r > 0)
            return {"pages": self.pages.num_pages - 1, "free": len(self.pages.free), "idle": len(self.pages.idle),
                    "held": held, "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting)}

    # ---- event loop side ----------------------------------------------------------------

    def _forget_other_loops(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:  # requests of an ended event loop can never be answered: cancel them
            for seq in list(self.scheduler.waiting) + self.scheduler.running:
                seq.cancelled = seq.cancelled or seq.future.get_loop() is not loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            with self._lock:
                busy = self.scheduler.has_work(admit=not self._paused)
            if not busy:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            self._idle.clear()
            try:
                await loop.run_in_executor(self._pool, self._work)
            except Exception as exc:  # a failed step fails the requests it was serving, not the engine
                with self._lock:
                    rows = self.scheduler.running + list(self.scheduler.waiting)
                    for seq in rows:
                        self.pages.release(seq.pages)
                        seq.pages = []
                    self.scheduler.running, self.scheduler.waiting = [], type(self.scheduler.waiting)()
                for seq in rows:
                    if not seq.future.done():
                        seq.future.set_exception(exc)
        self._idle.set()

    # ---- worker thread ------------------------------------------------------------------

    def _deliver(self, seqs: list[Seq]) -> None:
        for seq in seqs:
            if seq.row >= 0:  # its page-table row is free again
                self._free_rows.append(seq.row)
                seq.row = -1
            loop = seq.future.get_loop()
            if not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(_resolve, seq, self.weight_version)
                except RuntimeError:  # the loop closed meanwhile: nobody waits for this result
                    pass

    @torch.inference_mode()
    def _work(self) -> None:
        """Run steps until nothing is left to run (or the engine closes / pauses with nothing running).

        With `overlap`, the next step is planned and queued before this one's sampled tokens are read
        (`Scheduler.schedule(lookahead=True)`): rows that sample now decode their token from the device, prompt
        chunks and admissions go on beside them. The GPU runs step t+1 while the host reads step t's tokens,
        delivers finished requests and plans step t+2, so a step's host time hides behind the GPU's."""
        prev = None  # a queued step whose sampled tokens are not read yet
        while not self._closed:
            t0 = time.perf_counter()
            with self._lock:
                self._deliver(self.scheduler.drop_cancelled())
                rows = self.scheduler.schedule(admit=not self._paused, lookahead=prev is not None)
                self.timings["preemptions"] = self.scheduler.preemptions
            self.timings["schedule"] += time.perf_counter() - t0
            if rows is None:  # planning ahead would preempt: read the tokens first
                self._finish(prev)
                prev = None
                continue
            if not rows and prev is None:
                return
            t0 = time.perf_counter()
            cur = self._launch(rows, prev) if rows else None
            self.timings["step"] += time.perf_counter() - t0
            if prev is not None:
                self._finish(prev)
            if cur is not None:
                t0 = time.perf_counter()
                with self._lock:
                    self.scheduler.commit(cur.rows)
                self.timings["advance"] += time.perf_counter() - t0
                self.timings["overlapped_steps"] += prev is not None
            prev = cur
            if not self.overlap and prev is not None:
                self._finish(prev)
                prev = None

    def _finish(self, step: _Launched) -> None:
        """Read a step's sampled tokens (waiting for it on the device) and append them; deliver what finished."""
        t0 = time.perf_counter()
        sampled = step.collect()
        t1 = time.perf_counter()
        with self._lock:
            done = self.scheduler.finish(step.samplers, sampled)
        self._deliver(done)
        t = self.timings
        t["step"] += t1 - t0
        t["advance"] += time.perf_counter() - t1
        t["steps"] += 1
        t["decode_steps"] += step.decode
        t["decode_rows"] += len(step.rows) if step.decode else 0

    def _launch(self, rows: list[tuple[Seq, int]], prev: _Launched | None = None) -> _Launched:
        """Queue the rows' new tokens through the model and the sampler for rows that reached their end.

        A pending row (`Seq.pending`) feeds the token `prev` sampled for it, still on the device."""
        t0 = time.perf_counter()
        rows = sorted(rows, key=lambda row: row[1] != 1)  # one-query rows first: a mixed step's decode program takes them
        ids, positions, slots, q_starts, q_lens, ctx_lens, sample_idx, samplers = [], [], [], [], [], [], [], []
        chunks = []  # rows of several tokens (after the one-query rows): (ids, positions, slots)
        num_tokens = 0
        dst, src = [], []  # pending rows: flat token <- prev's sampled token
        src_of = {seq: i for i, seq in enumerate(prev.samplers)} if prev is not None else {}
        table_rows = []
        for seq, n in rows:
            start = seq.num_cached
            assert not self.pages.is_registered(seq.pages[start // PAGE]), "a cached page would be written"
            q_starts.append(num_tokens)
            q_lens.append(n)
            ctx_lens.append(start + n)
            if seq.row < 0:
                if not self._free_rows:  # preempted sequences keep theirs: grow the table
                    self._free_rows = list(range(2 * len(self._table) - 1, len(self._table) - 1, -1))
                    self._table = np.concatenate([self._table, np.zeros_like(self._table)])
                seq.row, seq.table_len = self._free_rows.pop(), 0
            if seq.table_len != len(seq.pages):  # mirror pages added since the last step
                self._table[seq.row, seq.table_len : len(seq.pages)] = seq.pages[seq.table_len :]
                seq.table_len = len(seq.pages)
            table_rows.append(seq.row)
            if n == 1:
                if seq.pending:
                    dst.append(num_tokens)
                    src.append(src_of[seq])
                    ids.append(0)
                else:
                    ids.append(seq.tokens[start])
                positions.append(start)
                slots.append(seq.pages[start // PAGE] * PAGE + start % PAGE)
            else:  # a prompt chunk: numpy, not a Python loop over its tokens
                pos = np.arange(start, start + n)
                chunks.append((seq.tokens[start : start + n], pos,
                               np.asarray(seq.pages)[pos // PAGE] * PAGE + pos % PAGE))
            num_tokens += n
            if start + n == len(seq.tokens) + seq.pending:
                sample_idx.append(num_tokens - 1)
                samplers.append(seq)
        dev = self.device
        decode = num_tokens == len(rows)
        n_dec = len(rows) if decode else q_lens.count(1)
        table_RW = self._table[table_rows, : max(len(seq.pages) for seq, _ in rows)]
        pending = (dst, src, prev.tokens) if dst else None
        step = _Launched(rows, samplers, decode)
        shared = None
        if decode and self.shared_prompts:
            # a decode step's tiles stay what they were while the same sequences decode in the same rows (their shared
            # pages are written and registered; a preempted one comes back with other pages): most steps reuse them
            key = tuple((seq.serial, seq.preemptions) for seq, _ in rows)
            if key != self._tiles_key:
                self._tiles_key, self._tiles = key, shared_prefix.tiles(table_RW, ctx_lens, self._tile_k)
            if len(self._tiles[2]):
                shared = self._tiles
                self.timings["shared_prompt_rows"] += int(np.count_nonzero(shared[0]))
        if decode and self.graphs is not None and len(rows) == len(samplers):
            if dst and len(dst) == len(prev.samplers) == num_tokens and dst == src:
                pos_N, slots_N = torch.tensor([positions, slots], dtype=torch.long).to(dev, non_blocking=True)
                ids_N = prev.tokens.long()  # every row decodes the token prev sampled for it, in the same order
            else:
                ids_N, pos_N, slots_N = self._flat_inputs(ids, positions, slots, chunks, pending)
            ctx_R = torch.tensor(ctx_lens, dtype=torch.int32).to(dev, non_blocking=True)
            self.timings["prepare"] += time.perf_counter() - t0
            logits_SV = self.graphs.run(ids_N, pos_N, slots_N, torch.from_numpy(table_RW).to(dev, non_blocking=True),
                                        ctx_R, shared)
        elif not decode and self.mixed is not None and self.mixed.fits(num_tokens, len(rows)):
            bucket = self.mixed.load(self._flat(ids, positions, slots, chunks), table_RW, ctx_lens, q_starts, q_lens,
                                     n_dec, sample_idx)
            self._feed_pending(self.mixed.flat_ids, pending)
            self.timings["prepare"] += time.perf_counter() - t0
            self.timings["mixed_graph_steps"] += 1
            logits_SV = self.mixed.replay(bucket, len(sample_idx))
        else:
            ids_N, pos_N, slots_N = self._flat_inputs(ids, positions, slots, chunks, pending)
            ctx_R = torch.tensor(ctx_lens, dtype=torch.int32).to(dev, non_blocking=True)
            table_RP = torch.from_numpy(table_RW).to(dev, non_blocking=True)
            starts_R = torch.tensor(q_starts, dtype=torch.int32).to(dev, non_blocking=True)
            cascade = None if shared is None else tuple(torch.from_numpy(a).to(dev, non_blocking=True) for a in shared)
            batch = AttnBatch(pos_N, slots_N, table_RP, ctx_R, starts_R, q_lens, q_starts, ctx_lens, decode=decode,
                              decode_rows=0 if decode else n_dec, cascade=cascade)
            sample_S = torch.tensor(sample_idx, dtype=torch.long).to(dev, non_blocking=True)
            self.timings["prepare"] += time.perf_counter() - t0
            logits_SV = self.runner.forward(ids_N, batch, sample_S)
        if samplers:
            step.tokens, logprobs = sample_on_device(logits_SV[:, : self.vocab_size], [s.request.params for s in samplers],
                                                     [s.seed for s in samplers],
                                                     [len(s.tokens) + s.pending for s in samplers])
            step.fetch(logprobs)
        return step

    @staticmethod
    def _flat(ids: list[int], positions: list[int], slots: list[int], chunks: list) -> np.ndarray:
        """[3, N] ids, positions and slots of a step: one-query rows, then prompt chunks."""
        flat = np.array([ids, positions, slots], dtype=np.int64)
        if chunks:
            flat = np.concatenate([flat] + [np.stack([np.asarray(t), p, sl]) for t, p, sl in chunks], axis=1)
        return flat

    def _flat_inputs(self, ids, positions, slots, chunks, pending) -> torch.Tensor:
        """`_flat` on the device (rows 0, 1, 2: ids, positions, slots), pending rows' ids filled in."""
        flat_3N = torch.from_numpy(self._flat(ids, positions, slots, chunks)).to(self.device, non_blocking=True)
        self._feed_pending(flat_3N[0], pending)
        return flat_3N

    def _feed_pending(self, ids_N: torch.Tensor, pending) -> None:
        """ids_N[dst] = tokens[src]: rows that feed a token the step before sampled, still on the device."""
        if pending is not None:
            dst, src, tokens = pending
            dst_src = torch.tensor([dst, src], dtype=torch.long).to(self.device, non_blocking=True)
            ids_N.index_copy_(0, dst_src[0], tokens.long().index_select(0, dst_src[1]))

    def _allocate(self) -> None:
        """The KV pool and (on a GPU) the step graphs that read it: at start-up and on `wake()`."""
        if self.kv_pool is not None:
            return
        s = self.runner.shape
        self.kv_pool = KVPool(s.layers, s.kv_heads, s.head_dim, self.num_pages, self.device, self.kv_dtype)
        self.runner.attach_cache(self.kv_pool.k, self.kv_pool.v)
        self.graphs = self.mixed = None
        if self._cuda_graphs:
            from agentopd.engines.fast.graphs import MIXED_BUCKETS, DecodeGraphs, MixedGraphs

            self.graphs = DecodeGraphs(self.runner, self.max_batch_size, self._pages_per_row, self.shared_prompts)
            # steps of more tokens than the largest bucket run eagerly: the GPU's work dwarfs their launches
            self.mixed = MixedGraphs(self.runner, self.max_batch_size, self._pages_per_row,
                                     min(self.scheduler.token_budget, MIXED_BUCKETS[-1]))

    def _release(self) -> None:
        """`sleep()`: drop every cached page, then the pool and the graphs (captured on its addresses)."""
        if self.kv_pool is None:
            return
        with self._lock:
            self.scheduler.drop_held()
            self.pages.invalidate()
        self.graphs = self.mixed = None
        self.runner.attach_cache([], [])
        self.kv_pool = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _load(self, state_dict: dict[str, Any]) -> None:
        if self._high:  # the weights were written on the caller's stream, and this thread runs on another
            torch.cuda.synchronize(self.device)
        self.runner.load(state_dict)
        with self._lock:
            self.scheduler.drop_held()
            self.pages.invalidate()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
