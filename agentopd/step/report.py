"""The report stage: a step's metrics (docs/design.md 3.6) from the values its stages returned.

    flops = FlopsMeter(shapes)                  # the run's flops/*_cum, continued on resume (FlopsMeter.resume)
    metrics = report(played, scored, samples, trained, synced, parts, flops)

In this order: the trainer's, the recipes' (turn weights, alignment, teacher episodes, horizon), what the teacher
cost, the episodes' diagnostics (the student's own episodes: kl/*, tool/*, num_turns/*, success_rate[/<source>]),
the phases' timings and throughput, async mode's, the backend's (ray/*, perf/weight_*), the phases' memory (mem/*)
and the compute spent (flops/*).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from agentopd.backends.stages import STUDENT
from agentopd.diagnostics import phase_metrics, step_metrics, teacher_work
from agentopd.flops import step_flops

if TYPE_CHECKING:
    from agentopd.shape import ModelShape
    from agentopd.step.values import Played, Samples, Scored, StepParts, Synced, Trained


class FlopsMeter:
    """A step's `flops/*` and the run's totals so far (`flops/teacher_cum`, `flops/student_cum`)."""

    def __init__(self, shapes: dict[str, ModelShape | None]):
        self.shapes = shapes  # student and teachers by name (None: a server teacher)
        self.cum = {"teacher": 0.0, "student": 0.0}

    def resume(self, records: Iterable[dict[str, float]]) -> None:
        """The totals of the steps a resumed run keeps (their metrics records)."""
        self.cum = {"teacher": 0.0, "student": 0.0}
        for record in records:
            for who in self.cum:
                self.cum[who] += record.get(f"flops/{who}", 0.0)

    def step(self, played: Played, scored: Scored, samples: Samples, *, guides: bool, guide_score: float) -> dict[str, float]:
        shapes = self.shapes
        by_teacher = [played.objective.teacher_plays or p.spec.episode_id in played.teacher_played for p in played.planned]
        players = [shapes[name] if t else shapes[STUDENT] for name, t in zip(played.teacher_of, by_teacher)]
        guided = [shapes[name] if guides else None for name in played.teacher_of]
        out = step_flops(played.episodes, players, by_teacher, guided, student=shapes[STUDENT],
                         scored=[(shapes[name], n) for name, n in scored.scored],
                         train_lengths=[len(s.token_ids) for s in samples.samples])  # fmt: skip
        out["flops/teacher_score"] += guide_score
        out["flops/teacher"] += guide_score
        for who in self.cum:
            self.cum[who] += out[f"flops/{who}"]
            out[f"flops/{who}_cum"] = self.cum[who]
        return out


def report(played: Played, scored: Scored, samples: Samples, trained: Trained, synced: Synced, parts: StepParts,
           flops: FlopsMeter) -> dict[str, float]:  # fmt: skip
    episodes, planned = played.episodes, played.planned
    metrics = dict(trained.metrics) | samples.metrics | scored.metrics
    for recipe in parts.recipes:
        metrics |= recipe.report(played)
    metrics |= teacher_work(episodes, scored=scored.scores is not None, teacher_plays=played.objective.teacher_plays)
    own = [i for i, p in enumerate(planned) if p.spec.episode_id not in played.teacher_played]  # what the diagnostics describe
    if own:
        mine = [episodes[i] for i in own]
        single = parts.router.single or scored.scores is None
        metrics |= step_metrics(mine, tool_names=sorted({t["function"]["name"] for e in mine for t in e.tools}),
                                teacher_keys=None if single else [played.teacher_of[i] for i in own])  # fmt: skip
        if parts.mixture.mixed:
            for source in parts.mixture.sources:
                of_source = [episodes[i] for i in own if planned[i].source == source]
                if of_source:
                    metrics[f"success_rate/{source}"] = sum(e.success for e in of_source) / len(of_source)
    metrics |= phase_metrics(episodes, rollout_s=played.seconds, teacher_s=scored.seconds, sync_s=synced.seconds)
    metrics |= played.metrics
    if scored.ahead is not None:
        metrics["async/scored_ahead"] = scored.ahead
    metrics |= parts.backend.stats() | parts.phases.take_memory()
    guides = any(r.teacher_takes_turns for r in parts.recipes)
    metrics |= flops.step(played, scored, samples, guides=guides, guide_score=metrics.get("flops/teacher_guide_score", 0.0))
    return metrics
