"""The fast engine's scheduler: which tokens of which sequences run in the next step.

    sched = Scheduler(PageAllocator(num_pages), max_batch_size=64, token_budget=2048, max_model_len=4096)
    sched.add(seq)
    rows = sched.schedule()            # [(seq, n_new_tokens)], pages reserved for them
    ... queue the model on those tokens, and the sampler for rows whose prompt is done ...
    sched.commit(rows)                 # their K/V is (being) computed; the sampling rows' tokens are pending
    done = sched.finish(samplers, sampled)   # tokens read back: finished sequences (pages held for their episode)

A sequence is its token list (prompt, then sampled tokens) and `num_cached`, how many of those
have K/V in its pages. Each step feeds a row `tokens[num_cached : num_cached + n]`; when that
reaches the end of the list, the row samples the next token. A decode is n = 1; a prompt is fed in
chunks; a preempted sequence is fed again from scratch (recompute) — one mechanism for all three.

Looking ahead: between `commit` and `finish` a sampling row's next token exists only on the device
(`pending`). `schedule(lookahead=True)` plans the next step in that window, so the engine queues it
before reading this one's tokens: a pending row decodes that token (fed from the device), rows whose
prompt is not done go on with it, waiting sequences are admitted. A pending row that the pending token
surely ends (max_tokens, the context limit) is left out; one that a stop token ends is computed once
for nothing and dropped. A plan that would need to preempt is refused (None): the engine reads the
tokens first.

Continuous batching: every step first runs one token of every decoding row, then continues
partly-fed prompts, then admits waiting sequences (FCFS, up to `max_batch_size` running), all
under `token_budget` new tokens (chunked prefill). When pages run out, episodes' held caches are
dropped (oldest first), then the most recently admitted running sequence is preempted (its pages
released, its full pages stay in the prefix cache) and re-queued at the front.

Prefix reuse on admission: a returning turn of an episode (same `episode_id`) keeps the pages of
its previous request up to the longest common prefix of the old and new token lists (the
previous output's last token and everything new are fed); any other request reuses the longest
chain of cached full pages of its prompt. At least one prompt token is always fed (its logits
are needed). A page is written only while it is private: cached full pages are immutable.
Requests that arrive together with the same prompt start (episodes sharing a system prompt) are
admitted one per distinct first uncached page a step: the others wait one step and find those
pages cached, so the shared prefix is computed once and its pages are shared (one copy in the
pool, read mostly from the GPU's L2 cache by a decode step's rows).
"""

from __future__ import annotations

import itertools

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from agentopd.engines.base import FinishReason, GenerateRequest
from agentopd.engines.fast.attention import PAGE
from agentopd.engines.fast.kv_cache import PageAllocator


_serials = itertools.count()


@dataclass(eq=False)
class Seq:
    """One request from admission to its result."""

    request: GenerateRequest
    seed: int
    tokens: list[int]
    future: Any = None  # asyncio.Future of the caller (the engine resolves it)
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in `pages`
    pending: bool = False  # a sampled token is on the device, not yet in `tokens` (between commit and finish)
    num_settled: int = 0  # leading full pages already offered to the prefix cache
    chain: tuple[int, int] | None = None  # prefix-cache chain state after them (None: recompute)
    registering: bool = True  # False after a hash collision: this sequence caches no more pages
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    cancelled: bool = False
    attached: bool = False  # prefix reuse decided (first admission)
    prefix_hit: int = 0
    preemptions: int = 0
    row: int = -1  # the engine's page-table row while it has one (engine.py)
    table_len: int = 0  # how many of `pages` that row mirrors; reset whenever `pages` is replaced
    serial: int = field(default_factory=_serials.__next__)  # unique in the process (the engine's shared-prompt tiles)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    def __init__(self, pages: PageAllocator, max_batch_size: int, token_budget: int, max_model_len: int) -> None:
        self.pages = pages
        self.max_batch_size = max_batch_size
        self.token_budget = token_budget
        self.max_model_len = max_model_len
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.held: OrderedDict[str, Seq] = OrderedDict()  # episode id -> its last finished request
        self.preemptions = 0  # every preemption so far (a sequence recomputed because the pool ran out of pages)

    # ---- queue ----------------------------------------------------------------------------

    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    def has_work(self, admit: bool = True) -> bool:
        return bool(self.running) or (admit and bool(self.waiting))

    def release_episode(self, episode_id: str) -> None:
        seq = self.held.pop(episode_id, None)
        if seq is not None:
            self.pages.release(seq.pages)
            seq.pages = []

    def drop_held(self) -> None:
        for eid in list(self.held):
            self.release_episode(eid)

    def drop_cancelled(self) -> list[Seq]:
        """Remove cancelled sequences (their pages freed); returned so the engine can finish them."""
        gone = [s for s in self.running if s.cancelled] + [s for s in self.waiting if s.cancelled]
        if gone:
            self.running = [s for s in self.running if not s.cancelled]
            self.waiting = deque(s for s in self.waiting if not s.cancelled)
            for s in gone:
                self.pages.release(s.pages)
                s.pages = []
                s.finish = FinishReason.ABORT
        return gone

    def holders(self) -> list[list[int]]:
        """Every page list holding references (for PageAllocator.check)."""
        return [s.pages for s in self.running] + [s.pages for s in self.waiting] + [s.pages for s in self.held.values()]

    # ---- one step -------------------------------------------------------------------------

    def schedule(self, admit: bool = True, lookahead: bool = False) -> list[tuple[Seq, int]] | None:
        """The next step's rows (see the module docstring); None when `lookahead` would need to preempt."""
        rows: dict[Seq, int] = {}
        budget = self.token_budget
        self._preempted: set[Seq] = set()
        for decoding in (True, False):
            for seq in list(self.running):
                todo = len(seq.tokens) + seq.pending - seq.num_cached
                if (todo == 1) != decoding or seq in rows or seq in self._preempted:
                    continue
                if seq.pending and (len(seq.out_ids) + 1 >= seq.request.params.max_tokens
                                    or len(seq.tokens) + 1 >= self.max_model_len):
                    continue  # the pending token ends it
                n = min(todo, budget)
                if n <= 0:
                    continue
                if lookahead and not self._reserve(seq, seq.num_cached + n):
                    return None
                if lookahead or self._reserve_or_preempt(seq, seq.num_cached + n, rows):
                    rows[seq] = n
                    budget -= n
        budget = self.token_budget - sum(rows.values())
        claimed: set = set()  # the first new full page of each sequence admitted below (its chain and tokens)
        deferred: list[Seq] = []
        while admit and self.waiting and len(self.running) < self.max_batch_size and budget > 0:
            seq = self.waiting[0]
            if not seq.attached:
                self._attach(seq)
            page = self._first_new_page(seq)
            if page is not None and page in claimed:  # computed by a row of this step: cached for it at the next
                self._detach(self.waiting.popleft())
                deferred.append(seq)
                continue
            n = min(len(seq.tokens) - seq.num_cached, budget)
            if not self._reserve(seq, seq.num_cached + n):
                if not self.running:
                    raise RuntimeError(f"the KV page pool ({self.pages.num_pages} pages of {PAGE}) cannot hold "
                                       f"one sequence of {seq.num_cached + n} tokens: give the engine more pages")
                break
            self.waiting.popleft()
            self.running.append(seq)
            rows[seq] = n
            budget -= n
            if page is not None and n >= PAGE:
                claimed.add(page)
        self.waiting.extendleft(reversed(deferred))
        return list(rows.items())

    def _first_new_page(self, seq: Seq):
        """What identifies the first full page a newly attached prompt would compute (None: it continues an episode,
        or has no full page left to compute). Two sequences with the same identity would write the same K/V."""
        if seq.chain is None or seq.num_cached % PAGE or seq.num_cached + PAGE > len(seq.tokens) - 1:
            return None
        return seq.chain, tuple(seq.tokens[seq.num_cached : seq.num_cached + PAGE])

    def commit(self, rows: list[tuple[Seq, int]]) -> None:
        """Account a queued step (its tokens' K/V counted as cached; the device computes it before any later
        step reads it): full pages offered to the prefix cache; rows that sample hold a pending token. Rows
        that finished meanwhile (a step queued ahead of their last token) are skipped."""
        for seq, n in rows:
            if seq.finish is not None:
                continue
            samples = seq.num_cached + n == len(seq.tokens) + seq.pending
            seq.num_cached += n
            full = seq.num_cached // PAGE
            if full > seq.num_settled:
                if seq.registering:
                    seq.chain = self.pages.register(seq.pages, seq.tokens, seq.num_settled, full, seq.chain)
                    seq.registering = seq.chain is not None
                seq.num_settled = full
            seq.pending = samples

    def finish(self, samplers: list[Seq], sampled: dict[Seq, tuple[int, float]]) -> list[Seq]:
        """Append the tokens a step sampled; returns the sequences that finished (their pages held for their
        episode). Sequences that finished or were dropped since the step was queued are skipped."""
        done = []
        for seq in samplers:
            if seq not in sampled or seq.finish is not None:
                continue
            seq.pending = False
            tok, lp = sampled[seq]
            seq.tokens.append(tok)
            seq.out_ids.append(tok)
            seq.out_logprobs.append(lp)
            p = seq.request.params
            if tok in p.stop_token_ids:
                seq.finish = FinishReason.STOP
            elif len(seq.out_ids) >= p.max_tokens or len(seq.tokens) >= self.max_model_len:
                seq.finish = FinishReason.LENGTH
            if seq.finish is not None:
                self.running.remove(seq)
                self._hold(seq)
                done.append(seq)
        return done

    # ---- pages ----------------------------------------------------------------------------

    def _attach(self, seq: Seq) -> None:
        """Decide prefix reuse for a sequence's first admission."""
        seq.attached = True
        seq.table_len = 0
        limit = len(seq.tokens) - 1
        eid = seq.request.episode_id
        prev = self.held.pop(eid, None) if eid else None
        if prev is not None:
            keep_len = min(common_prefix(prev.tokens[: prev.num_cached], seq.tokens), limit)
            keep = -(-keep_len // PAGE)
            if keep_len % PAGE and self.pages.is_registered(prev.pages[keep - 1]):
                keep -= 1  # the match ends inside an immutable page: recompute that page
                keep_len = keep * PAGE
            seq.pages = prev.pages[:keep]
            self.pages.release(prev.pages[keep:])
            seq.num_cached = keep_len
            seq.num_settled = keep_len // PAGE
            seq.chain = None
        else:
            seq.pages = self.pages.match(seq.tokens, limit)
            seq.num_cached = len(seq.pages) * PAGE
            seq.num_settled = len(seq.pages)
            seq.chain = self.pages.chain_after(seq.pages)
        seq.prefix_hit = seq.num_cached

    def _hold(self, seq: Seq) -> None:
        eid = seq.request.episode_id
        if eid and not seq.cancelled:
            self.release_episode(eid)
            self.held[eid] = seq
        else:
            self.pages.release(seq.pages)
            seq.pages = []

    def _reserve(self, seq: Seq, upto: int) -> bool:
        """Pages for tokens [0, upto) of seq, dropping held episode caches (oldest first) if needed, then the pages
        of waiting sequences behind it (attached at an earlier step, not yet admitted: they attach again)."""
        need = -(-upto // PAGE) - len(seq.pages)
        while need > self.pages.available() and self.held:
            self.release_episode(next(iter(self.held)))
        if need > self.pages.available():  # (rare: the queue is not walked on every reserve of a step)
            for waiting in reversed(self.waiting):
                if need <= self.pages.available():
                    break
                if waiting is not seq and waiting.pages:
                    self._detach(waiting)
        if need <= 0:
            return True
        fresh = self.pages.allocate(need)
        if fresh is None:
            return False
        seq.pages.extend(fresh)
        return True

    def _reserve_or_preempt(self, seq: Seq, upto: int, rows: dict[Seq, int]) -> bool:
        while not self._reserve(seq, upto):
            victim = self.running[-1]
            self._preempt(victim)
            rows.pop(victim, None)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Seq) -> None:
        """Free a running sequence's pages and queue it first; it is recomputed from its token list."""
        self.running.remove(seq)
        self._preempted.add(seq)
        self._detach(seq)
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _detach(self, seq: Seq) -> None:
        """Release a sequence's pages; at its next admission it reuses what the prefix cache still holds."""
        self.pages.release(seq.pages)
        seq.pages = []
        seq.table_len = 0
        seq.num_cached = seq.num_settled = 0
        seq.chain, seq.registering = None, True
        seq.attached = False
