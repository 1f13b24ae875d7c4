"""Eval steps: greedy success on held-out tasks (`eval.every`, before training and at the end), the student's and,
before training, each task's teacher's (`eval.teacher`).

    evals = Evals(parts, engines, eval_rollout_cfg, flops)
    result, record = evals(step, with_teacher=False)     # EvalResult, the eval/* and flops/eval_* metrics
    evals.teacher                                        # the teacher's EvalResult (its last eval)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentopd.backends.stages import STUDENT, OnEpisode
from agentopd.evaluate import EvalResult, summarise
from agentopd.flops import played_flops
from agentopd.step.play import by_teacher, collect

if TYPE_CHECKING:
    from agentopd.plan import Planned
    from agentopd.rollout import RolloutConfig
    from agentopd.step.play import StudentEngines
    from agentopd.step.values import StepParts
    from agentopd.types import Episode


class Evals:
    def __init__(self, parts: StepParts, engines: StudentEngines, rollout_cfg: RolloutConfig, label: str):
        self.parts = parts
        self.engines = engines
        self.rollout_cfg = rollout_cfg  # the run's rollout settings at eval.temperature
        self.label = label  # the run's env label (one env, or a mixture's sources joined by commas)
        self.teacher: EvalResult | None = None

    def __call__(self, step: int, *, with_teacher: bool) -> tuple[EvalResult, dict[str, float]]:
        parts = self.parts
        shapes = parts.shapes

        def store_eval(p: Planned, ep: Episode) -> None:
            parts.store.add(ep, p.spec.episode_id, split="eval")

        self.engines.refresh(as_phase=True)
        with parts.phases("eval"):
            planned, episodes = self._play(step, False, store_eval)
            result, per_source = self._summarise(planned, episodes, "eval")
            flops = {"flops/eval_student": played_flops(episodes, shapes[STUDENT])}
            teacher_per_source: dict[str, float] = {}
            if with_teacher:
                t_planned, t_episodes = self._play(step, True)
                self.teacher, teacher_per_source = self._summarise(t_planned, t_episodes, "eval/teacher")
                flops["flops/eval_teacher"] = sum(played_flops([e], shapes[parts.router.teacher_of(p, "eval")])
                                                  for p, e in zip(t_planned, t_episodes))  # fmt: skip
        record = {"eval/success_rate": result.success_rate, "eval/mean_turns": result.mean_turns,
                  "eval/tool_error_rate": result.tool_error_rate, "eval/parse_error_rate": result.parse_error_rate, **per_source}  # fmt: skip
        if with_teacher and self.teacher is not None:
            record["eval/teacher_success_rate"] = self.teacher.success_rate
            record |= teacher_per_source
        return result, record | flops

    def _play(self, step: int, teachers_play: bool, on_episode: OnEpisode | None = None) -> tuple[list[Planned], list[Episode]]:
        parts, cfg = self.parts, self.parts.cfg
        planned = parts.mixture.eval_plan(step, num_tasks=cfg.eval.num_tasks, seed=cfg.run.seed)
        if teachers_play:
            groups = by_teacher(parts, planned, split="eval")
            handles = [parts.backend.submit_rollout(g, self.rollout_cfg, who) for who, g in groups.items()]
        else:
            handles = [parts.backend.submit_rollout(planned, self.rollout_cfg, STUDENT)]
        return collect(parts, handles, on_episode)

    def _summarise(self, planned: list[Planned], episodes: list[Episode], prefix: str) -> tuple[EvalResult, dict[str, float]]:
        result = summarise(self.label, "eval", 1, episodes)
        per_source = {}
        if self.parts.mixture.mixed:
            for source in self.parts.mixture.sources:
                mine = [e for p, e in zip(planned, episodes) if p.source == source]
                per_source[f"{prefix}/{source}/success_rate"] = summarise(source, "eval", 1, mine).success_rate if mine else 0.0
        return result, per_source
