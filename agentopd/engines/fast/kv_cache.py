"""The paged KV cache: one preallocated pool of pages, refcounts, and a prefix cache over full pages.

    pool = KVPool(runner.shape, num_pages, device, dtype)      # the tensors
    pages = PageAllocator(num_pages)                           # who holds which page
    shared = pages.match(prompt_ids, limit=len(prompt_ids) - 1)  # reuse cached full pages (held)
    fresh = pages.allocate(3)                                  # None when the pool is exhausted
    chain = pages.register(seq_pages, seq_tokens, first=2, upto=5, chain=chain)  # full pages 2..4 join
    pages.release(seq_pages)                                   # refcount -1 each

A page holds PAGE (16) consecutive tokens of one sequence. A *registered* page is full, keyed by
the content of its sequence up to its end (a hash chain over pages) and immutable: it may be held
by many sequences at once. `match` walks the chain and verifies every hit token by token (the
page's own tokens and the identity of its parent page), so a hash collision can never serve
wrong K/V. Pages nobody holds stay in the cache as *idle* pages, reclaimed least recently
released first when `allocate` runs out of free pages. Page 0 is a scratch page that is never
handed out (padding rows of a captured decode graph write there).
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch

from agentopd.engines.fast.attention import FP8, PAGE


Chain = tuple[int, int]  # (hash key, page) of the last settled page of a sequence
ROOT: Chain = (0, -1)


FP8_MAX = 448.0  # its largest finite value: a K/V element beyond it is stored as +-448, not as NaN


def kv_dtype(name: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for `engine.kv_cache_dtype`: "auto" (or None) the model's, "fp8" float8_e4m3fn
    (half the bytes of bf16 a token: a decode step that reads K/V at the memory bound reads half as much; each element
    keeps 3 mantissa bits, scale 1, as vLLM's uncalibrated `kv_cache_dtype=fp8`)."""
    if name in (None, "auto"):
        return model_dtype
    if name == "fp8":
        return FP8
    raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {name!r}")


def to_pool(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V values as the pool stores them (fp8: clamped to its finite range first; a plain cast gives NaN)."""
    if dtype == x.dtype:
        return x
    return x.clamp(-FP8_MAX, FP8_MAX).to(dtype) if dtype == FP8 else x.to(dtype)


def store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache[slots] = x as the pool stores it (`to_pool`); an fp8 pool is written as bytes (CPU torch has no fp8
    index_copy_)."""
    if cache.dtype == FP8:
        cache.view(torch.uint8).index_copy_(0, slots, to_pool(x, FP8).view(torch.uint8))
    else:
        cache.index_copy_(0, slots, to_pool(x, cache.dtype))


class KVPool:
    """K and V tensors of every layer: [slots = pages * PAGE, Hkv, D] each, in the model's dtype or fp8 (`kv_dtype`)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, num_pages: int, device, dtype) -> None:
        self.num_pages = num_pages
        self.kv = torch.zeros(2, layers, num_pages * PAGE, kv_heads, head_dim, device=device, dtype=dtype)
        self.k = list(self.kv[0].unbind(0))
        self.v = list(self.kv[1].unbind(0))

    @staticmethod
    def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class PageAllocator:
    """Refcounted pages, the prefix cache and its LRU of idle pages (see the module docstring)."""

    def __init__(self, num_pages: int) -> None:
        assert num_pages >= 2, num_pages
        self.num_pages = num_pages
        self.ref = [0] * num_pages
        self.free: deque[int] = deque(range(1, num_pages))
        self.idle: OrderedDict[int, None] = OrderedDict()  # registered, refcount 0; oldest first
        self.key_of: dict[int, int] = {}
        self.page_of: dict[int, int] = {}
        self.tokens_of: dict[int, tuple[int, ...]] = {}
        self.parent_of: dict[int, int] = {}  # the page before it in its sequence (-1: first page)

    def available(self) -> int:
        return len(self.free) + len(self.idle)

    def allocate(self, n: int) -> list[int] | None:
        """n private pages (refcount 1), free pages first, then the least recently used idle ones."""
        if n > self.available():
            return None
        out = []
        for _ in range(n):
            if self.free:
                page = self.free.popleft()
            else:
                page, _ = self.idle.popitem(last=False)
                self._unregister(page)
            self.ref[page] = 1
            out.append(page)
        return out

    def hold(self, pages: list[int]) -> None:
        for page in pages:
            if self.ref[page] == 0:
                del self.idle[page]
            self.ref[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each page; last pages first, so a chain's tail is reclaimed before its head."""
        for page in reversed(pages):
            assert self.ref[page] > 0, page
            self.ref[page] -= 1
            if self.ref[page] == 0:
                if page in self.key_of:
                    self.idle[page] = None
                else:
                    self.free.append(page)

    def is_registered(self, page: int) -> bool:
        return page in self.key_of

    def match(self, tokens: list[int], limit: int) -> list[int]:
        """The registered pages holding tokens[:16k] for the largest k with 16k <= limit, held for the caller."""
        pages: list[int] = []
        key, parent = 0, -1
        for i in range(limit // PAGE):
            chunk = tuple(tokens[i * PAGE : (i + 1) * PAGE])
            key = hash((key, chunk))
            page = self.page_of.get(key)
            if page is None or self.tokens_of[page] != chunk or self.parent_of[page] != parent:
                break
            pages.append(page)
            parent = page
        self.hold(pages)
        return pages

    def chain_after(self, pages: list[int]) -> Chain:
        """The chain state after a run of matched (registered) pages."""
        return (self.key_of[pages[-1]], pages[-1]) if pages else ROOT

    def register(self, pages: list[int], tokens: list[int], first: int, upto: int,
                 chain: Chain | None = None) -> Chain | None:
        """Enter full pages pages[first:upto] (holding tokens[16i:16i+16]) into the prefix cache.

        `chain` is the state after pages[:first] as this call returned it last time (None: recompute
        it from page 0). Returns the state after pages[:upto], or None when a hash collision stopped
        the chain (the caller registers no more of this sequence). A page whose content is already
        cached under another page stays private; the chain goes on through the cached one."""
        start = 0 if chain is None else first
        key, parent = ROOT if chain is None else chain
        for i in range(start, upto):
            chunk = tuple(tokens[i * PAGE : (i + 1) * PAGE])
            key = hash((key, chunk))
            page = pages[i]
            if page in self.key_of:
                if self.key_of[page] != key or self.tokens_of[page] != chunk or self.parent_of[page] != parent:
                    return None
            else:
                other = self.page_of.get(key)
                if other is None:
                    if i < first:
                        return None  # an earlier page was never cached: nothing after it can be found
                    self.key_of[page], self.page_of[key] = key, page
                    self.tokens_of[page], self.parent_of[page] = chunk, parent
                elif self.tokens_of[other] != chunk or self.parent_of[other] != parent:
                    return None  # a collision
                else:
                    page = other
            parent = page
        return key, parent

    def invalidate(self) -> None:
        """Forget every cached page's content (new weights): idle pages become free, held ones private."""
        for page in list(self.key_of):
            self._unregister(page)
        self.free.extend(self.idle)
        self.idle.clear()

    def _unregister(self, page: int) -> None:
        key = self.key_of.pop(page)
        if self.page_of.get(key) == page:
            del self.page_of[key]
        del self.tokens_of[page], self.parent_of[page]

    def check(self, holders: list[list[int]]) -> None:
        """Assert the bookkeeping is whole: refcounts equal the holders' references, every page is in
        exactly one of free / idle / held, idle pages are registered, the key maps agree."""
        count = [0] * self.num_pages
        for pages in holders:
            for page in pages:
                count[page] += 1
        assert count == self.ref, "refcounts differ from the holders' references"
        free, idle = set(self.free), set(self.idle)
        held = {p for p in range(self.num_pages) if self.ref[p] > 0}
        assert len(free) == len(self.free) and not free & idle and not free & held and not idle & held
        assert free | idle | held == set(range(1, self.num_pages)) and 0 not in free | idle | held
        assert all(p in self.key_of for p in idle)
        assert all(self.page_of[k] == p for p, k in self.key_of.items())
