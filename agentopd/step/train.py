"""The samples, train and sync stages: a step's episodes and scores become training samples, one optimizer step,
the new weights in the student's engines.

    samples = prepare(played, scored, parts)     # Samples: samples, the teachers' heads, the step's loss
    trained = train(samples, parts)              # Trained: the trainer's metrics
    synced = sync(played, parts, engines)        # Synced

A recipe of the samples stage weighs each token (`Recipe.weights`: recipe.turn_support_below); one of the train
stage replaces the trainer's loss for a step (`Recipe.train_loss`: the SFT warm start, at its own temperature).
After a step the teacher played (objective=sft) the student's engines are synced only before the student plays.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from agentopd.samples import train_samples
from agentopd.step.values import Played, Samples, Scored, Synced, Trained

if TYPE_CHECKING:
    from agentopd.step.play import StudentEngines
    from agentopd.step.values import StepParts


def prepare(played: Played, scored: Scored, parts: StepParts) -> Samples:
    weights, metrics = None, {}
    if scored.scores is not None:
        for recipe in parts.recipes:
            if (weighed := recipe.weights(played.episodes, scored.scores)) is not None:
                weights, metrics = weighed
    keys = list(dict.fromkeys(played.teacher_of))  # the step's teachers; a sample's teacher_index points into them
    heads = [parts.backend.teacher_head(k) for k in keys] if scored.scores and scored.scores[0].hidden is not None else None
    loss = next((own for r in parts.recipes if (own := r.train_loss(played.step)) is not None), None)
    samples = train_samples(played.planned, played.episodes, scored.scores, weights, [keys.index(k) for k in played.teacher_of])
    return Samples(samples, heads, loss=loss[0] if loss else None, temperature=loss[1] if loss else None, metrics=metrics)


def train(samples: Samples, parts: StepParts) -> Trained:
    with parts.phases("train"):
        metrics = parts.backend.train(samples.samples, samples.heads, loss=samples.loss, temperature=samples.temperature)
    return Trained(dict(metrics))


def sync(played: Played, parts: StepParts, engines: StudentEngines) -> Synced:
    t = time.perf_counter()
    parts.phases.enter("sync")
    if played.objective.teacher_plays:
        engines.stale = True  # synced before the student next plays (evals, or after the warm start)
    else:
        parts.backend.sync_weights()
    return Synced(time.perf_counter() - t)
