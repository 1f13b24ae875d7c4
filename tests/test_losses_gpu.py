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


@pytest.mark.gpu
@pytest.mark.parametrize("pad_value", [0.1, float("nan")])
def test_cuda_fused_over_widened_head_rows_equals_the_plain_head(monkeypatch, pad_value):
    """A tokenizer's odd V (Qwen3: 151,669 of 151,936 rows) sends cuBLAS to its slow align1 kernels; the loss GEMMs
    run over the head's rows up to a multiple of 64 instead (losses/head_matmul). The same loss and gradients as
    the plain V rows; padding rows never leak in, a NaN one included (it falls back to the plain rows)."""
    from agentopd.losses import head_matmul

    g = torch.Generator(device="cuda").manual_seed(1)
    n, h, ht, v, rows = 700, 64, 96, 5001, 5120
    hid = torch.randn(n, h, device="cuda", generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(rows, h, device="cuda", generator=g) / 8).bfloat16()
    w[v:] = pad_value
    w.requires_grad_(True)
    th, tw = torch.randn(n, ht, device="cuda", generator=g).bfloat16(), (torch.randn(rows, ht, device="cuda", generator=g) / 8).bfloat16()
    tw[v:] = pad_value
    assert head_matmul.widened_rows(w[:v]).shape[0] == 5056
    out = []
    for devices in ({"cuda"}, set()):
        monkeypatch.setattr(head_matmul, "DEVICES", frozenset(devices))
        loss = L.chunked_divergence(hid, w[:v], teacher_hidden_NH=th, teacher_head_VH=tw[:v], kind="reverse_kl",
                                    chunk_size=256)
        out.append((loss, *torch.autograd.grad(loss, (hid, w))))
    (wide, gh1, gw1), (plain, gh0, gw0) = out
    assert torch.isfinite(wide) and abs(wide.item() - plain.item()) < 1e-3 * abs(plain.item())
    assert (gh1.float() - gh0.float()).norm() < 1e-2 * gh0.float().norm()
    assert (gw1.float() - gw0.float()).norm() < 1e-2 * gw0.float().norm() and (gw1[v:] == 0).all()
