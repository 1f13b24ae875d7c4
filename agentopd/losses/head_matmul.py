"""Vocabulary-head GEMMs over the head's rows padded to a multiple of `ALIGN`, where the head has them.

A run normalises over the tokenizer's ids, the first V rows of the lm_head (`kinds.sampled_vocab`). For real
vocabularies V is odd (Qwen3: 151,669 ids of 151,936 rows), and GEMMs with V as a dimension fall back to cuBLAS's
legacy `align1` kernels: the logits (M = V), the hidden states' gradient (K = V) and the head's gradient (measured on
an H200 by benchmarks/head_gemm_align.py; issue 52's profile: a third of the real-size train phase). The head is
almost always the first V rows of a weight with more rows (the embedding's padding): `widened_rows` reads the first
V' = V rounded up to ALIGN of them from the same storage (no copy), the GEMMs run at V', and callers use the first V
columns of the logits (a strided view: the Triton divergence kernel, log_softmax, gather and topk read strides) and
zero the padding columns of a gradient before it meets the head again.

    wide_VH = widened_rows(head_VH)          # (V', H) view of the same storage, or None where it cannot be
    logits_CV = (h_CH @ wide_VH.T)[:, :V]    # the same values as h_CH @ head_VH.T
"""

from __future__ import annotations

import torch
from torch import Tensor

ALIGN = 64  # rows: 128 B of bf16, a multiple of every tile the sm90 kernels ask of M, N and K
DEVICES = frozenset({"cuda"})  # where widening pays (elsewhere the GEMMs do not care; tests add "cpu")


def padded_cols(v: int, align: int = ALIGN) -> int:
    return -(-v // align) * align


def widened_rows(head_VH: Tensor) -> Tensor | None:
    """head_VH (V x H) with the rows that follow it in its storage up to V' = padded_cols(V), as a (V', H) view
    (detached); head_VH itself where V is already aligned; None where the storage ends before V', the rows are
    not contiguous, or the device gains nothing. The extra rows are other vocabulary rows of the same weight
    (never sampled): their logits are computed and ignored, and they must be finite where a gradient with zeros
    in those columns is multiplied by them (`finite_rows`)."""
    if head_VH.device.type not in DEVICES:
        return None
    return _widen(head_VH)


def _widen(head_VH: Tensor) -> Tensor | None:
    if head_VH.dim() != 2:
        return None
    v, h = head_VH.shape
    vp = padded_cols(v)
    if vp == v:
        return head_VH.detach()
    if not head_VH.is_contiguous():
        return None
    if (head_VH.storage_offset() + vp * h) * head_VH.element_size() > head_VH.untyped_storage().nbytes():
        return None
    return head_VH.detach().as_strided((vp, h), (h, 1))


def gemm_rows(head_VH: Tensor) -> Tensor:
    """The rows a head GEMM runs on: `widened_rows` where it widens the head, else the head itself."""
    wide = widened_rows(head_VH)
    return head_VH if wide is None or wide.shape[0] == head_VH.shape[0] else wide


def finite_rows(wide_VH: Tensor, v: int) -> bool:
    """Whether rows v.. of a widened head are finite (0 * inf is nan in a GEMM). Waits for the device once."""
    return wide_VH.shape[0] == v or bool(torch.isfinite(wide_VH[v:]).all())


def upload_widened(head_VH: Tensor, device: torch.device | str) -> Tensor:
    """`head_VH.to(device)` whose new storage holds the widened rows too where head_VH's does (a teacher's head sent
    to the host and on to the trainer keeps its padding rows, so the trainer's GEMMs can widen it): V' - V rows
    more copied, at most ALIGN - 1."""
    device = torch.device(device)
    if head_VH.device.type == device.type and device.index in (None, head_VH.device.index):
        return head_VH
    wide = _widen(head_VH)
    if wide is None:
        return head_VH.to(device)
    return wide.to(device, non_blocking=head_VH.is_pinned() and device.type == "cuda")[: head_VH.shape[0]]
