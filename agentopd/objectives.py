"""What a run optimises (`run.objective`), as data the runner reads instead of branching on strings.

    objective = Objective(cfg.run.objective)
    objective.loss            # the loss it forces (sft, grpo) or None: trainer.loss decides (opd)
    objective.teacher_plays   # the teacher plays the training episodes (sequence-level KD)
    objective.scores          # the teacher scores the episodes (teacher logprobs, kl/* metrics)
    teacher_mode(loss)        # what a teacher returns for a loss: hidden states, top-k or logprobs
    runs_selftest(cfg)        # whether the teacher self-test runs (the memory plans count its student scorer)
    loads_scorer(cfg)         # whether a scorer of the teacher loads (backends.stages.Scorers; the memory plans)
    teacher_plays(cfg)        # how the teachers play training episodes on an engine of their own (the memory plans)

- `opd` (default): on-policy distillation on the student's own episodes with `trainer.loss`.
- `sft`: cross-entropy on the teacher's episodes (sequence-level KD), the same budget of student
  tokens; they are not scored again; the student's engine is synced only before it plays (evals).
- `grpo`: the environment reward alone (group-normalised advantages); no teacher scores.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

from agentopd.trainer.config import LossKind  # light: the config layer imports this module

if TYPE_CHECKING:
    from agentopd.config import Config
    from agentopd.teacher.base import TeacherMode


class Objective(StrEnum):
    OPD = "opd"
    SFT = "sft"
    GRPO = "grpo"

    @property
    def loss(self) -> LossKind | None:
        return {Objective.SFT: LossKind.SFT, Objective.GRPO: LossKind.GRPO}.get(self)

    @property
    def teacher_plays(self) -> bool:
        return self is Objective.SFT

    @property
    def scores(self) -> bool:
        """The teacher scores the training episodes: only for OPD. Under SFT it played them itself (a second
        forward over its own tokens would only give back its sampler's logprobs); GRPO needs no teacher."""
        return self is Objective.OPD


def teacher_mode(loss: LossKind) -> TeacherMode:
    """What the teacher returns for `loss`: hidden states (full-vocabulary losses recompute its logits
    with its lm_head), top-k, or the sampled tokens' logprobs."""
    from agentopd.teacher.base import TeacherMode

    if loss.is_full_vocab:
        return TeacherMode.HIDDEN
    if loss in (LossKind.TOPK_FORWARD_KL, LossKind.XTOK_FULL):
        return TeacherMode.TOPK
    return TeacherMode.LOGPROBS


def runs_selftest(cfg: Config) -> bool:
    """Whether the run does the teacher self-test (agentopd.step.selftest): `teacher.selftest`, where the teacher scores
    the training episodes (an objective that `scores`) in the student's token ids (not a cross-tokenizer loss). Its
    pre-flight loads a scorer of the student's starting weights beside the teachers (agentopd.memory_plan and
    agentopd.memory_host count it)."""
    return cfg.teacher.selftest and Objective(cfg.run.objective).scores and not _cross_tokenizer(cfg)


def _cross_tokenizer(cfg: Config) -> bool:
    """Whether the run's loss reads a teacher of another tokenizer (the objective's loss, else trainer.loss)."""
    objective = Objective(cfg.run.objective)
    return (objective.loss or LossKind(cfg.trainer.loss)).is_cross_tokenizer


def teacher_evals(cfg: Config) -> bool:
    """Whether the teacher plays the held-out tasks at step 0 (`eval.teacher`): not for a cross-tokenizer loss, whose
    teacher cannot play in the student's token ids (it only scores). The runner, the host plan and the GPU plan read it."""
    return cfg.eval.teacher and not _cross_tokenizer(cfg)


def loads_scorer(cfg: Config) -> bool:
    """Whether a scorer of the run's teachers loads (backends.stages.Scorers loads it on first use): where an objective
    scores, or a guide judges the student's turns (recipe.intervene_below)."""
    return Objective(cfg.run.objective).scores or cfg.recipe.intervene_below is not None


def teacher_plays(cfg: Config) -> str:
    """How the run's local teachers play training episodes, on an engine of their own: "" never; "alone" (no scorer
    beside it: objective=sft); "before" (SFT steps, then OPD: the engine closes before the scorer loads); "beside" (at
    once: recipe.teacher_fraction, recipe.intervene_below)."""
    r = cfg.recipe
    if r.teacher_fraction > 0 or r.intervene_below is not None:
        return "beside"
    if Objective(cfg.run.objective).teacher_plays:
        return "alone"
    if r.sft_steps > 0 or r.auto_warm_start:  # the warm start chooses its SFT steps at step 0 (agentopd.warm_start)
        return "before" if Objective(cfg.run.objective).scores else "alone"
    return ""
