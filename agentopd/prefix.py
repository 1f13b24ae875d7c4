"""The tokens a batch of streams has in common, run once instead of once per stream.

Episodes of one env start alike: the system prompt and the tool schemas (222 of the default sql_db run's ~310
tokens). The teacher's scoring forward and the student's training forward run that prefix once, keep its
K/V in a transformers cache, repeat it over the batch and run every stream's own tokens after it: the same
causal attention, so the same hidden states up to float rounding, at a fraction of the tokens.

    p = shared_prefix_len(streams)          # common leading tokens, short of each stream's first loss position
    if p >= MIN_SHARED_PREFIX:
        kwargs = run_prefix(decoder, torch.tensor([streams[0].token_ids[:p]]), rows=len(streams))
        hidden = decoder(input_ids=rest_BT, **kwargs).last_hidden_state   # rest_BT: each stream's tokens from p on
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
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
