"""The values one step's stages hand each other (agentopd/step/, docs/design.md 9), and the run's parts they read.

    played = play(step)                      # Played: the episodes, who played them, the step's objective
    scored = score(played, parts)            # Scored: the teachers' scores (None where the objective scores none)
    samples = prepare(played, scored, parts) # Samples: the training samples, the teachers' heads, the step's loss
    trained = train(samples, parts)          # Trained: the trainer's metrics
    synced = sync(played, parts, engines)    # Synced: the weight sync's seconds
    metrics = report(played, scored, samples, trained, synced, parts, flops)

Each value carries the metrics its stage measured; agentopd.step.report assembles them in the docs/design.md 3.6 names.
A stage (or a recipe's hook) that finds the run must not go on raises `StopRun`: the runner checkpoints the last step
the trainer took and stops with its line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from agentopd.backends.base import Backend, RolloutHandle
    from agentopd.batch import TrainSample
    from agentopd.config import Config
    from agentopd.objectives import Objective
    from agentopd.plan import Mixture, Planned
    from agentopd.recipes.base import Recipe
    from agentopd.rollout import RolloutConfig
    from agentopd.routing import Router
    from agentopd.shape import ModelShape
    from agentopd.step.phases import Phases
    from agentopd.store import Store
    from agentopd.teacher import TeacherMode, TeacherScores
    from agentopd.trainer.config import LossKind
    from agentopd.types import Episode


class StopRun(RuntimeError):
    """A stage's reason to stop the run (one line): the runner writes the last trained step's metrics and checkpoint, then
    raises it with what it saved (step/selftest.py `TeacherChanged`)."""


@dataclass
class StepParts:
    """What the stages read: the run's parts, built once by the runner (nothing here changes from step to step)."""

    cfg: Config
    backend: Backend
    mixture: Mixture
    router: Router
    store: Store
    phases: Phases
    recipes: list[Recipe]
    objective: Objective  # the run's (run.objective); a recipe may change a step's (Recipe.objective)
    mode: TeacherMode  # what the teachers return for the trainer's loss
    rollout_cfg: RolloutConfig  # the training rollouts' settings before any recipe
    shapes: dict[str, ModelShape | None]  # student and teachers by name (None: a server teacher)


@dataclass
class Played:
    """The play stage's value: a step's training episodes in plan order, stored as they finished."""

    step: int
    objective: Objective  # the step's (the SFT warm start's, or the run's)
    planned: list[Planned]
    episodes: list[Episode]
    teacher_of: list[str]  # the teacher each episode is routed to
    teacher_played: set[str] = field(default_factory=set)  # episode ids a teacher played (recipe.teacher_fraction)
    collected: list[RolloutHandle] = field(default_factory=list)  # rollouts whose scores the backend may have started
    seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)  # async/staleness_*, async/dropped, async/regenerated


@dataclass
class Scored:
    """The score stage's value: the teachers' scores of every episode, then of every branch (None: not scored)."""

    scores: list[TeacherScores] | None = None
    stored: list[list[float]] = field(default_factory=list)  # per episode: the teacher logprobs the store keeps
    scored: list[tuple[str, int]] = field(default_factory=list)  # (teacher, length) of every stream scored: flops/*
    ahead: float | None = None  # the share of the scores the backend started ahead (async.score_ahead; async mode)
    seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)  # a recipe's scoring metrics (xtok/*)


@dataclass
class Samples:
    """The samples stage's value: what the trainer takes this step."""

    samples: list[TrainSample]
    heads: list[torch.Tensor] | None  # the step's teachers' lm_heads (full-vocabulary losses), by teacher_index
    loss: LossKind | None = None  # a loss replacing the trainer's own this step (the SFT warm start)
    temperature: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # the weights' metrics (turn_weight/*, turn_support/*)


@dataclass
class Trained:
    metrics: dict[str, float]  # the trainer's: loss, grad_norm, lr, train/*, perf/train_*


@dataclass
class Synced:
    seconds: float
