"""The run's recipes (agentopd.recipes.base), from its config, in the order the stages call them.

    recipes = run_recipes(cfg, cross_scorer=scorer, privileged=view, selftest=selftest)

Adding a recipe: a `Recipe` subclass naming the stages it changes (agentopd/recipes/), and one line here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentopd.objectives import Objective
from agentopd.policy import loss_temperature
from agentopd.recipes.base import Recipe
from agentopd.recipes.horizon import Horizon
from agentopd.recipes.intervene import Intervene
from agentopd.recipes.schedule import SftWarmStart, TeacherFraction
from agentopd.recipes.turn_weights import TurnWeights
from agentopd.trainer.config import LossKind

if TYPE_CHECKING:
    from agentopd.config import Config
    from agentopd.crosstok.score import CrossScorer
    from agentopd.privileged import PrivilegedView
    from agentopd.step.selftest import TeacherSelfTest


def run_recipes(cfg: Config, *, cross_scorer: CrossScorer | None = None, privileged: PrivilegedView | None = None,
                selftest: TeacherSelfTest | None = None) -> list[Recipe]:  # fmt: skip
    r = cfg.recipe
    recipes: list[Recipe] = []
    if r.sft_steps:
        recipes.append(SftWarmStart(r.sft_steps, Objective(cfg.run.objective), loss_temperature(cfg, LossKind.SFT)))
    if r.teacher_fraction:
        recipes.append(TeacherFraction(r.teacher_fraction))
    if r.horizon_turns is not None:
        recipes.append(Horizon(cfg.run.steps, *r.horizon_turns))
    if r.turn_support_below is not None:
        recipes.append(TurnWeights(r.turn_support_below, r.turn_weight_floor))
    if r.intervene_below is not None:
        recipes.append(Intervene())
    if privileged is not None:  # teacher.privileged
        from agentopd.privileged import PrivilegedContext

        recipes.append(PrivilegedContext(privileged))
    if cross_scorer is not None:  # trainer.loss=xtok_*
        from agentopd.crosstok.score import CrossTokenizer

        recipes.append(CrossTokenizer(cross_scorer))
    if selftest is not None:  # teacher.selftest (TeacherSelfTest.for_run: None where the run has none)
        recipes.append(selftest)
    a = cfg.async_  # scoring ahead: where the teacher scores the student's streams as played (no recipe above changes them)
    ahead = (a.enabled and a.score_ahead) or cfg.teacher.overlap  # Ray's async mode, or beside the rollout (local)
    if ahead and all(r.scores_played_streams for r in recipes):
        from agentopd.step.score import ScoreAhead

        recipes.append(ScoreAhead())
    return recipes
