"""The tokens a batch of streams has in common, run once instead of once per stream.

Episodes of one env start alike: the system prompt and the tool schemas (222 of the default sql_db run's ~310
tokens). The teacher's scoring forward and the student's training forward run that prefix once, keep its
K/V in a transformers cache, repeat it over the batch and run every stream's own tokens after it: the same
causal attention, so the same hidden states up to float rounding, at a fraction of the tokens.

    p = shared_prefix_len(streams)          # common leading tokens, short of each stream's first loss position
    if p >= MIN_SHARED_PREFIX:
        kwargs = run_prefix(decoder, torch.tensor([streams[0].token_ids[:p]]), rows=len(streams))
        hidden = decoder(input_ids=rest_BT, **kwargs).last_hidden_state   # rest_BT: each stream's tokens from p on

That is the padded layout (sdpa/eager). In a packed row (flash varlen, CUDA) there is no cache to repeat: `pack_row`
puts each family's prefix in the row once, as a segment of its own, and every member's tokens after it in a segment
that attends to the prefix's keys and values as well as its own (`agentopd.attention.varlen_kwargs(..., continues)`);
`packed_items` keeps a family together when a packer splits a batch into rows.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

MIN_SHARED_PREFIX = 16  # a shorter common prefix is recomputed per stream (the extra pass costs more than it saves)


class _Stream(Protocol):  # TokenStream, TrainSample
    token_ids: list[int]
    prompt_len: int


def shared_prefix_len(streams: Sequence[_Stream]) -> int:
    """How many leading tokens every stream has in common, short of the first position whose hidden state a
    stream needs (prompt_len - 1, which predicts its first response token)."""
    common = os.path.commonprefix([s.token_ids for s in streams])  # works on any sequences, not only strings
    return max(0, min(len(common), min(s.prompt_len for s in streams) - 1))


def cache_kwarg(model) -> str:
    """The name under which `model.forward` takes a KV cache: transformers 5.2x renamed `past_key_values` to
    `cache`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def run_prefix(decoder, prefix_ids_1P: torch.Tensor, rows: int) -> dict[str, Any]:
    """Run a shared prefix through `decoder` (a transformers base model) once and repeat its K/V over `rows`. Returns
    the keyword arguments under which the next call of `decoder` (each row's own tokens, at positions from the
    prefix's length on) attends to it. Under autograd the cache keeps the prefix's graph: every row's gradient
    flows back into the one prefix pass."""
    from transformers import DynamicCache

    name = cache_kwarg(decoder)
    kwargs: dict[str, Any] = {name: DynamicCache(config=decoder.config), "use_cache": True}
    positions_1P = torch.arange(prefix_ids_1P.shape[1], device=prefix_ids_1P.device)[None]
    decoder(input_ids=prefix_ids_1P, position_ids=positions_1P, **kwargs)
    kwargs[name].batch_repeat_interleave(rows)
    return kwargs


# ---- packed rows (flash varlen): a family's shared prefix once in the row, every member's own tokens after it ----


def _family_key(s: _Stream) -> list[int]:
    """A stream's first prompt, every token but the one whose hidden state predicts the first response token: what the
    samples of one task share."""
    return s.token_ids[: max(s.prompt_len - 1, 0)]


def families(streams: Sequence[_Stream]) -> list[list[int]]:
    """Indices of the streams of one family (the same `_family_key`), grouped in first-seen order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(streams):
        groups.setdefault(tuple(_family_key(s)), []).append(i)
    return list(groups.values())


def packed_items(streams: Sequence[_Stream], max_tokens: int) -> list[tuple[int, list[int]]]:
    """Units a packer places whole: (tokens computed, stream indices). The members of a family whose shared prefix is
    at least MIN_SHARED_PREFIX long go together, at most `max_tokens` computed tokens per unit (the prefix once, then
    each member's tokens after it); every other stream is a unit of its own."""
    items: list[tuple[int, list[int]]] = []
    for family in families(streams):
        p = shared_prefix_len([streams[i] for i in family]) if len(family) > 1 else 0
        if p < MIN_SHARED_PREFIX:
            items += [(len(streams[i].token_ids), [i]) for i in family]
            continue
        chunks: list[list[int]] = [[]]
        cost = p
        for i in family:
            rest = len(streams[i].token_ids) - p
            if chunks[-1] and cost + rest > max_tokens:
                chunks.append([])
                cost = p
            cost += rest
            chunks[-1].append(i)
        items += [(packed_len([streams[i] for i in chunk]), chunk) for chunk in chunks]  # a lone member: shares nothing
    return items


@dataclass
class PackedRow:
    """One packed row of streams in which each family's shared prefix is computed once.

    The row's tokens (`ids`, `positions`) are split in query segments (`seq_lens`); segment i attends to its own
    tokens causally and, where `continues[i] >= 0`, to all of segment `continues[i]` before them (the family's
    prefix: `agentopd.attention.varlen_kwargs`). Stream j's first `shared[j]` tokens are its family's prefix; its
    token at position t >= shared[j] sits at row index `base[j] + t`."""

    ids: list[int]
    positions: list[int]
    seq_lens: list[int]
    continues: list[int]
    base: list[int]
    shared: list[int]

    def rows(self, j: int, start: int, end: int) -> range:
        """Row indices of stream j's positions start..end-1 (start >= shared[j])."""
        return range(self.base[j] + start, self.base[j] + end)


def _runs(streams: Sequence[_Stream], share: bool):
    """(first, past-the-last, shared length) of each run of consecutive streams of one family that share a prefix of
    at least MIN_SHARED_PREFIX tokens; every other stream is a run of its own with 0."""
    i = 0
    while i < len(streams):
        j = i + 1
        if share:
            key = _family_key(streams[i])
            while j < len(streams) and _family_key(streams[j]) == key:
                j += 1
        p = shared_prefix_len(streams[i:j]) if j - i > 1 else 0
        if p < MIN_SHARED_PREFIX:
            p, j = 0, i + 1
        yield i, j, p
        i = j


def packed_len(streams: Sequence[_Stream], *, share: bool = True) -> int:
    """Tokens `pack_row(streams, share=share)` computes, without building it."""
    return sum(p + sum(len(s.token_ids) - p for s in streams[i:j]) for i, j, p in _runs(streams, share))


def pack_row(streams: Sequence[_Stream], *, share: bool = True) -> PackedRow:
    """`streams` back to back in one row; with `share`, each run of consecutive streams of one family (see
    `packed_items`) has its shared prefix once, as a segment the members' segments continue."""
    row = PackedRow([], [], [], [], [0] * len(streams), [0] * len(streams))
    for i, j, p in _runs(streams, share):
        prefix_segment = -1
        if p:
            prefix_segment = len(row.seq_lens)
            row.ids += streams[i].token_ids[:p]
            row.positions += range(p)
            row.seq_lens.append(p)
            row.continues.append(-1)
        for k in range(i, j):
            s = streams[k]
            row.base[k], row.shared[k] = len(row.ids) - p, p
            row.ids += s.token_ids[p:]
            row.positions += range(p, len(s.token_ids))
            row.seq_lens.append(len(s.token_ids) - p)
            row.continues.append(prefix_segment)
    return row
