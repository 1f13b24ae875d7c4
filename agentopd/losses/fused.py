"""The fast full-vocabulary divergence: both lm_heads fused with one Triton pass per chunk.

    loss = fused_divergence(h_NH, W_VH, teacher_hidden_NH=th_NH, teacher_head_VH=tW_VH,
                            kind="jsd", beta=0.5, weights_N=w_N, chunk_size=1024)   # a SUM
    (loss / global_student_tokens).backward()

`chunked_divergence` calls this by default on CUDA (`fused=None`); the torch path in
`chunked.py` stays the exact reference (and the CPU path). Same values and gradients
(tests/test_losses_fused.py runs the kernel under Triton's interpreter on CPU; benchmarks/loss.py
compares against an fp64 reference on the GPU).

How, per chunk of C tokens (C x V never exists for the batch, in forward or backward):
  1. cuBLAS: student logits s_CV = h_C @ W^T (+ b) and teacher logits t_CV = th_C @ tW^T, in the
     inputs' dtype (bf16 on GPU), fp32 accumulation inside the GEMMs.
  2. Triton, one program per row: online log-sum-exp of both rows (and for JSD a second pass for
     KL(p_s || m) and KL(p_t || m)), the row's loss, then d loss / d s written IN PLACE over s_CV
     (closed forms in `divergence.py`). Everything in fp32 registers; s_CV and t_CV are read 2-3
     times from memory, never converted to fp32 copies.
  3. cuBLAS: grad_h[C] = g_CV @ W and grad_W += g_CV^T @ h_C (fp32 accumulator over chunks,
     or one bf16 GEMM when the batch is one chunk).
The gradients are computed in the forward pass and kept for backward (N x H + V x H), so the
logit GEMMs run once: 3 student-sized GEMMs + 1 teacher-sized GEMM per token, the minimum.
Extra memory: 2 C x V logits buffers + the V x H gradient (+ its fp32 accumulator if N > C).

Legend: N tokens, C chunk tokens, H student hidden, H_t teacher hidden, V vocab.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from agentopd.losses.divergence import Divergence
from agentopd.losses.head_matmul import finite_rows, gemm_rows

_KIND_CODE = {Divergence.FORWARD_KL: 0, Divergence.REVERSE_KL: 1, Divergence.JSD: 2}
_BLOCK_V = 2048


def available(device: torch.device) -> bool:
    """Whether the fused kernel can run on tensors of `device` (CUDA with Triton, or Triton's
    interpreter on CPU when TRITON_INTERPRET=1)."""
    if device.type == "cuda":
        return _has_triton()
    return device.type == "cpu" and _interpret() and _has_triton()


@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpret() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _kernel(interpret: bool):
    """The Triton kernel, built on first use (Triton is imported lazily: CPU installs lack it)."""
    import triton
    import triton.language as tl

    def div_grad_rows(S, T, W, LOSS, stride_s, stride_t, V: tl.constexpr, inv_temp, beta, log_beta, log_1mbeta,
                      KIND: tl.constexpr, HAS_W: tl.constexpr, NEED_GRAD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        s_row = S + row * stride_s
        t_row = T + row * stride_t
        offs = tl.arange(0, BLOCK)
        # per-lane online log-sum-exp of s and t (+ one running sum for the KLs), merged at the end
        m_s = tl.full([BLOCK], -1e30, tl.float32)
        m_t = tl.full([BLOCK], -1e30, tl.float32)
        d_s = tl.zeros([BLOCK], tl.float32)
        d_t = tl.zeros([BLOCK], tl.float32)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            mask = idx < V
            s = tl.load(s_row + idx, mask=mask, other=-float("inf")).to(tl.float32) * inv_temp
            t = tl.load(t_row + idx, mask=mask, other=-float("inf")).to(tl.float32) * inv_temp
            ms_new = tl.maximum(m_s, s)
            mt_new = tl.maximum(m_t, t)
            a_s = tl.exp(m_s - ms_new)
            a_t = tl.exp(m_t - mt_new)
            e_s = tl.exp(s - ms_new)
            e_t = tl.exp(t - mt_new)
            d_s = d_s * a_s + e_s
            d_t = d_t * a_t + e_t
            if KIND == 0:  # sum e^(t - m_t) (t - s)
                acc = acc * a_t + tl.where(mask, e_t * (t - s), 0.0)
            elif KIND == 1:  # sum e^(s - m_s) (s - t)
                acc = acc * a_s + tl.where(mask, e_s * (s - t), 0.0)
            m_s = ms_new
            m_t = mt_new
        big_s = tl.max(m_s, 0)
        big_t = tl.max(m_t, 0)
        sum_s = tl.sum(d_s * tl.exp(m_s - big_s), 0)
        sum_t = tl.sum(d_t * tl.exp(m_t - big_t), 0)
        lse_s = big_s + tl.log(sum_s)
        lse_t = big_t + tl.log(sum_t)
        kl_s_m = 0.0
        if KIND == 0:  # KL(p_t || p_s) = E_t[t - s] - lse_t + lse_s
            loss = tl.sum(acc * tl.exp(m_t - big_t), 0) / sum_t - lse_t + lse_s
        elif KIND == 1:  # KL(p_s || p_t) = E_s[s - t] - lse_s + lse_t
            loss = tl.sum(acc * tl.exp(m_s - big_s), 0) / sum_s - lse_s + lse_t
        else:  # JSD(beta) = beta KL(p_t || m) + (1 - beta) KL(p_s || m), log m in log space
            kt = tl.zeros([BLOCK], tl.float32)
            ks = tl.zeros([BLOCK], tl.float32)
            for start in range(0, V, BLOCK):
                idx = start + offs
                mask = idx < V
                lp_s = tl.load(s_row + idx, mask=mask, other=0.0).to(tl.float32) * inv_temp - lse_s
                lp_t = tl.load(t_row + idx, mask=mask, other=0.0).to(tl.float32) * inv_temp - lse_t
                x = lp_s + log_1mbeta
                y = lp_t + log_beta
                hi = tl.maximum(x, y)
                log_m = hi + tl.log(1.0 + tl.exp(tl.minimum(x, y) - hi))
                kt += tl.where(mask, tl.exp(lp_t) * (lp_t - log_m), 0.0)
                ks += tl.where(mask, tl.exp(lp_s) * (lp_s - log_m), 0.0)
            kl_s_m = tl.sum(ks, 0)
            loss = beta * tl.sum(kt, 0) + (1.0 - beta) * kl_s_m
        w = 1.0
        if HAS_W:
            w = tl.load(W + row).to(tl.float32)
        tl.store(LOSS + row, loss * w)
        if NEED_GRAD:  # d loss / d raw student logits, over the student row in place
            scale = w * inv_temp
            for start in range(0, V, BLOCK):
                idx = start + offs
                mask = idx < V
                lp_s = tl.load(s_row + idx, mask=mask, other=0.0).to(tl.float32) * inv_temp - lse_s
                lp_t = tl.load(t_row + idx, mask=mask, other=0.0).to(tl.float32) * inv_temp - lse_t
                p_s = tl.exp(lp_s)
                if KIND == 0:
                    g = p_s - tl.exp(lp_t)
                elif KIND == 1:
                    g = p_s * (lp_s - lp_t - loss)
                else:
                    x = lp_s + log_1mbeta
                    y = lp_t + log_beta
                    hi = tl.maximum(x, y)
                    log_m = hi + tl.log(1.0 + tl.exp(tl.minimum(x, y) - hi))
                    g = (1.0 - beta) * p_s * (lp_s - log_m - kl_s_m)
                tl.store(s_row + idx, (g * scale).to(S.dtype.element_ty), mask=mask)

    assert _interpret() == interpret
    return triton.jit(div_grad_rows)


def divergence_grad_(
    s_CV: Tensor, t_CV: Tensor, weights_C: Tensor | None, kind: Divergence, beta: float, temperature: float,
    need_grad: bool,
) -> Tensor:
    """Per-row weighted divergence (fp32, C) between softmax(s / T) and softmax(t / T); with
    need_grad, overwrites s_CV with d(sum of it) / d s_CV (in s_CV's dtype). t_CV is only read."""
    assert s_CV.dim() == 2 and s_CV.shape == t_CV.shape, (s_CV.shape, t_CV.shape)
    assert s_CV.stride(1) == 1 and t_CV.stride(1) == 1
    c, v = s_CV.shape
    loss_C = torch.empty(c, dtype=torch.float32, device=s_CV.device)
    if c == 0:
        return loss_C
    w = weights_C.to(torch.float32).contiguous() if weights_C is not None else loss_C
    log_beta = math.log(beta) if kind is Divergence.JSD else 0.0
    log_1mbeta = math.log1p(-beta) if kind is Divergence.JSD else 0.0
    _kernel(_interpret())[(c,)](
        s_CV, t_CV, w, loss_C, s_CV.stride(0), t_CV.stride(0), v, 1.0 / temperature, float(beta), log_beta,
        log_1mbeta, KIND=_KIND_CODE[kind], HAS_W=weights_C is not None, NEED_GRAD=need_grad, BLOCK=_BLOCK_V,
        num_warps=8,
    )
    return loss_C


def _addmm_fp32_(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc (fp32) += a @ b for bf16/fp16 a, b, without an a @ b temporary where cuBLAS allows it."""
    if acc.dtype != a.dtype and acc.device.type == "cuda":
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:
        acc += a @ b


def fused_sweep(hidden_NH, head_VH, bias_V, teacher_logits, weights_N, kind: Divergence, beta: float,
                temperature: float, chunk_size: int, needs):
    """One pass over the chunks: the weighted loss sum and the gradients of the inputs in `needs`
    (hidden, head, bias). `teacher_logits(sl)` returns the teacher's raw logits of a chunk."""
    need_h, need_w, need_b = needs
    need_grad = need_h or need_w or need_b
    n, v = hidden_NH.shape[0], head_VH.shape[0]
    # the GEMMs over the head's rows padded to an aligned count where it has them (head_matmul: cuBLAS's fast
    # kernels); the logits are the first v columns, the gradient's padding columns are zeroed before use
    gemm_VH = gemm_rows(head_VH) if bias_V is None else head_VH
    if gemm_VH is not head_VH and need_h and not finite_rows(gemm_VH, v):
        gemm_VH = head_VH
    total = torch.zeros((), dtype=torch.float32, device=hidden_NH.device)
    grad_h = torch.empty_like(hidden_NH) if need_h else None
    grad_w = None
    one_chunk = n <= chunk_size
    if need_w and not one_chunk:
        grad_w = torch.zeros(gemm_VH.shape, dtype=torch.promote_types(head_VH.dtype, torch.float32),
                             device=head_VH.device)
    grad_b = torch.zeros(v, dtype=torch.float32, device=head_VH.device) if need_b else None
    for start in range(0, n, chunk_size):
        sl = slice(start, min(start + chunk_size, n))
        h_CH = hidden_NH[sl]
        full_CV = F.linear(h_CH, gemm_VH, bias_V)  # bias only where not widened
        s_CV = full_CV[:, :v]
        t_CV = teacher_logits(sl)
        w_C = weights_N[sl] if weights_N is not None else None
        total += divergence_grad_(s_CV, t_CV, w_C, kind, beta, temperature, need_grad).sum()
        del t_CV
        if not need_grad:
            continue
        g_CV = full_CV  # now d loss / d logits in its first v columns, in the inputs' dtype
        if gemm_VH is not head_VH:
            g_CV[:, v:].zero_()
        if grad_b is not None:
            grad_b += g_CV[:, :v].sum(0, dtype=torch.float32)
        if grad_h is not None:
            torch.mm(g_CV, gemm_VH, out=grad_h[sl])
        if need_w:
            if one_chunk:
                grad_w = g_CV.T @ h_CH
            else:
                _addmm_fp32_(grad_w, g_CV.T, h_CH)
        del s_CV, g_CV, full_CV
    if need_w and n == 0:
        grad_w = torch.zeros_like(head_VH)
    if grad_w is not None and grad_w.shape[0] != v:
        grad_w = grad_w[:v]
    grad_w = grad_w.to(head_VH.dtype) if grad_w is not None else None
    grad_b = grad_b.to(bias_V.dtype) if grad_b is not None else None
    return total, grad_h, grad_w, grad_b


class _FusedHeadDivergence(torch.autograd.Function):
    """sum of the weighted divergence; gradients computed in forward, scaled in backward."""

    @staticmethod
    def forward(ctx, hidden_NH, head_VH, bias_V, teacher_logits, weights_N, kind, beta, temperature, chunk_size):
        needs = tuple(ctx.needs_input_grad[:3])
        total, *grads = fused_sweep(hidden_NH, head_VH, bias_V, teacher_logits, weights_N, kind, beta,
                                    temperature, chunk_size, needs)
        ctx.grads = grads  # our own buffers: scaled in place in backward (no second V x H copy)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.grads is None:
            raise RuntimeError("the fused divergence keeps its gradients for one backward only")
        grads, ctx.grads = ctx.grads, None
        grads = [g.mul_(grad_out.to(g.dtype)) if g is not None else None for g in grads]
        return (*grads, None, None, None, None, None, None)


def fused_head_divergence(hidden_NH, head_VH, bias_V, teacher_logits, weights_N, kind: Divergence, beta: float,
                          temperature: float, chunk_size: int) -> Tensor:
    """Autograd entry (arguments checked by `chunked.chunked_divergence`)."""
    return _FusedHeadDivergence.apply(hidden_NH, head_VH, bias_V, teacher_logits, weights_N, kind, beta,
                                      temperature, chunk_size)
