"""Fused Triton kernels for the small ops of a decoder layer (CUDA; the torch versions in model.py
define them and serve CPU).

    y, h = add_rms_norm(delta_NE, h_NE, weight_E, eps)       # h + delta, then RMSNorm of it
    y = rms_norm(h_NE, weight_E, eps)
    q_NHD = qk_norm_rope_store(qkv_NF, q_norm, k_norm, cos_LD, sin_LD, positions_N, slots_N, k_cache, v_cache,
                               q_heads, kv_heads, eps)        # q out; k, v written to the page pool
    a_NI = silu_mul(gate_up_N2I)

A decode step runs ~55 tiny kernels per layer without these (RMSNorm alone is seven); with them a
layer is ~10 launches. Each kernel rounds where transformers' eager code rounds (the model dtype
after every elementwise op), so in bf16 the results match the torch path up to the order of the
fp32 reductions.

Legend: N tokens, E hidden, F fused QKV width, H heads, D head dim, I intermediate, L positions.
"""

from __future__ import annotations

import torch

from agentopd.engines.fast.kv_cache import FP8

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _rnd(x, DT: tl.constexpr):
        """x rounded to the model dtype and back to fp32 (what an eager op in that dtype stores)."""
        return x.to(DT).to(tl.float32)

    @triton.jit
    def _to_pool(x, DT: tl.constexpr, IS_FP8: tl.constexpr, PT: tl.constexpr):
        """A K or V value (fp32, holding a DT value) as the pool stores it: in DT, or for an fp8 pool clamped to its
        finite range first (kv_cache.to_pool, the torch path's rule)."""
        if IS_FP8:
            return tl.minimum(tl.maximum(_rnd(x, DT), -448.0), 448.0).to(PT)
        return x.to(PT)

    @triton.jit
    def _norm_kernel(X, R, W, Y, H, E, eps, stride_x, stride_r, stride_y, stride_h,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        n = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < E
        DT = Y.dtype.element_ty
        x = tl.load(X + n * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            x = _rnd(x + tl.load(R + n * stride_r + offs, mask=mask, other=0.0).to(tl.float32), DT)
            tl.store(H + n * stride_h + offs, x.to(DT), mask=mask)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / E + eps)
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + n * stride_y + offs, (w * _rnd(x * rstd, DT)).to(DT), mask=mask)

    @triton.jit(do_not_specialize=["N"])
    def _qkv_kernel(QKV, QW, KW, COS, SIN, POS, SLOT, QO, KC, VC, eps, N, stride_qkv, stride_qo_n, stride_qo_h,
                    stride_cos, stride_kc, stride_kh,
                    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr,
                    BLOCK_T: tl.constexpr, KV_FP8: tl.constexpr):
        # BLOCK_T tokens x one head (0..HQ-1 query heads, then HKV key heads, then HKV value heads)
        h = tl.program_id(1)
        HALF: tl.constexpr = D // 2
        DT = QO.dtype.element_ty
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = offs_t < N
        offs = tl.arange(0, HALF)
        base = QKV + offs_t[:, None].to(tl.int64) * stride_qkv + h * D + offs[None, :]
        x1 = tl.load(base, mask=tmask[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF, mask=tmask[:, None], other=0.0).to(tl.float32)
        slot = tl.load(SLOT + offs_t, mask=tmask, other=0)
        if h >= HQ + HKV:  # a value head: straight into the pool
            v_dst = VC + slot[:, None] * stride_kc + (h - HQ - HKV) * stride_kh + offs[None, :]
            tl.store(v_dst, _to_pool(x1, DT, KV_FP8, VC.dtype.element_ty), mask=tmask[:, None])
            tl.store(v_dst + HALF, _to_pool(x2, DT, KV_FP8, VC.dtype.element_ty), mask=tmask[:, None])
        else:
            if HAS_NORM:
                rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)
                if h < HQ:
                    w1 = tl.load(QW + offs).to(tl.float32)
                    w2 = tl.load(QW + HALF + offs).to(tl.float32)
                else:
                    w1 = tl.load(KW + offs).to(tl.float32)
                    w2 = tl.load(KW + HALF + offs).to(tl.float32)
                x1 = _rnd(w1[None, :] * _rnd(x1 * rstd[:, None], DT), DT)
                x2 = _rnd(w2[None, :] * _rnd(x2 * rstd[:, None], DT), DT)
            pos = tl.load(POS + offs_t, mask=tmask, other=0)
            rope = pos[:, None] * stride_cos + offs[None, :]
            c = tl.load(COS + rope, mask=tmask[:, None], other=0.0).to(tl.float32)
            s = tl.load(SIN + rope, mask=tmask[:, None], other=0.0).to(tl.float32)
            o1 = _rnd(_rnd(x1 * c, DT) + _rnd(-x2 * s, DT), DT)
            o2 = _rnd(_rnd(x2 * c, DT) + _rnd(x1 * s, DT), DT)
            if h < HQ:
                q_dst = QO + offs_t[:, None].to(tl.int64) * stride_qo_n + h * stride_qo_h + offs[None, :]
                tl.store(q_dst, o1.to(DT), mask=tmask[:, None])
                tl.store(q_dst + HALF, o2.to(DT), mask=tmask[:, None])
            else:  # (its own name: an fp8 pool's pointer type differs from the query's)
                k_dst = KC + slot[:, None] * stride_kc + (h - HQ) * stride_kh + offs[None, :]
                tl.store(k_dst, _to_pool(o1, DT, KV_FP8, KC.dtype.element_ty), mask=tmask[:, None])
                tl.store(k_dst + HALF, _to_pool(o2, DT, KV_FP8, KC.dtype.element_ty), mask=tmask[:, None])

    @triton.jit
    def _silu_mul_kernel(GU, OUT, I, stride_gu, stride_o, BLOCK: tl.constexpr):
        n = tl.program_id(0)
        b = tl.program_id(1)
        offs = b * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        DT = OUT.dtype.element_ty
        g = tl.load(GU + n * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + n * stride_gu + I + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + n * stride_o + offs, (_rnd(g / (1.0 + tl.exp(-g)), DT) * u).to(DT), mask=mask)


def rms_norm(x_NE: torch.Tensor, w_E: torch.Tensor, eps: float) -> torch.Tensor:
    y = torch.empty_like(x_NE)
    n, e = x_NE.shape
    _norm_kernel[(n,)](x_NE, x_NE, w_E, y, y, e, eps, x_NE.stride(0), 0, y.stride(0), 0,
                       HAS_RES=False, BLOCK=triton.next_power_of_2(e), num_warps=4)
    return y


def add_rms_norm(delta_NE: torch.Tensor, h_NE: torch.Tensor, w_E: torch.Tensor, eps: float):
    """(RMSNorm(h + delta), h + delta)."""
    y, h = torch.empty_like(h_NE), torch.empty_like(h_NE)
    n, e = h_NE.shape
    _norm_kernel[(n,)](delta_NE, h_NE, w_E, y, h, e, eps, delta_NE.stride(0), h_NE.stride(0), y.stride(0),
                       h.stride(0), HAS_RES=True, BLOCK=triton.next_power_of_2(e), num_warps=4)
    return y, h


QKV = {"min_tokens": 512, "block_t": 8, "num_warps": 4}  # steps of fewer tokens: one token a program, one warp
# (one token a program made a prefill step's 8,160 tokens x 32 heads 261k programs of 64 values: 162 us a layer, where
# the bytes take 45; 8 tokens a program: 52 us, the best of 11 configurations, and the whole step 21.9 -> 19.3 ms.
# H100, benchmarks/results/engine_gpu.md)


def qk_norm_rope_store(qkv_NF, q_norm, k_norm, cos_LD, sin_LD, positions_N, slots_N, k_cache, v_cache,
                       q_heads: int, kv_heads: int, eps: float, **config) -> torch.Tensor:
    """Per-head RMSNorm (when q_norm is given) and rotary of q and k; k and v stored at their slots."""
    cfg = {**QKV, **config}
    n = qkv_NF.shape[0]
    d = k_cache.shape[-1]
    q_NHD = qkv_NF.new_empty(n, q_heads, d)
    has_norm = q_norm is not None
    block_t, warps = (cfg["block_t"], cfg["num_warps"]) if n >= cfg["min_tokens"] else (1, 1)
    _qkv_kernel[(triton.cdiv(n, block_t), q_heads + 2 * kv_heads)](
        qkv_NF, q_norm if has_norm else qkv_NF, k_norm if has_norm else qkv_NF, cos_LD, sin_LD, positions_N, slots_N,
        q_NHD, k_cache, v_cache, eps, n, qkv_NF.stride(0), q_NHD.stride(0), q_NHD.stride(1), cos_LD.stride(0),
        k_cache.stride(0), k_cache.stride(1), HQ=q_heads, HKV=kv_heads, D=d, HAS_NORM=has_norm, BLOCK_T=block_t,
        KV_FP8=k_cache.dtype == FP8, num_warps=warps,
    )
    return q_NHD


def silu_mul(gate_up_N2I: torch.Tensor) -> torch.Tensor:
    n, two_i = gate_up_N2I.shape
    i = two_i // 2
    out = gate_up_N2I.new_empty(n, i)
    block = 1024
    _silu_mul_kernel[(n, triton.cdiv(i, block))](gate_up_N2I, out, i, gate_up_N2I.stride(0), out.stride(0),
                                                 BLOCK=block, num_warps=4)
    return out
