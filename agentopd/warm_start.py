"""The embedded default's warm start (`recipe.auto_warm_start`, issue 54): from the step-0 evals, SFT on the teacher's
episodes first when the student is cold, plain OPD when it is not.

    choice = choose_warm_start(cfg, student=before, teacher=teacher_eval)   # WarmStart, or None: the rule does not apply
    choice.steps      # SFT steps before the run's objective (recipe.sft_steps); 0 = plain OPD
    choice.line()     # what the run prints: what it chose and why

Why: plain OPD from a cold student stalls. On a plugin env the run had never seen, a 1% student under an 86% teacher
stayed at 0-1% for 75 of the default run's 150 steps and ended at 24% (26% of the gap; benchmarks/results/
default_recipe.md): the teacher's per-token signal only helps once the student plays turns near the teacher's. SFT on
the teacher's episodes gives it those turns (pure OPD from cold p@1 0.005, SFT 0.388 in the published cold-start
comparison); quality_gpu.md's best OPD arm is "SFT for a third of the steps, then OPD" (80% against 54% for plain OPD).

The rule: cold = held-out success below COLD_SHARE of the teacher's. Then the first third of the steps are SFT
(`recipe.sft_steps`, written into the run's config.yaml so a resume keeps it), then the run's objective. Where it
applies: the embedded student on one env, objective=opd, no recipe where the teacher plays already, a teacher that
can play (no server, no cross-tokenizer loss, no privileged prompt), not async, the teacher evaluated at step 0
(eval.teacher). Anywhere else a run trains what its config says, as before (`recipe.sft_steps` by hand).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentopd.models import BUILTIN
from agentopd.objectives import Objective
from agentopd.teacher.base import is_server
from agentopd.trainer.config import LossKind

if TYPE_CHECKING:
    from agentopd.config import Config
    from agentopd.evaluate import EvalResult

COLD_SHARE = 0.05  # cold: the student solves under 1/20 of what the teacher solves (built-in sql_db: 8-10% of 66-75%)
SFT_SHARE = 3  # a cold student's SFT steps: run.steps // SFT_SHARE


@dataclass(frozen=True)
class WarmStart:
    steps: int  # SFT steps before the run's objective; 0 = none
    student: float  # the student's held-out success at step 0
    teacher: float  # the teacher's
    parse_errors: float  # the student's malformed tool calls per turn at step 0
    total: int  # run.steps

    def line(self) -> str:
        seen = (f"student {self.student:.0%} of held-out tasks (parse errors in {self.parse_errors:.0%} of its turns), "
                f"teacher {self.teacher:.0%}")  # fmt: skip
        if self.steps:
            first = "step 1" if self.steps == 1 else f"steps 1-{self.steps}"
            return (f"warm start: {seen}: the student is cold (under {COLD_SHARE:.0%} of the teacher's success), so {first} "
                    f"of {self.total} train on the teacher's episodes (SFT), then on-policy distillation "
                    "(recipe.sft_steps in config.yaml; recipe.auto_warm_start=false for plain OPD)")  # fmt: skip
        return f"warm start: none, {seen}: the student is not cold, plain on-policy distillation (recipe.auto_warm_start=false: never)"


def applies(cfg: Config) -> bool:
    """Whether `recipe.auto_warm_start` chooses for this run (the module docstring says where)."""
    r = cfg.recipe
    return (
        r.auto_warm_start
        and cfg.student.path == BUILTIN
        and not cfg.mix.envs
        and cfg.run.objective == Objective.OPD
        and not (r.sft_steps or r.teacher_fraction or r.intervene_below is not None)
        and cfg.teacher.privileged is None
        and not is_server(cfg.teacher.path)
        and not LossKind(cfg.trainer.loss).is_cross_tokenizer
        and not cfg.async_.enabled
        and cfg.eval.teacher
        and cfg.run.steps // SFT_SHARE > 0
    )


def choose_warm_start(cfg: Config, student: EvalResult, teacher: EvalResult | None) -> WarmStart | None:
    """The warm start of a run from its step-0 evals; None where the rule does not apply (`applies`)."""
    if teacher is None or not applies(cfg):
        return None
    cold = student.success_rate < COLD_SHARE * teacher.success_rate
    return WarmStart(cfg.run.steps // SFT_SHARE if cold else 0, student.success_rate, teacher.success_rate,
                     student.parse_error_rate, cfg.run.steps)  # fmt: skip
