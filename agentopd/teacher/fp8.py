"""A local teacher's decoder projections in float8 (`teacher.linear_dtype: fp8`): half the weight bytes, and on an
H100/H200 the GEMMs on the fp8 tensor cores (twice bf16's peak).

    n = to_fp8(model)      # every nn.Linear of the decoder layers -> Fp8Linear; returns how many

`Fp8Linear` keeps its weight as float8 e4m3 with one fp32 scale per output row (the row's largest magnitude / 448, the
format's largest value) and, at each call, scales the input per token the same way (dynamic quantization: no
calibration); `torch._scaled_mm` multiplies the two and applies both scales to its fp32 accumulator, with a bf16 output
(on a CPU, where only our tests put it, the same product in fp32 matmuls).
That is the per-row scheme torchao's `Float8DynamicActivationFloat8WeightConfig(PerRow())` and vLLM's dynamic fp8
apply; torchao refuses to quantize where no fp8 GEMM hardware is (a CPU), and this one must run in our CPU tests and
on our GPU machines without a new dependency, so it is ours (~30 lines).

What stays in the model's dtype: the embeddings, the lm_head (the logits the losses use come from it, in fp32:
agentopd.teacher.hf), the norms, attention itself (flash), and any Linear whose sides are not multiples of 16
(`torch._scaled_mm`'s rule). The teacher's scores are then those of a slightly different model: on the real
Qwen2.5-Coder-1.5B-Instruct, 0.0011 nats a token of KL from its bf16 self against 0.10 to the 0.5B student it teaches
(benchmarks/results/teacher_fp8.md; benchmarks/teacher_fp8.py measures it).
"""

from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 e4m3 [M, K], fp32 scales [M, 1]) with x ~ q * scale, each row's largest |x| at 448. One
    temporary of x's size and dtype (the memory plan counts it), not an fp32 copy."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX).to(x.dtype)
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale.float()  # divided and multiplied by the same scale


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) from an nn.Linear, W in float8 e4m3 with per-output-row scales, x quantized per token."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w, scale = _quantize_rows(linear.weight.detach())
        self.weight = nn.Parameter(w, requires_grad=False)  # [out, in]
        self.register_buffer("weight_scale", scale.reshape(1, -1))  # [1, out]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.out_dtype = linear.weight.dtype if linear.weight.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        q, scale = _quantize_rows(x.reshape(-1, shape[-1]))
        if q.is_cuda:
            y = torch._scaled_mm(q, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, out_dtype=self.out_dtype)
        else:  # the same product, accumulated in fp32, scaled after: CPU _scaled_mm takes per-row scales only from
            # torch 2.13 on (2.11's refuses them), and a CPU fp8 teacher is our tests' alone (runs refuse it)
            y = ((q.float() @ self.weight.float().t()) * scale * self.weight_scale).to(self.out_dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float8 e4m3, per-row scales"


def to_fp8(model: nn.Module) -> int:
    """Every nn.Linear inside the model's decoder `layers` whose sides are multiples of 16 becomes an Fp8Linear, in
    place; returns how many did. Refuses a model without decoder layers (a Llama/Qwen-style model has them)."""
    layers = getattr(getattr(model, "base_model", model), "layers", None)
    if layers is None:
        raise ValueError(f"teacher.linear_dtype=fp8: {type(model).__name__} has no decoder `layers` to quantize "
                         "(a Llama/Qwen-style model has); set teacher.linear_dtype=auto")
    done = 0
    for layer in layers:
        for name, child in list(layer.named_modules()):
            if isinstance(child, nn.Linear) and child.in_features % 16 == 0 and child.out_features % 16 == 0:
                parent = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
                setattr(parent, name.rpartition(".")[2], Fp8Linear(child))
                done += 1
    if not done:
        raise ValueError("teacher.linear_dtype=fp8: no projection of the teacher's layers has sides that are multiples "
                         "of 16 (torch._scaled_mm's rule); set teacher.linear_dtype=auto")
    return done
