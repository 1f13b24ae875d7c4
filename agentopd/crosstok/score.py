"""Teacher scoring through the alignment: the stage a cross-tokenizer loss runs instead of plain scoring.

    scorer = CrossScorer(student_tok, {"teacher": teacher_tok}, full=False)
    projected, metrics = scorer.score(backend, episodes, teacher_of, mode)
    projected[i].train    # TeacherScores on the student's tokens (what the trainer takes)
    projected[i].store    # per-token teacher log-probs for trajectories.db and the viewer

Each episode is re-rendered in its teacher's chat template and aligned (align.py), the teacher scores its own
stream through the backend, and the span scores come back onto the student's tokens (project.py). With the
full-distribution loss (xtok_full) each teacher's vocabulary map onto the student's is built once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from agentopd.crosstok.align import align_episode, token_bytes
from agentopd.crosstok.project import Projected, cross_metrics, project
from agentopd.recipes.base import Recipe, Stage
from agentopd.types import TEMPLATE_KWARGS

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from agentopd.backends.base import Backend
    from agentopd.step.values import Played, Scored, StepParts
    from agentopd.teacher import TeacherMode
    from agentopd.types import Episode


class CrossScorer:
    def __init__(self, student: PreTrainedTokenizerBase, teachers: dict[str, PreTrainedTokenizerBase], *, full: bool):
        self.student, self.teachers, self.full = student, teachers, full
        self._maps: dict[str, torch.Tensor] = {}  # teacher name -> its vocabulary map onto the student's

    def vocab_map(self, name: str) -> torch.Tensor:
        """Teacher id -> student id of the same bytes (xtok_full), built once per teacher."""
        from agentopd.losses.crosstok import vocab_map

        if name not in self._maps:
            self._maps[name] = vocab_map(token_bytes(self.student), token_bytes(self.teachers[name]))[0]
        return self._maps[name]

    def score(self, backend: Backend, episodes: Sequence[Episode], teacher_of: Sequence[str],
              mode: TeacherMode) -> tuple[list[Projected], dict[str, float]]:  # fmt: skip
        """The episodes' projected scores, in order, and the step's alignment metrics."""
        from agentopd.backends.stages import score_episodes

        aligned = [align_episode(ep, self.student, self.teachers[name], ep.info.get(TEMPLATE_KWARGS))
                   for ep, name in zip(episodes, teacher_of)]  # fmt: skip
        t_scores = score_episodes(backend, list(teacher_of), [al.teacher_stream for al in aligned], mode)
        maps = {name: self.vocab_map(name) for name in set(teacher_of)} if self.full else {}
        projected = [project(al, ep.tokens, sc, maps.get(name)) for al, ep, sc, name in zip(aligned, episodes, t_scores, teacher_of)]
        return projected, cross_metrics(aligned, projected)


class CrossTokenizer(Recipe):
    """A cross-tokenizer loss (`trainer.loss=xtok_*`) as a recipe of the score stage: the teachers score the episodes
    re-rendered in their own templates, projected onto the student's tokens (the store keeps the projection of the
    sampled tokens; the trainer reads the loss's); the step's alignment metrics (`xtok/*`) come with them. The teacher's
    own streams differ in length: its FLOPs are counted at the student's (an approximation, agentopd.flops)."""

    name = "cross_tokenizer"
    stages = frozenset({Stage.SCORE})
    scores_played_streams = False

    def __init__(self, scorer: CrossScorer):
        self.scorer = scorer

    def score(self, played: Played, parts: StepParts) -> Scored:
        from agentopd.step.values import Scored

        scored = [(name, len(e.tokens.token_ids)) for name, e in zip(played.teacher_of, played.episodes)]
        with parts.phases("teacher"):
            projected, metrics = self.scorer.score(parts.backend, played.episodes, played.teacher_of, parts.mode)
        return Scored(scores=[xs.train for xs in projected], stored=[xs.store for xs in projected], scored=scored, metrics=metrics)
