"""Who plays a step's training episodes, by schedule: the SFT warm start and the teacher's share of each step.

    SftWarmStart(steps=50, run=Objective.OPD, temperature=1.0)   # recipe.sft_steps: SFT on the teacher's episodes first
    TeacherFraction(0.5)                                          # recipe.teacher_fraction: GKD's lambda

`recipe.sft_steps`: steps 1..N train with `objective=sft` (the teacher plays, cross-entropy on its tokens, at the SFT
loss's temperature), then the run's objective. `recipe.teacher_fraction`: the first share of each step's tasks (the
plan's draw is random already; whole groups of rollout.n) is played by the tasks' teachers, the rest by the
student; `recipe/teacher_episodes` counts the teachers' episodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentopd.objectives import Objective
from agentopd.recipes.base import Recipe, Stage
from agentopd.trainer.config import LossKind

if TYPE_CHECKING:
    from agentopd.plan import Planned
    from agentopd.step.values import Played


@dataclass
class SftWarmStart(Recipe):
    """`recipe.sft_steps`: the first `steps` steps are SFT steps, trained at that loss's `temperature`."""

    steps: int
    run: Objective  # the run's own objective, in force after the warm start
    temperature: float  # agentopd.policy.loss_temperature(cfg, LossKind.SFT)
    name = "sft_steps"
    stages = frozenset({Stage.PLAN, Stage.TRAIN})

    def objective(self, step: int, objective: Objective) -> Objective:
        return Objective.SFT if step <= self.steps else objective

    def train_loss(self, step: int) -> tuple[LossKind, float] | None:
        if step > self.steps or self.run == Objective.SFT:  # the run's own objective: the trainer's own loss
            return None
        return LossKind.SFT, self.temperature


@dataclass
class TeacherFraction(Recipe):
    """`recipe.teacher_fraction`: the teachers play that share of each step's tasks."""

    fraction: float
    name = "teacher_fraction"
    stages = frozenset({Stage.PLAY, Stage.REPORT})

    def teacher_share(self, planned: Sequence[Planned], n: int) -> int:
        return n * round(self.fraction * (len(planned) // n))

    def report(self, played: Played) -> dict[str, float]:
        return {"recipe/teacher_episodes": float(len(played.teacher_played))} if played.teacher_played else {}
