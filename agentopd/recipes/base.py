"""The recipe interface: how a recipe changes a step without a branch in the runner.

    class Horizon(Recipe):                      # agentopd/recipes/horizon.py
        stages = frozenset({Stage.PLAY, Stage.REPORT})
        def rollout(self, step, config): ...     # the training rollouts of `step` stop after k turns
        def report(self, step, played): ...      # horizon/turns

A step is a chain of stages (agentopd/step/, docs/design.md 9): plan -> play -> score -> samples -> train -> sync
-> report. A recipe names the stages it changes (`stages`) and overrides the hooks of those stages; every hook of
this base class leaves its stage as it is, so a run without recipes runs the plain chain. The stages call the hooks
of every recipe of the run in order (agentopd.step.recipes builds the list from the config); adding a recipe is a
class here (or beside the code it wraps) and one line in that list, no runner method.

Recipes know no backend (tests/test_layout.py): a hook that needs one (a scorer) is handed it by the stage, and a
recipe that is mostly backend work lives beside that work (crosstok/score.py `CrossTokenizer`, step/score.py
`ScoreAhead`).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from agentopd.backends.base import RolloutHandle
    from agentopd.objectives import Objective
    from agentopd.plan import Planned
    from agentopd.rollout import RolloutConfig
    from agentopd.step.values import Played, Scored, StepParts
    from agentopd.teacher import TeacherScores
    from agentopd.trainer.config import LossKind
    from agentopd.types import Episode, TokenStream


class Stage(StrEnum):
    """The stages of one step (agentopd/step/), in order; what a recipe may change."""

    PLAN = "plan"  # the step's objective
    PLAY = "play"  # who plays the training episodes and how far
    SCORE = "score"  # what the teacher reads, and how it is scored
    SAMPLES = "samples"  # the training samples' per-token weights
    TRAIN = "train"  # the step's loss
    REPORT = "report"  # metrics of its own


class Recipe:
    """One departure from plain OPD on the student's episodes. Subclasses set `name`, `stages` and the hooks of
    those stages (the others stay as they are here: no change)."""

    name: ClassVar[str] = "recipe"
    stages: ClassVar[frozenset[Stage]] = frozenset()
    # the teacher scores the student's streams as played: the backend may score them before the driver sees them
    # (async.score_ahead); False for a recipe that changes what the teacher reads or adds streams to score
    scores_played_streams: ClassVar[bool] = True
    # the teacher takes over student turns while they are played (recipe.intervene_below: its FLOPs counted)
    teacher_takes_turns: ClassVar[bool] = False

    # Stage.PLAN
    def objective(self, step: int, objective: Objective) -> Objective:
        return objective

    # Stage.PLAY
    def rollout(self, step: int, config: RolloutConfig) -> RolloutConfig:
        return config

    def teacher_share(self, planned: Sequence[Planned], n: int) -> int:
        """How many of the step's first planned episodes (whole groups of `n`) the teachers play."""
        return 0

    def submitted(self, objective: Objective, handles: Sequence[RolloutHandle], parts: StepParts) -> None:
        """A step's rollouts were just submitted (async mode: steps ahead of the one training), to play under
        `objective`."""

    def played(self, played: Played, parts: StepParts) -> dict[str, float]:
        """The step's episodes are played, the teacher has not scored them yet: a check of the run on them, its metrics
        (step/selftest.py `TeacherSelfTest`: the teacher's self-test). A `StopRun` raised here (agentopd.step.values)
        stops the run with a checkpoint of the last trained step and its line."""
        return {}

    # Stage.SCORE
    def streams(self, planned: Sequence[Planned], episodes: Sequence[Episode]) -> list[TokenStream] | None:
        """The streams the teacher scores instead of the episodes' own (None: the episodes' own)."""
        return None

    def score(self, played: Played, parts: StepParts) -> Scored | None:
        """The step's scores by another way of scoring (None: the plain stage scores)."""
        return None

    # Stage.SAMPLES
    def weights(self, episodes: Sequence[Episode], scores: Sequence[TeacherScores]) -> tuple[list[list[float]], dict[str, float]] | None:
        """Per-token loss weights of each episode and their metrics (None: unweighted)."""
        return None

    # Stage.TRAIN
    def train_loss(self, step: int) -> tuple[LossKind, float] | None:
        """A loss (and its temperature) replacing the trainer's own for `step` (None: the trainer's)."""
        return None

    # Stage.REPORT
    def report(self, played: Played) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Release what the recipe holds (the run's end)."""
