"""The embedded default's warm start (`recipe.auto_warm_start`, issue 54): from the step-0 evals, SFT on the teacher's
episodes first when the student is cold, plain OPD when it is not.

    choice = choose_warm_start(cfg, student=before, teacher=teacher_eval)   # WarmStart, or None: the rule does not apply
    choice.steps      # SFT steps before the run's objective (recipe.sft_steps); 0 = plain OPD
    choice.line()     # what the run prints: what it chose and why

Cold = both of: held-out success under COLD_SHARE of the teacher's, and malformed tool calls in at least FORMAT_ERRORS
of its turns (it has not learned the format). Then the first third of the steps are SFT (`recipe.sft_steps`, written
into the run's config.yaml so a resume keeps it), then the run's objective.

Why both (benchmarks/results/default_recipe.md, 2026-11-29): plain OPD from a cold student can stall (issue 54: on a
plugin env a 1% student under an 86% teacher stayed at 0-1% for 75 of 150 steps; pure OPD from cold p@1 0.005, SFT on
the teacher's episodes 0.388 in the published cold-start comparison), and the SFT warm start is the remedy recipes.md
gives for a student that does not know the format. But low success alone does not make it stall: calculator's
student solves 1% of held-out tasks under an 89% teacher with no parse errors, and plain OPD took it to 61% (68% of
the gap), the warm start to 54% on the same pair. The one student this rule called cold (stock_shelves, 1% of an 86%
teacher, 27% malformed turns) reached 20% with the warm start; what it lacked was the format, which the bootstrap
now checks before it hands a student over (agentopd.bootstrap, `SFTSpec.format_gate`): that env's checked student
went 1% -> 91% under plain OPD, so a fresh bootstrap no longer yields this rule's cold case, and it stays off by default.

Where it applies: the embedded student on one env, objective=opd, no recipe where the teacher plays already, a teacher
that can play (no server, no cross-tokenizer loss, no privileged prompt), not async, the teacher evaluated at step 0
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

COLD_SHARE = 0.05  # cold: the student solves under 1/20 of what the teacher solves (built-in sql_db: 5-10% of 66-75%) ...
FORMAT_ERRORS = 0.1  # ... and writes a malformed tool call in at least 1 of 10 turns (sql_db 2%, calculator 0%)
SFT_SHARE = 3  # a cold student's SFT steps: run.steps // SFT_SHARE


@dataclass(frozen=True)
class WarmStart:
    steps: int  # SFT steps before the run's objective; 0 = none
    student: float  # the student's held-out success at step 0
    teacher: float  # the teacher's
    parse_errors: float  # the student's malformed tool calls per turn at step 0
    total: int  # run.steps

    def line(self) -> str:
        seen = (f"student {self.student:.0%} of held-out tasks (teacher {self.teacher:.0%}), parse errors in "
                f"{self.parse_errors:.0%} of its turns")  # fmt: skip
        if self.steps:
            first = "step 1" if self.steps == 1 else f"steps 1-{self.steps}"
            return (f"warm start: {seen}: cold (under {COLD_SHARE:.0%} of the teacher's success, and not yet the format), so "
                    f"{first} of {self.total} train on the teacher's episodes (SFT), then on-policy distillation "
                    "(recipe.sft_steps in config.yaml; recipe.auto_warm_start=false for plain OPD)")  # fmt: skip
        if self.student >= COLD_SHARE * self.teacher:
            why = f"at least {COLD_SHARE:.0%} of the teacher's success"
        else:
            why = f"it writes well-formed tool calls: parse errors under {FORMAT_ERRORS:.0%}"
        return f"warm start: none, {seen}: not cold ({why}): plain on-policy distillation"


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
    cold = student.success_rate < COLD_SHARE * teacher.success_rate and student.parse_error_rate >= FORMAT_ERRORS
    return WarmStart(cfg.run.steps // SFT_SHARE if cold else 0, student.success_rate, teacher.success_rate,
                     student.parse_error_rate, cfg.run.steps)  # fmt: skip
