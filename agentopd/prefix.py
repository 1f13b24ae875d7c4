"""The tokens a batch of streams has in common, run once instead of once per stream.

Episodes of one env start alike: the system prompt and the tool schemas (222 of the default sql_db run's ~310
tokens). The teacher's scoring forward and the student's training forward run that prefix once, keep its
K/V in a transformers cache, repeat it over the batch and run every stream's own tokens after it: the same
causal attention, so the same hidden states up to float rounding, at a fraction of the tokens.

    p = shared_prefix_len(streams)          # common leading tokens, short of each stream's first loss position
    if p >= MIN_SHARED_PREFIX: ...          # run streams[0].token_ids[:p] once, with cache_kwarg(model)
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import Protocol

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
