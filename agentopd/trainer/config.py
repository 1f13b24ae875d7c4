"""TrainerConfig, its modes, and the learning-rate schedule.

    cfg = TrainerConfig(lr=1e-5, loss=LossKind.REVERSE_KL, total_steps=200, warmup_steps=10)

Every mode is a StrEnum, so plain strings from YAML work: `TrainerConfig(loss="sampled_k1")`.
Bad values raise ValueError naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class LossKind(StrEnum):
    """Which distillation loss the trainer minimises (docs/design.md 5)."""

    SAMPLED_K1 = "sampled_k1"  # sampled-token reverse KL (k1) as advantage, policy gradient
    SAMPLED_K3 = "sampled_k3"  # same with the k3 estimator
    FORWARD_KL = "forward_kl"  # full vocabulary KL(teacher || student), chunked
    REVERSE_KL = "reverse_kl"  # full vocabulary KL(student || teacher), chunked
    JSD = "jsd"  # generalized JSD(beta), chunked
    TOPK_FORWARD_KL = "topk_forward_kl"  # teacher top-k + tail bucket
    XTOK_K1 = "xtok_k1"  # a teacher with another tokenizer: k1 on aligned span log-probs (agentopd.losses.crosstok)
    XTOK_FULL = "xtok_full"  # a teacher with another tokenizer: mapped top-k KL at 1:1 span starts, ULD fallback
    SFT = "sft"  # cross-entropy on the student tokens (no teacher)
    GRPO = "grpo"  # task reward only: group-normalised advantage, policy gradient

    @property
    def is_sampled(self) -> bool:
        return self in (LossKind.SAMPLED_K1, LossKind.SAMPLED_K3, LossKind.XTOK_K1)

    @property
    def is_cross_tokenizer(self) -> bool:
        """The teacher may have another tokenizer: it scores the episode re-rendered in its own (agentopd.crosstok)."""
        return self in (LossKind.XTOK_K1, LossKind.XTOK_FULL)

    @property
    def is_full_vocab(self) -> bool:
        return self in (LossKind.FORWARD_KL, LossKind.REVERSE_KL, LossKind.JSD)


class Schedule(StrEnum):
    COSINE = "cosine"  # linear warm-up, then cosine from lr to lr * min_lr_ratio at total_steps
    CONSTANT = "constant"  # linear warm-up, then lr


class PGMode(StrEnum):
    IS = "is"  # importance-sampled policy gradient (ratio to the sampler)
    PPO_CLIP = "ppo_clip"


class Precision(StrEnum):
    AUTO = "auto"  # bf16 on GPU, fp32 on CPU
    BF16 = "bf16"  # bf16 parameters/activations, fp32 gradient reduction and master weights
    FP32 = "fp32"


@dataclass
class TrainerConfig:
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0  # applied to matrices only (not norms / biases)
    eps: float = 1e-8
    warmup_steps: int = 0
    total_steps: int = 1000  # the cosine schedule reaches lr * min_lr_ratio here
    schedule: Schedule = Schedule.COSINE
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping (the norm is still reported)
    loss: LossKind = LossKind.SAMPLED_K1
    beta: float = 0.5  # JSD beta (agentopd.losses documents the limits)
    temperature: float = 1.0  # student / teacher logits are divided by it (agentopd run: runner.trainer_config)
    teacher_temperature: float | None = None  # full-vocabulary losses: the teacher's logits divided by this instead (< temperature sharpens its targets; ~0.1: its argmax)
    chunk_size: int = 1024  # tokens per chunk of the vocabulary-sized losses
    xtok_fallback: str = "uld"  # xtok_full at span starts that are not 1:1: "uld" (sorted probabilities) or "none"
    pg_mode: PGMode = PGMode.IS
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    is_cap: float | None = None  # cap on the importance ratio in IS mode
    micro_batch_tokens: int = 16384  # packed tokens per forward/backward; a run's memory plans lower it where it cannot fit
    reward_beta: float | None = None  # softmax(reward / beta) episode weights; None = off
    reward_per_group: bool = True  # reward weighting within each group_id (else over the whole batch)
    task_reward_coef: float = 0.0  # weight of the GRPO task-reward term added to the loss; 0 = off
    tcad_power: float | None = None  # TCAD teacher-confidence episode weights (c_e ** power per group); None = off
    activation_checkpointing: bool = False
    checkpoint_every: int = 1  # with activation_checkpointing: recompute every k-th decoder layer only (selective)
    compile: bool = False  # torch.compile each decoder layer's forward (CUDA: fuses norms, RoPE, SiLU-mul)
    share_prefix: bool = True  # a prefix the samples share runs once (agentopd.prefix): padded rows (CPU) or packed varlen rows (CUDA)
    varlen_attention: bool = True  # CUDA + bf16: one packed row per micro-batch, flash varlen attention (agentopd/attention.py)
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy (parameters, gradients, optimizer state on CPU)
    mixed_precision: Precision = Precision.AUTO
    seed: int = 0  # the Trainer seeds torch's RNG with seed + rank when built (as HF Trainer does)

    def __post_init__(self) -> None:
        for name, enum in (("loss", LossKind), ("schedule", Schedule), ("pg_mode", PGMode)):
            self._coerce(name, enum)
        self._coerce("mixed_precision", Precision)
        if self.xtok_fallback not in ("uld", "none"):
            raise ValueError(f"trainer.xtok_fallback={self.xtok_fallback!r} is not one of ['uld', 'none']")
        self.betas = tuple(self.betas)  # YAML gives lists
        positive = ("lr", "temperature", "chunk_size", "micro_batch_tokens", "total_steps", "checkpoint_every")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"trainer.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("warmup_steps", "grad_clip", "weight_decay", "task_reward_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"trainer.{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"trainer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.teacher_temperature is not None and not self.teacher_temperature > 0:
            raise ValueError(f"trainer.teacher_temperature must be > 0 or None, got {self.teacher_temperature!r}")
        if self.teacher_temperature is not None and not self.loss.is_full_vocab and self.loss != LossKind.SFT:
            raise ValueError(
                f"trainer.teacher_temperature={self.teacher_temperature} reshapes the teacher's full distribution: it needs "
                f"a full-vocabulary loss (forward_kl, reverse_kl, jsd), not loss={self.loss.value}"
            )
        if self.reward_beta is not None and self.reward_beta <= 0:
            raise ValueError(f"trainer.reward_beta must be > 0 or None, got {self.reward_beta!r}")
        if len(self.betas) != 2:
            raise ValueError(f"trainer.betas must be two floats, got {self.betas!r}")

    def _coerce(self, name: str, enum: type[StrEnum]) -> None:
        value = getattr(self, name)
        try:
            setattr(self, name, enum(value))
        except ValueError:
            raise ValueError(f"trainer.{name}={value!r} is not one of {[e.value for e in enum]}") from None


def lr_factor(step: int, cfg: TrainerConfig) -> float:
    """Multiplier of cfg.lr for optimizer step `step` (0-based): linear warm-up from 1/(warmup+1)."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == Schedule.CONSTANT:
        return 1.0
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
