"""Varlen attention for packed rows: sequences back to back in one row, no padding, no dense mask.

    from agentopd import attention
    if attention.available(device):
        with attention.use_varlen(model):                    # the model's attention -> varlen
            hidden = model.model(input_ids=ids_1T, position_ids=pos_1T, use_cache=False,
                                 **attention.varlen_kwargs(seq_lens, device)).last_hidden_state

transformers builds a block-diagonal mask for packed rows under sdpa/eager (B x T^2, and the
kernel still computes every masked block); flash-attention varlen takes `cu_seqlens` instead and
computes each sequence's causal triangle only. This registers torch's own flash varlen kernel
(`torch.nn.attention.varlen.varlen_attn`, CUDA, bf16/fp16) as a transformers attention function
named "agentopd_varlen": transformers then builds no mask for it, and the cumulative lengths reach
every attention call as keyword arguments (the FlashAttentionKwargs names). Shared compute, like
agentopd.prefix: the trainer (one packed row per micro-batch) and HFTeacher (packed scoring) use it
on CUDA, so it lives below both.

Legend: T = tokens of the packed row, H = heads, D = head dim.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager

import torch

VARLEN = "agentopd_varlen"
KEY_INDEX = "agentopd_key_index"  # keyword argument: the row positions each segment's keys come from (varlen_kwargs)


@functools.cache
def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def available(device: torch.device | str) -> bool:
    """CUDA and a torch with `torch.nn.attention.varlen`."""
    return torch.device(device).type == "cuda" and _varlen_fn() is not None


# set by register(), read as plain globals inside compiled layers (no functools.cache under dynamo)
_CAUSAL: dict = {}
_HAS_SCALE = False
_VARLEN_ATTN = None


def _call_kwargs(scaling: float | None, head_dim: int) -> dict:
    """Causal (torch 2.9-2.10 take is_causal, later ones a (-1, 0) window) and the softmax scale."""
    if _HAS_SCALE:
        return {**_CAUSAL, "scale": scaling}
    if scaling is not None and abs(scaling - head_dim**-0.5) > 1e-6:
        raise ValueError(f"this torch's varlen_attn has no scale argument; the model wants {scaling}")
    return _CAUSAL


def _varlen_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers attention function: query (1, H, T, D), key/value (1, H_kv, T, D) -> (1, T, H, D)."""
    assert query.shape[0] == 1, f"varlen attention takes one packed row, got {query.shape[0]}"
    assert dropout == 0.0, "varlen attention runs without dropout"
    cu = kwargs["cu_seq_lens_q"]
    longest = kwargs["max_length_q"]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, H, D)
    keys = kwargs.get(KEY_INDEX)
    if keys is not None:  # segments that continue a shared prefix: each one's keys are the prefix's, then its own
        k, v = k.index_select(0, keys), v.index_select(0, keys)
    if q.dtype not in (torch.bfloat16, torch.float16):  # fp32 weights under autocast: RoPE left q, k in fp32
        dt = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else torch.bfloat16
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if k.shape[1] != q.shape[1]:  # GQA: the kernel wants as many K/V heads as Q heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    cu_k = kwargs.get("cu_seq_lens_k", cu)
    out = _VARLEN_ATTN(q, k, v, cu, cu_k, longest, kwargs.get("max_length_k", longest), **_call_kwargs(scaling, q.shape[-1]))
    return out[None], None


@functools.cache
def register() -> None:
    from transformers import AttentionInterface

    global _CAUSAL, _HAS_SCALE, _VARLEN_ATTN
    _VARLEN_ATTN = _varlen_fn()
    params = inspect.signature(_VARLEN_ATTN).parameters
    _CAUSAL = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    _HAS_SCALE = "scale" in params
    AttentionInterface.register(VARLEN, _varlen_forward)


def _cumulative(lens: list[int], device) -> torch.Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    return cu.to(device, non_blocking=True)


def varlen_kwargs(seq_lens: list[int], device: torch.device | str, continues: list[int] | None = None) -> dict:
    """The keyword arguments a packed row's forward passes down to the attention calls: one causal sequence per
    entry of `seq_lens`. With `continues` (`agentopd.prefix.pack_row`), segment i whose `continues[i]` is j >= 0
    attends to all of segment j (a shared prefix, itself continuing none) before its own tokens: its keys are
    gathered as [segment j, segment i] (KEY_INDEX) and the kernel's causal mask, aligned to the keys' end as flash
    attention aligns it when a sequence has more keys than queries, lets query t see the prefix and its own 0..t."""
    cu = _cumulative(seq_lens, device)
    longest = max(seq_lens)
    out = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    if continues is None or all(c < 0 for c in continues):
        return out
    if len(continues) != len(seq_lens):
        raise ValueError(f"continues has {len(continues)} entries for {len(seq_lens)} segments")
    starts = [0]
    for n in seq_lens[:-1]:
        starts.append(starts[-1] + n)
    keys, key_lens = [], []
    for i, (start, n, c) in enumerate(zip(starts, seq_lens, continues)):
        if c >= 0:
            if c >= i or continues[c] >= 0:
                raise ValueError(f"segment {i} continues segment {c}, which must come before it and continue none")
            keys.append(torch.arange(starts[c], starts[c] + seq_lens[c]))
        keys.append(torch.arange(start, start + n))
        key_lens.append(n + (seq_lens[c] if c >= 0 else 0))
    out |= {"cu_seq_lens_k": _cumulative(key_lens, device), "max_length_k": max(key_lens),
            KEY_INDEX: torch.cat(keys).to(device, non_blocking=True)}  # fmt: skip
    return out


def set_varlen(model) -> str:
    """Switch `model` (a transformers model) to varlen attention; returns the previous implementation."""
    register()
    return set_implementation(model, VARLEN)


def set_implementation(model, name: str) -> str:
    """Set `model`'s attention implementation (a name transformers knows); returns the previous one."""
    previous = model.config._attn_implementation
    for module in model.modules():  # sub-configs (text_config, ...) share the setting
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name
    return previous


@contextmanager
def using(model, name: str):
    """`model` with the attention implementation `name` inside the block, its own after."""
    previous = set_implementation(model, name)
    try:
        yield
    finally:
        set_implementation(model, previous)


@contextmanager
def use_varlen(model):
    register()
    with using(model, VARLEN):
        yield
