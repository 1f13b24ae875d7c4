"""The fused Triton divergence (agentopd/losses/fused.py, the CUDA default) on CPU, through Triton's
interpreter (TRITON_INTERPRET=1): values and gradients against the fp64 reference, masking, the
teacher given as logits, and the trainer's micro-batch independence on that path. Skipped where
Triton is not installed (it is not a CPU dependency); tests/test_losses_gpu.py runs it compiled.

Legend: N tokens, H student hidden, H_t teacher hidden, V vocab.
"""

import math
import os
import subprocess
import sys

import pytest
import torch

# Triton's own jit helpers (tl.sum, tl.max) become interpretable only when it is imported with the
# flag set; the flag is then set per test only, so the other CPU tests keep their default path. If
# something in this process imported Triton before, these tests run in a fresh process instead.
_FRESH = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not _FRESH:
    _flag = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton")
finally:
    if not _FRESH:
        if _flag is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _flag
in_process = pytest.mark.skipif(_FRESH, reason="Triton was imported without the interpreter: run in a fresh process")


def test_the_file_in_a_fresh_process_when_triton_was_imported_before():
    if not _FRESH:
        pytest.skip("the tests below run in this process")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]

from agentopd import losses as L  # noqa: E402
from agentopd.losses import fused as F  # noqa: E402

KINDS = ["forward_kl", "reverse_kl", "jsd"]


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    if _FRESH:
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)


def _inputs(seed, n=23, h=8, ht=12, v=3000):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 2  # noqa: E731
    return dict(h=r(n, h).requires_grad_(True), w=(r(v, h) / math.sqrt(h)).requires_grad_(True),
                b=r(v).requires_grad_(True), th=r(n, ht), tw=r(v, ht) / math.sqrt(ht),
                weights=torch.rand(n, generator=g))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@in_process
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("teacher", ["hidden", "logits"])
def test_fused_matches_fp64_reference(kind, teacher):
    x = _inputs(1)
    for beta, temperature in [(0.5, 1.0), (0.2, 1.7)]:
        s64 = x["h"].double() @ x["w"].double().T + x["b"].double()
        t_logits = x["th"] @ x["tw"].T
        ref = (L.divergence(s64, t_logits.double(), kind, beta=beta, temperature=temperature)
               * x["weights"].double()).sum()
        ref_g = torch.autograd.grad(ref, (x["h"], x["w"], x["b"]))
        kw = (dict(teacher_hidden_NH=x["th"], teacher_head_VH=x["tw"]) if teacher == "hidden"
              else dict(teacher_logits_NV=t_logits))
        for chunk_size in (5, 23, 1024):  # several chunks (fp32 accumulator) and one (direct GEMM)
            out = L.chunked_divergence(x["h"], x["w"], **kw, kind=kind, beta=beta, temperature=temperature,
                                       weights_N=x["weights"], chunk_size=chunk_size, student_head_bias_V=x["b"],
                                       fused=True)
            grads = torch.autograd.grad(out * 3.0, (x["h"], x["w"], x["b"]))  # upstream gradient applied
            assert out.dtype == torch.float32
            assert abs(out.item() - ref.item()) <= 1e-5 * max(1.0, abs(ref.item())), (chunk_size, out, ref)
            for got, want in zip(grads, ref_g):
                assert _rel(got, 3.0 * want) < 1e-4, (chunk_size, _rel(got, 3.0 * want))


@in_process
def test_fused_is_the_default_where_it_runs_and_the_reference_is_kept():
    x = _inputs(2)
    common = dict(teacher_hidden_NH=x["th"], teacher_head_VH=x["tw"], kind="jsd", chunk_size=7)
    assert F.available(torch.device("cpu"))  # the interpreter: the auto path takes it
    default = L.chunked_divergence(x["h"], x["w"], **common)
    ref = L.chunked_divergence(x["h"], x["w"], fused=False, **common)
    assert default.grad_fn.name().endswith("_FusedHeadDivergenceBackward")
    assert ref.grad_fn.name().endswith("_ChunkedHeadLossBackward")
    assert abs(default.item() - ref.item()) < 1e-5 * abs(ref.item())
    with pytest.raises(ValueError, match="fused=True"):
        L.chunked_divergence(x["h"], x["w"], support_k=3, fused=True, **common)
    with pytest.raises(ValueError, match="fused=True"):  # fp64 runs on the reference path only
        L.chunked_divergence(x["h"].double(), x["w"].double(), teacher_hidden_NH=x["th"].double(),
                             teacher_head_VH=x["tw"].double(), kind="jsd", fused=True)


@in_process
@pytest.mark.parametrize("kind", KINDS)
def test_fused_masking_removes_exactly_the_masked_tokens(kind):
    x = _inputs(3)
    mask = torch.zeros(23, dtype=torch.bool)
    mask[[0, 3, 4, 9, 15, 22]] = True
    common = dict(teacher_head_VH=x["tw"], kind=kind, chunk_size=4, fused=True)
    as_weights = L.chunked_divergence(x["h"], x["w"], teacher_hidden_NH=x["th"], weights_N=mask.float(), **common)
    g_weights = torch.autograd.grad(as_weights, (x["h"], x["w"]))
    selected = L.chunked_divergence(x["h"][mask], x["w"], teacher_hidden_NH=x["th"][mask], **common)
    g_sel = torch.autograd.grad(selected, (x["h"], x["w"]))
    assert abs(as_weights.item() - selected.item()) < 1e-5 * abs(selected.item())
    assert (g_weights[0][~mask] == 0).all()
    # the two sums run in other chunks: fp32 rounding of ~1e-7 absolute. JSD's gradients here are ~300x smaller than
    # the KLs' (max ~0.008 against ~2-4), so the same rounding is ~1e-5 of their norm (triton 3.6's interpreter: 1.2e-5);
    # a masked token leaking in would be of the order of the gradient itself
    bound = 5e-5 if kind == "jsd" else 1e-6
    assert _rel(g_weights[0], g_sel[0]) < bound and _rel(g_weights[1], g_sel[1]) < bound


@in_process
def test_fused_zero_when_student_equals_teacher_and_empty_batch():
    x = _inputs(4)
    for kind in KINDS:
        out = L.chunked_divergence(x["h"], x["w"], teacher_hidden_NH=x["h"].detach(), teacher_head_VH=x["w"].detach(),
                                   kind=kind, chunk_size=8, fused=True)
        gh, gw = torch.autograd.grad(out, (x["h"], x["w"]))
        assert abs(out.item()) < 1e-4 and gh.abs().max() < 1e-5 and gw.abs().max() < 1e-5
    h0 = torch.zeros(0, 8, requires_grad=True)
    out = L.chunked_divergence(h0, x["w"], teacher_hidden_NH=torch.zeros(0, 12), teacher_head_VH=x["tw"], kind="jsd",
                               fused=True)
    (gw,) = torch.autograd.grad(out, x["w"])
    assert out.item() == 0.0 and gw.abs().sum() == 0.0


@in_process
@pytest.mark.parametrize("kind", ["forward_kl", "jsd"])
def test_trainer_gradient_independent_of_micro_batching_on_the_fused_path(kind):
    from _tiny import VOCAB, make_samples, tiny_model

    from agentopd.trainer import Trainer, TrainerConfig

    samples = make_samples(6, seed=2, teacher_hidden=16)
    teacher_head_VH = torch.randn(VOCAB, 16, generator=torch.Generator().manual_seed(3))
    cfg = dict(lr=1e-2, eps=1.0, warmup_steps=1, total_steps=6, loss=kind, reward_beta=0.5)
    deltas, losses = [], []
    for budget in (1, 64, 10_000):
        trainer = Trainer(tiny_model(), TrainerConfig(**cfg, micro_batch_tokens=budget))
        before = {k: v.clone() for k, v in trainer.state_dict_for_engine().items()}
        m = trainer.train_step(samples, teacher_head_VH=teacher_head_VH)
        after = trainer.state_dict_for_engine()
        deltas.append({k: (after[k] - before[k]) / cfg["lr"] for k in before})
        losses.append(m["loss"])
    # the same step on the torch reference path
    ref = Trainer(tiny_model(), TrainerConfig(**cfg, micro_batch_tokens=64))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        ref_loss = ref.train_step(samples, teacher_head_VH=teacher_head_VH)["loss"]
    assert losses[0] == pytest.approx(ref_loss, rel=1e-5)
    for d, loss in zip(deltas[1:], losses[1:]):
        assert loss == pytest.approx(losses[0], rel=1e-5)
        for k in d:
            torch.testing.assert_close(d[k], deltas[0][k], atol=1e-5, rtol=0, msg=k)
    assert max(v.abs().max() for v in deltas[0].values()) > 1e-3


@in_process
@pytest.mark.parametrize("pad_value", [0.5, float("inf")])
def test_fused_over_widened_head_rows_equals_the_plain_head(monkeypatch, pad_value):
    """On CUDA the loss GEMMs run over the head's rows up to an aligned count (losses/head_matmul: the tokenizer's
    odd V sends cuBLAS to slow kernels). Forced on here: the same loss and gradients as the plain V rows, and the
    rows past V (padding of the embedding) never leak in, a non-finite one included (it falls back)."""
    from agentopd.losses import head_matmul

    x = _inputs(5, v=3000)
    v = 2989  # odd: widened to 3008 rows, read from the storage past the slice
    w_full = torch.cat([x["w"].detach(), torch.full((20, 8), pad_value)]).requires_grad_(True)
    tw_full = torch.cat([x["tw"], torch.full((20, 12), pad_value)])
    common = dict(kind="jsd", beta=0.3, temperature=1.3, weights_N=x["weights"], chunk_size=7, fused=True)
    results = []
    for devices in ({"cuda"}, {"cuda", "cpu"}):
        monkeypatch.setattr(head_matmul, "DEVICES", frozenset(devices))
        head = w_full[:v]
        assert (head_matmul.widened_rows(head) is None) == ("cpu" not in devices)
        out = L.chunked_divergence(x["h"], head, teacher_hidden_NH=x["th"], teacher_head_VH=tw_full[:v], **common)
        results.append((out, *torch.autograd.grad(out, (x["h"], w_full))))
    (plain, gh0, gw0), (wide, gh1, gw1) = results
    assert abs(plain.item() - wide.item()) <= 1e-5 * abs(plain.item())
    assert _rel(gh1, gh0) < 1e-5 and _rel(gw1, gw0) < 1e-5
    assert (gw1[v:] == 0).all() and torch.isfinite(gh1).all()
