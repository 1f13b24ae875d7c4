"""Chunked losses from hidden states: the N x V logits never exist for the whole batch,
in the forward or in the backward.

    loss = chunked_divergence(h_NH, model.lm_head.weight, teacher_hidden_NH=th_NH,
                              teacher_head_VH=teacher_head, kind="jsd", beta=0.5,
                              weights_N=w_N, chunk_size=1024)   # a SUM over tokens
    (loss / global_student_tokens).backward()

How: `_ChunkedHeadLoss`, a `torch.autograd.Function`, loops over token chunks of C rows.
Its forward computes the student logits of a chunk (h_C @ W^T + b), the teacher logits of
the same chunk (from the teacher's hidden states and lm_head, or from precomputed logits),
the per-token loss, and keeps only the running sum; it saves the *inputs* only (hidden,
head, bias; the teacher tensors are inputs too). Its backward recomputes each chunk's
logits, gets d loss / d logits_CV (closed form for the three divergences, a chunk-local
autograd pass otherwise) and accumulates
    grad_h[chunk] = g_CV @ W,   grad_W += g_CV^T @ h_C,   grad_b += sum_c g_CV
so the peak extra memory is O(C x V + V x H), independent of N. (`grad_in_forward=True` does
the same sweep once, in forward, and keeps grad_h / grad_W for backward instead of the
inputs: no recompute, still never N x V.) Accumulation is in fp32
(fp64 for fp64 inputs) even when hidden states and heads are bf16; the matmuls run in the
inputs' dtype. Costs one extra pair of logit matmuls per chunk (the recompute).

On CUDA, `chunked_divergence` takes the fused Triton path of `fused.py` by default (same values
and gradients, no fp32 logits copies, gradients in forward); this module's torch path is the
exact reference, the CPU default, and the path of support_k, top-k and coverage.

Legend: N tokens, C chunk tokens, H student hidden, H_t teacher hidden, V vocab, K top-k.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from agentopd.losses import fused as fused_mod
from agentopd.losses.divergence import (
    Divergence,
    acc_dtype,
    check_temperature,
    divergence_and_grad,
    resolve_kind,
)
from agentopd.losses.head_matmul import gemm_rows
from agentopd.losses.topk import (
    _check_topk,
    coverage_per_token,
    support_union_topk,
    topk_forward_kl_per_token,
)

# (logits_CV in the accumulation dtype, token slice, need_grad) -> (weighted loss_C, d sum / d logits_CV)
ChunkFn = Callable[[Tensor, slice, bool], tuple[Tensor, Tensor | None]]


def _chunks(n: int, chunk_size: int) -> list[slice]:
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    return [slice(i, min(i + chunk_size, n)) for i in range(0, n, chunk_size)]


def _logits(hidden_CH: Tensor, head_VH: Tensor, bias_V: Tensor | None, dt: torch.dtype) -> Tensor:
    return F.linear(hidden_CH, head_VH, bias_V).to(dt)


def _sweep(hidden_NH, head_VH, bias_V, chunk_fn: ChunkFn, chunk_size: int, needs, grad_scale=None):
    """One pass over the chunks: the loss sum and, for the inputs in `needs`, its gradients
    (times `grad_scale`), accumulated in the accumulation dtype and returned in the inputs' dtypes."""
    dt = acc_dtype(hidden_NH.dtype)
    need_h, need_w, need_b = needs
    any_grad = need_h or need_w or need_b
    total = torch.zeros((), dtype=dt, device=hidden_NH.device)
    grad_h = torch.zeros_like(hidden_NH) if need_h else None
    grad_w = torch.zeros(head_VH.shape, dtype=dt, device=head_VH.device) if need_w else None
    grad_b = torch.zeros(head_VH.shape[0], dtype=dt, device=head_VH.device) if need_b else None
    for sl in _chunks(hidden_NH.shape[0], chunk_size):
        loss_C, g_CV = chunk_fn(_logits(hidden_NH[sl], head_VH, bias_V, dt), sl, any_grad)
        total += loss_C.sum()
        if not any_grad:
            continue
        assert g_CV is not None and g_CV.dtype == dt
        if grad_scale is not None:
            g_CV = g_CV.mul_(grad_scale.to(dt))
        if grad_b is not None:
            grad_b += g_CV.sum(0)
        g_CV = g_CV.to(head_VH.dtype)
        if grad_h is not None:
            grad_h[sl] = g_CV @ head_VH
        if grad_w is not None:
            if g_CV.dtype == dt:
                grad_w.addmm_(g_CV.T, hidden_NH[sl])
            else:  # bf16 product per chunk, accumulated in fp32 (no fp32 copy of it)
                grad_w += g_CV.T @ hidden_NH[sl]
    grad_w = grad_w.to(head_VH.dtype) if grad_w is not None else None
    grad_b = grad_b.to(bias_V.dtype) if grad_b is not None else None
    return total, grad_h, grad_w, grad_b


class _ChunkedHeadLoss(torch.autograd.Function):
    """sum over chunks of chunk_fn(hidden_C @ head^T + bias); see the module docstring.

    Default: forward saves the inputs only and backward recomputes every chunk. With
    grad_in_forward, forward computes the gradients in the same pass and saves those instead
    (N x H + V x H, never N x V): no recompute, more memory held until backward.
    """

    @staticmethod
    def forward(ctx, hidden_NH, head_VH, bias_V, chunk_fn: ChunkFn, chunk_size: int, grad_in_forward: bool):
        needs = tuple(ctx.needs_input_grad[:3])
        ctx.fused = grad_in_forward and any(needs)
        if ctx.fused:
            total, *grads = _sweep(hidden_NH, head_VH, bias_V, chunk_fn, chunk_size, needs)
            ctx.save_for_backward(*grads)
        else:
            total = _sweep(hidden_NH, head_VH, bias_V, chunk_fn, chunk_size, (False, False, False))[0]
            ctx.save_for_backward(hidden_NH, head_VH, bias_V)
            ctx.chunk_fn, ctx.chunk_size = chunk_fn, chunk_size
        return total

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.fused:
            grads = [g * grad_out.to(g.dtype) if g is not None else None for g in ctx.saved_tensors]
        else:
            hidden_NH, head_VH, bias_V = ctx.saved_tensors
            _, *grads = _sweep(hidden_NH, head_VH, bias_V, ctx.chunk_fn, ctx.chunk_size,
                               tuple(ctx.needs_input_grad[:3]), grad_scale=grad_out)
        return (*grads, None, None, None)


def chunked_head_loss(
    student_hidden_NH: Tensor,
    student_head_VH: Tensor,
    chunk_fn: ChunkFn,
    *,
    chunk_size: int = 1024,
    student_head_bias_V: Tensor | None = None,
    grad_in_forward: bool = False,
) -> Tensor:
    """Generic entry point: SUM over chunks of `chunk_fn` applied to the student logits."""
    if student_hidden_NH.dim() != 2 or student_head_VH.dim() != 2:
        raise ValueError(
            f"student_hidden {tuple(student_hidden_NH.shape)} must be (N, H) and student_head "
            f"{tuple(student_head_VH.shape)} must be (V, H)"
        )
    if student_hidden_NH.shape[1] != student_head_VH.shape[1]:
        raise ValueError(
            f"student_hidden H={student_hidden_NH.shape[1]} != student_head H={student_head_VH.shape[1]}"
        )
    return _ChunkedHeadLoss.apply(
        student_hidden_NH, student_head_VH, student_head_bias_V, chunk_fn, chunk_size, grad_in_forward
    )


@torch.no_grad()
def chunked_head_per_token(
    student_hidden_NH: Tensor,
    student_head_VH: Tensor,
    chunk_fn: ChunkFn,
    *,
    chunk_size: int = 1024,
    student_head_bias_V: Tensor | None = None,
) -> Tensor:
    """The per-token values (loss_N, no grad) of `chunk_fn`, chunk by chunk."""
    dt = acc_dtype(student_hidden_NH.dtype)
    parts = [
        chunk_fn(_logits(student_hidden_NH[sl], student_head_VH, student_head_bias_V, dt), sl, False)[0]
        for sl in _chunks(student_hidden_NH.shape[0], chunk_size)
    ]
    return torch.cat(parts) if parts else student_hidden_NH.new_zeros(0, dtype=dt)


@dataclass(frozen=True)
class _TeacherSource:
    """Teacher logits for a chunk: from hidden states + lm_head (no grad) or precomputed logits."""

    hidden_NH: Tensor | None
    head_VH: Tensor | None
    logits_NV: Tensor | None

    @classmethod
    def build(cls, n: int, v: int, hidden_NH, head_VH, logits_NV) -> _TeacherSource:
        if (logits_NV is None) == (hidden_NH is None or head_VH is None):
            raise ValueError(
                "give the teacher either as teacher_hidden_NH + teacher_head_VH or as "
                "teacher_logits_NV (exactly one of the two)"
            )
        if logits_NV is not None and tuple(logits_NV.shape) != (n, v):
            raise ValueError(f"teacher_logits {tuple(logits_NV.shape)} must be (N={n}, V={v})")
        if logits_NV is None:
            if hidden_NH.shape[0] != n or head_VH.shape[0] != v or hidden_NH.shape[1] != head_VH.shape[1]:
                raise ValueError(
                    f"teacher_hidden {tuple(hidden_NH.shape)} / teacher_head {tuple(head_VH.shape)} "
                    f"must be (N={n}, H_t) / (V={v}, H_t)"
                )
        return cls(hidden_NH, head_VH, logits_NV)

    @torch.no_grad()
    def raw(self, sl: slice) -> Tensor:
        """The chunk's teacher logits in the teacher's dtype (read-only; a view of teacher_logits_NV)."""
        if self.logits_NV is not None:
            return self.logits_NV[sl].detach().contiguous()
        # over aligned rows where the head has them (head_matmul): the first V columns are the logits
        return F.linear(self.hidden_NH[sl].detach(), gemm_rows(self.head_VH).detach())[:, : self.head_VH.shape[0]]

    @torch.no_grad()
    def logits(self, sl: slice, dt: torch.dtype) -> Tensor:
        if self.logits_NV is not None:
            return self.logits_NV[sl].to(dt, copy=True)  # callers scale it in place
        return F.linear(self.hidden_NH[sl].detach(), self.head_VH.detach()).to(dt)


def _weighted(loss_C: Tensor, g_CV: Tensor | None, weights_N: Tensor | None, sl: slice):
    if weights_N is None:
        return loss_C, g_CV
    w_C = weights_N[sl].to(loss_C.dtype)
    return loss_C * w_C, (g_CV.mul_(w_C[:, None]) if g_CV is not None else None)


def _autograd_chunk_fn(per_token: Callable[[Tensor, slice], Tensor], weights_N: Tensor | None) -> ChunkFn:
    """A ChunkFn whose gradient comes from a chunk-local autograd pass over `per_token`."""

    def fn(z_CV: Tensor, sl: slice, need_grad: bool):
        if not need_grad:
            with torch.no_grad():
                return _weighted(per_token(z_CV, sl), None, weights_N, sl)
        with torch.enable_grad():
            z_CV = z_CV.detach().requires_grad_(True)
            loss_C, _ = _weighted(per_token(z_CV, sl), None, weights_N, sl)
            (g_CV,) = torch.autograd.grad(loss_C.sum(), z_CV)
        return loss_C.detach(), g_CV

    return fn


@functools.cache
def _compiled_divergence_and_grad():
    return torch.compile(divergence_and_grad, dynamic=False)


def _divergence_chunk_fn(
    teacher: _TeacherSource,
    kind: Divergence | str,
    beta: float,
    temperature: float,
    weights_N: Tensor | None,
    support_k: int | None,
    compiled: bool = False,
) -> ChunkFn:
    kind = resolve_kind(kind, beta)
    math_fn = _compiled_divergence_and_grad() if compiled else divergence_and_grad
    check_temperature(temperature)
    if support_k is not None:
        return _autograd_chunk_fn(
            lambda z, sl: support_union_topk(
                z, teacher.logits(sl, z.dtype), k=support_k, kind=kind, beta=beta, temperature=temperature
            ),
            weights_N,
        )

    def fn(z_CV: Tensor, sl: slice, need_grad: bool):
        div_C, g_CV = math_fn(  # consumes both fresh logits buffers
            z_CV.div_(temperature), teacher.logits(sl, z_CV.dtype).div_(temperature), kind, beta, need_grad
        )
        if g_CV is not None:
            g_CV = g_CV.div_(temperature)
        return _weighted(div_C, g_CV, weights_N, sl)

    return fn


def _check_weights(weights_N: Tensor | None, n: int) -> None:
    if weights_N is not None and tuple(weights_N.shape) != (n,):
        raise ValueError(f"weights {tuple(weights_N.shape)} must be (N={n},)")


def _divergence_args(student_hidden_NH, student_head_VH, teacher_hidden_NH, teacher_head_VH,
                     teacher_logits_NV, kind, beta, temperature, weights_N, support_k, compiled=False) -> ChunkFn:
    n, v = student_hidden_NH.shape[0], student_head_VH.shape[0]
    _check_weights(weights_N, n)
    teacher = _TeacherSource.build(n, v, teacher_hidden_NH, teacher_head_VH, teacher_logits_NV)
    return _divergence_chunk_fn(teacher, kind, beta, temperature, weights_N, support_k, compiled)


def chunked_divergence(
    student_hidden_NH: Tensor,
    student_head_VH: Tensor,
    *,
    teacher_hidden_NH: Tensor | None = None,
    teacher_head_VH: Tensor | None = None,
    teacher_logits_NV: Tensor | None = None,
    kind: Divergence | str,
    beta: float = 0.5,
    temperature: float = 1.0,
    weights_N: Tensor | None = None,
    chunk_size: int = 1024,
    student_head_bias_V: Tensor | None = None,
    support_k: int | None = None,
    grad_in_forward: bool = False,
    compiled: bool = False,
    fused: bool | None = None,
) -> Tensor:
    """sum_n weights_n * div_n, chunked over tokens, bounded memory in forward and backward.

    Equals `divergence(h @ W^T + b, teacher_logits, kind, beta, temperature)` weighted and
    summed. `support_k` switches to support-symmetric truncation on the union of the
    teacher's and the student's top-k (see `topk.support_union_topk`). Gradients flow to
    the student hidden states, head and bias, never to the teacher.

    Speed options (same values and gradients, tested): `grad_in_forward` computes the
    gradients during the forward pass and keeps them (N x H + V x H) for backward instead of
    recomputing every chunk's logits (saves the recompute matmuls, ~1.6x faster on GPU);
    `compiled` runs the per-chunk softmax/divergence math through `torch.compile` (fuses the
    ~15 elementwise passes over each C x V chunk; meant for CUDA).

    `fused` (default None = wherever it runs: CUDA with Triton, bf16/fp16/fp32 inputs, no
    support_k, neither torch option above asked for) takes the Triton path of `fused.py`: one
    kernel per chunk computes the loss and writes the logits' gradient over the student logits,
    gradients in forward, no fp32 copies of the logits. False forces the torch path (the exact
    reference; the CPU default).
    """
    if _use_fused(fused, student_hidden_NH, student_head_VH, teacher_hidden_NH, teacher_logits_NV, support_k,
                  grad_in_forward or compiled):
        n, v = student_hidden_NH.shape[0], student_head_VH.shape[0]
        _check_hidden_head(student_hidden_NH, student_head_VH)
        _check_weights(weights_N, n)
        teacher = _TeacherSource.build(n, v, teacher_hidden_NH, teacher_head_VH, teacher_logits_NV)
        kind = resolve_kind(kind, beta)
        check_temperature(temperature)
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size} must be >= 1")
        return fused_mod.fused_head_divergence(student_hidden_NH, student_head_VH, student_head_bias_V, teacher.raw,
                                               weights_N, kind, beta, temperature, chunk_size)
    chunk_fn = _divergence_args(student_hidden_NH, student_head_VH, teacher_hidden_NH, teacher_head_VH,
                                teacher_logits_NV, kind, beta, temperature, weights_N, support_k, compiled)
    return chunked_head_loss(student_hidden_NH, student_head_VH, chunk_fn, chunk_size=chunk_size,
                             student_head_bias_V=student_head_bias_V, grad_in_forward=grad_in_forward)


_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _use_fused(fused: bool | None, hidden_NH: Tensor, head_VH: Tensor, teacher_hidden_NH, teacher_logits_NV,
               support_k, torch_option: bool) -> bool:
    teacher = teacher_logits_NV if teacher_logits_NV is not None else teacher_hidden_NH
    can = (
        support_k is None
        and fused_mod.available(hidden_NH.device)
        and hidden_NH.dtype in _FUSED_DTYPES
        and head_VH.dtype == hidden_NH.dtype
        and (teacher is None or teacher.dtype in _FUSED_DTYPES)
    )
    if fused is None:
        return can and not torch_option
    if fused and not can:
        raise ValueError(
            "fused=True needs CUDA (or TRITON_INTERPRET=1 on CPU) with Triton, bf16/fp16/fp32 inputs of one dtype "
            "and support_k=None"
        )
    return fused


def _check_hidden_head(hidden_NH: Tensor, head_VH: Tensor) -> None:
    if hidden_NH.dim() != 2 or head_VH.dim() != 2:
        raise ValueError(
            f"student_hidden {tuple(hidden_NH.shape)} must be (N, H) and student_head "
            f"{tuple(head_VH.shape)} must be (V, H)"
        )
    if hidden_NH.shape[1] != head_VH.shape[1]:
        raise ValueError(f"student_hidden H={hidden_NH.shape[1]} != student_head H={head_VH.shape[1]}")


def chunked_divergence_per_token(
    student_hidden_NH: Tensor,
    student_head_VH: Tensor,
    *,
    teacher_hidden_NH: Tensor | None = None,
    teacher_head_VH: Tensor | None = None,
    teacher_logits_NV: Tensor | None = None,
    kind: Divergence | str,
    beta: float = 0.5,
    temperature: float = 1.0,
    weights_N: Tensor | None = None,
    chunk_size: int = 1024,
    student_head_bias_V: Tensor | None = None,
    support_k: int | None = None,
) -> Tensor:
    """weights_n * div_n per token (no grad), e.g. for diagnostics; same arguments as above."""
    chunk_fn = _divergence_args(student_hidden_NH, student_head_VH, teacher_hidden_NH, teacher_head_VH,
                                teacher_logits_NV, kind, beta, temperature, weights_N, support_k)
    return chunked_head_per_token(student_hidden_NH, student_head_VH, chunk_fn,
                                  chunk_size=chunk_size, student_head_bias_V=student_head_bias_V)


def topk_forward_kl_hidden(
    student_hidden_NH: Tensor,
    student_head_VH: Tensor,
    teacher_topk_ids_NK: Tensor,
    teacher_topk_logprobs_NK: Tensor,
    temperature: float = 1.0,
    weights_N: Tensor | None = None,
    chunk_size: int = 1024,
    student_head_bias_V: Tensor | None = None,
) -> Tensor:
    """`topk.topk_forward_kl` from hidden states, chunked (tail bucket included). Scalar SUM."""
    check_temperature(temperature)
    _check_weights(weights_N, student_hidden_NH.shape[0])
    _check_topk(student_hidden_NH.new_empty(student_hidden_NH.shape[0], student_head_VH.shape[0]),
                teacher_topk_ids_NK, teacher_topk_logprobs_NK)
    chunk_fn = _autograd_chunk_fn(
        lambda z, sl: topk_forward_kl_per_token(
            z, teacher_topk_ids_NK[sl], teacher_topk_logprobs_NK[sl], temperature
        ),
        weights_N,
    )
    return chunked_head_loss(student_hidden_NH, student_head_VH, chunk_fn,
                             chunk_size=chunk_size, student_head_bias_V=student_head_bias_V)


def coverage_regularizer_hidden(
    student_hidden_NH: Tensor,
    student_head_VH: Tensor,
    teacher_topk_ids_NK: Tensor,
    temperature: float = 1.0,
    weights_N: Tensor | None = None,
    chunk_size: int = 1024,
    student_head_bias_V: Tensor | None = None,
) -> Tensor:
    """`topk.coverage_regularizer` from hidden states, chunked. Scalar SUM."""
    check_temperature(temperature)
    _check_weights(weights_N, student_hidden_NH.shape[0])
    chunk_fn = _autograd_chunk_fn(
        lambda z, sl: coverage_per_token(z, teacher_topk_ids_NK[sl], temperature), weights_N
    )
    return chunked_head_loss(student_hidden_NH, student_head_VH, chunk_fn,
                             chunk_size=chunk_size, student_head_bias_V=student_head_bias_V)
