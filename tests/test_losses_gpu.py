"""CUDA checks of the chunked losses in bf16 (the default fused Triton path, one chunk and several,
and the torch variants) (skipped without a GPU; no hypothesis import so the
file also runs on a bare GPU image with pytest)."""

import pytest
import torch

from agentopd import losses as L

KINDS = ["forward_kl", "reverse_kl", "jsd"]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_bf16_chunked_matches_fp32_reference(kind):
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, ht, v = 300, 64, 96, 5000
    hid = torch.randn(n, h, device="cuda", generator=g)
    w = torch.randn(v, h, device="cuda", generator=g) / 8
    th, tw = torch.randn(n, ht, device="cuda", generator=g), torch.randn(v, ht, device="cuda", generator=g) / 8
    hb, wb = hid.bfloat16().requires_grad_(True), w.bfloat16().requires_grad_(True)
    hf, wf = hb.detach().float().requires_grad_(True), wb.detach().float().requires_grad_(True)
    ref = L.divergence(hf @ wf.T, th.bfloat16().float() @ tw.bfloat16().float().T, kind).sum()
    ref.backward()
    for opts in (dict(), dict(chunk_size=1024), dict(fused=False), dict(grad_in_forward=True), dict(compiled=True)):
        hb.grad = wb.grad = None
        out = L.chunked_divergence(hb, wb, teacher_hidden_NH=th.bfloat16(), teacher_head_VH=tw.bfloat16(), kind=kind,
                                   **({"chunk_size": 128} | opts))
        out.backward()
        assert abs(out.item() - ref.item()) < 0.02 * abs(ref.item()), opts
        assert (hb.grad.float() - hf.grad).norm() < 0.05 * hf.grad.norm(), opts
        assert (wb.grad.float() - wf.grad).norm() < 0.05 * wf.grad.norm(), opts
