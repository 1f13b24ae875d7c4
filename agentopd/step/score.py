"""The score stage: the teachers' scores of a step's episodes (and of their branches), written to the store.

    scored = score(played, parts)      # Scored (agentopd.step.values); scores None where the step's objective scores none

Each episode is scored by the teacher the router picked (`played.teacher_of`), then each branch (a student turn
recipe.intervene_below replaced) by its episode's teacher. A recipe of the score stage may change what the teacher
reads (`Recipe.streams`: teacher.privileged) or score another way (`Recipe.score`: a cross-tokenizer loss, or the
scores the backend started ahead, `ScoreAhead` below: async.score_ahead).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from collections.abc import Sequence

from agentopd.backends.stages import score_episodes
from agentopd.recipes.base import Recipe, Stage
from agentopd.step.values import Played, Scored

if TYPE_CHECKING:
    from agentopd.backends.base import RolloutHandle
    from agentopd.objectives import Objective
    from agentopd.step.values import StepParts


def score(played: Played, parts: StepParts) -> Scored:
    t = time.perf_counter()
    scored = _score(played, parts)
    if scored.scores is not None:
        with parts.store.batch():  # one transaction: the scores arrive together
            for p, ep, logprobs in zip(played.planned, played.episodes, scored.stored):
                ep.teacher_logprobs = logprobs
                parts.store.set_teacher_logprobs(p.spec.episode_id, logprobs, ep.tokens)
    scored.seconds = time.perf_counter() - t
    scored.ahead = (scored.ahead or 0.0) if parts.cfg.async_.enabled else None  # async/scored_ahead: async mode only
    return scored


def _score(played: Played, parts: StepParts) -> Scored:
    if not played.objective.scores or not played.episodes:
        parts.backend.forget(played.collected)
        return Scored()
    for recipe in parts.recipes:
        if (other := recipe.score(played, parts)) is not None:
            return other
    episodes, teacher_of = played.episodes, played.teacher_of
    own = [e.tokens for e in episodes]
    for recipe in parts.recipes:  # teacher.privileged: the same response tokens after the privileged prompt
        own = recipe.streams(played.planned, episodes) or own
    streams = own + [b for e in episodes for b in e.branches]
    teachers = [*teacher_of, *(name for e, name in zip(episodes, teacher_of) for _ in e.branches)]
    with parts.phases("teacher"):
        scores = score_episodes(parts.backend, teachers, streams, parts.mode)
    return Scored(scores=scores, stored=[sc.logprobs for sc in scores[: len(episodes)]],
                  scored=[(name, len(s.token_ids)) for name, s in zip(teachers, streams)])  # fmt: skip


class ScoreAhead(Recipe):
    """`async.score_ahead` (async mode, Ray) as a recipe of the play and score stages: each rollout's scoring starts
    on the backend as it is submitted (`Backend.score_ahead`: its episodes go to their teachers as they are played),
    and the score stage takes those scores (those missing, an actor having died, scored now). Only where the teacher
    scores the streams as played: the run has no recipe that changes what it reads (`scores_played_streams`). When the
    backend has no scores ahead for the step (its episodes changed: staleness), the plain stage scores them."""

    name = "score_ahead"
    stages = frozenset({Stage.PLAY, Stage.SCORE})

    def submitted(self, objective: Objective, handles: Sequence[RolloutHandle], parts: StepParts) -> None:
        if objective.scores:
            for h in handles:
                parts.backend.score_ahead(h, [parts.router.teacher_of(p) for p in h.planned], parts.mode)

    def score(self, played: Played, parts: StepParts) -> Scored | None:
        streams, teacher_of = [e.tokens for e in played.episodes], played.teacher_of
        with parts.phases("teacher"):
            ahead = [parts.backend.ahead_scores(h) for h in played.collected]
            if not ahead or any(a is None for a in ahead) or sum(map(len, ahead)) != len(streams):
                return None  # the plain stage scores them
            scores = [sc for a in ahead for sc in a]
            missing = [i for i, sc in enumerate(scores) if sc is None]
            late = score_episodes(parts.backend, [teacher_of[i] for i in missing], [streams[i] for i in missing], parts.mode) if missing else []
            for i, sc in zip(missing, late, strict=True):
                scores[i] = sc
        return Scored(scores=scores, stored=[sc.logprobs for sc in scores],
                      scored=[(name, len(s.token_ids)) for name, s in zip(teacher_of, streams)], ahead=1 - len(missing) / len(scores))  # fmt: skip
