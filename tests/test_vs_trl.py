"""The loss mapping behind benchmarks/vs_trl.py: TRL's DistillationTrainer loss at beta 0 / 0.5 / 1 equals agentopd's
forward_kl / jsd / reverse_kl on the same hidden states, heads and mask (values and gradients, to rounding).

TRL's side is the function its trainer calls, `trl.trainer.distillation_trainer._chunked_divergence_loss` (its
chunked divergence kernel over hidden states and lm_head weights; mean over the mask's tokens). Ours is what the
trainer calls for these kinds, `agentopd.losses.chunked_divergence` over the mask-1 tokens, divided by their count
(the trainer's global normalisation), and the reference `agentopd.losses.divergence` over full logits.

Legend: B rows, K completion positions, N mask-1 tokens, H student hidden, Ht teacher hidden, V vocabulary.
"""

import math

import pytest
import torch

from agentopd import losses

distill = pytest.importorskip(
    "trl.trainer.distillation_trainer", reason="trl (with accelerate and datasets) is not importable: pip install trl"
)

LOSS_OF_BETA = {0.0: "forward_kl", 0.5: "jsd", 1.0: "reverse_kl"}  # as benchmarks/vs_trl.py maps them


def _case(seed: int, b=3, k=11, h=16, ht=24, v=97):
    g = torch.Generator().manual_seed(seed)
    hidden_BKH = torch.randn(b, k, h, generator=g) * 2
    head_VH = torch.randn(v, h, generator=g) / math.sqrt(h)
    teacher_BKHt = torch.randn(b, k, ht, generator=g) * 2
    teacher_head_VHt = torch.randn(v, ht, generator=g) / math.sqrt(ht)
    mask_BK = (torch.rand(b, k, generator=g) > 0.3).long()
    mask_BK[0, -3:] = 0  # right padding, as TRL pads completions
    return hidden_BKH, head_VH, teacher_BKHt, teacher_head_VHt, mask_BK


@pytest.mark.parametrize("beta", sorted(LOSS_OF_BETA))
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_trl_loss_equals_ours(beta, temperature):
    hidden_BKH, head_VH, teacher_BKHt, teacher_head_VHt, mask_BK = _case(seed=int(beta * 10) + int(temperature * 100))

    h_trl = hidden_BKH.clone().requires_grad_(True)
    w_trl = head_VH.clone().requires_grad_(True)
    trl_loss, _, n_valid = distill._chunked_divergence_loss(
        h_trl, teacher_BKHt, w_trl, teacher_head_VHt, mask_BK, beta, temperature=temperature
    )
    trl_loss.backward()

    keep_BK = mask_BK.bool()
    h_ours = hidden_BKH.clone().requires_grad_(True)
    w_ours = head_VH.clone().requires_grad_(True)
    n = int(keep_BK.sum())
    ours = losses.chunked_divergence(
        h_ours[keep_BK], w_ours, teacher_hidden_NH=teacher_BKHt[keep_BK], teacher_head_VH=teacher_head_VHt,
        kind=LOSS_OF_BETA[beta], beta=beta, temperature=temperature, chunk_size=7,
    ) / n  # fmt: skip
    ours.backward()
    reference = losses.divergence(
        hidden_BKH[keep_BK] @ head_VH.T, teacher_BKHt[keep_BK] @ teacher_head_VHt.T, LOSS_OF_BETA[beta], beta=beta,
        temperature=temperature,
    ).mean()  # fmt: skip

    assert int(n_valid) == n
    assert trl_loss.item() > 0
    torch.testing.assert_close(ours, trl_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(reference, trl_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h_ours.grad, h_trl.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w_ours.grad, w_trl.grad, rtol=1e-4, atol=1e-5)  # fp32 sums over tokens; |grad| ~ 1e-2
    assert h_trl.grad[~keep_BK].abs().max() == 0  # masked positions get no gradient on either side


def test_jsd_beta_kinds_agree_between_ends():
    """Our `jsd` at beta 0 / 1 is computed as forward / reverse KL exactly, as TRL's beta ends are."""
    hidden_BKH, head_VH, teacher_BKHt, teacher_head_VHt, mask_BK = _case(seed=7)
    keep_BK = mask_BK.bool()
    for beta, kind in ((0.0, "forward_kl"), (1.0, "reverse_kl")):
        args = {"teacher_hidden_NH": teacher_BKHt[keep_BK], "teacher_head_VH": teacher_head_VHt, "beta": beta}
        jsd = losses.chunked_divergence(hidden_BKH[keep_BK], head_VH, kind="jsd", **args)
        torch.testing.assert_close(jsd, losses.chunked_divergence(hidden_BKH[keep_BK], head_VH, kind=kind, **args))
