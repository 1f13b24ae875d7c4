"""Per-turn reliability weights (`recipe.turn_support_below`): TCAD's teacher confidence, per turn.

    weights, support = turn_weights(stream, teacher_logprobs, below=0.3, floor=0.1)
    metrics = turn_weight_metrics([support, ...], below=0.3, floor=0.1)
    TurnWeights(below=0.3, floor=0.1)          # the recipe (agentopd.recipes.base): the samples stage's weights

A turn's *support* is the mean teacher probability of the student's tokens of that turn (exp of the
teacher's log-prob of each sampled token). Where it is low the student has left the states the teacher
knows: the teacher's distribution there is a guess about a context it never produces, and pulling the
student toward it teaches noise. A turn with support s below the threshold b gets loss weight
max(floor, s / b) on every one of its tokens; turns at or above b keep weight 1. Tool-output tokens
carry no loss and get 1.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentopd.recipes.base import Recipe, Stage
from agentopd.types import Episode, TokenStream

if TYPE_CHECKING:
    from agentopd.teacher import TeacherScores


def turn_support(stream: TokenStream, teacher_logprobs: Sequence[float]) -> dict[int, float]:
    """Turn -> mean teacher probability of the student's tokens of that turn (turns with student tokens only)."""
    sums: dict[int, float] = defaultdict(float)
    counts: dict[int, int] = defaultdict(int)
    for m, lp, turn in zip(stream.response_mask, teacher_logprobs, stream.turn_index):
        if m:
            sums[turn] += math.exp(lp)
            counts[turn] += 1
    return {turn: sums[turn] / counts[turn] for turn in sorted(counts)}


def weight_of(support: float, below: float, floor: float) -> float:
    return 1.0 if support >= below else max(floor, support / below)


def turn_weights(stream: TokenStream, teacher_logprobs: Sequence[float], *, below: float, floor: float) -> tuple[list[float], dict[int, float]]:
    """Per response token loss weights (the turn's weight) and the per-turn support they came from."""
    if len(teacher_logprobs) != len(stream.response_mask):
        raise ValueError(f"teacher_logprobs has {len(teacher_logprobs)} entries for {len(stream.response_mask)} response tokens")
    support = turn_support(stream, teacher_logprobs)
    weight = {turn: weight_of(s, below, floor) for turn, s in support.items()}
    return [weight.get(turn, 1.0) if m else 1.0 for m, turn in zip(stream.response_mask, stream.turn_index)], support


def turn_weight_metrics(supports: Sequence[dict[int, float]], *, below: float, floor: float) -> dict[str, float]:
    """`turn_weight/mean` and `turn_weight/downweighted` (share of student turns below the threshold) over
    the step's turns; per turn k (0-based, as `kl/turn_<k>`): `turn_weight/turn_k` (mean weight)
    and `turn_support/turn_k` (mean support)."""
    by_turn: dict[int, list[float]] = defaultdict(list)
    for support in supports:
        for turn, s in support.items():
            by_turn[turn].append(s)
    every = [s for values in by_turn.values() for s in values]
    if not every:
        return {}
    out = {
        "turn_weight/mean": sum(weight_of(s, below, floor) for s in every) / len(every),
        "turn_weight/downweighted": sum(s < below for s in every) / len(every),
    }
    for turn, values in sorted(by_turn.items()):
        out[f"turn_weight/turn_{turn}"] = sum(weight_of(s, below, floor) for s in values) / len(values)
        out[f"turn_support/turn_{turn}"] = sum(values) / len(values)
    return out


def step_turn_weights(streams: Sequence[TokenStream], teacher_logprobs: Sequence[Sequence[float]], *, below: float,
                      floor: float) -> tuple[list[list[float]], dict[str, float]]:  # fmt: skip
    """A step's per-token loss weights, one list per stream (scored by `teacher_logprobs` in the same order), and
    the step's recipe/turn_* metrics."""
    weighed = [turn_weights(s, lp, below=below, floor=floor) for s, lp in zip(streams, teacher_logprobs, strict=True)]
    return [w for w, _ in weighed], turn_weight_metrics([sup for _, sup in weighed], below=below, floor=floor)



@dataclass
class TurnWeights(Recipe):
    """`recipe.turn_support_below` (with `recipe.turn_weight_floor`): the samples stage's per-token weights."""

    below: float
    floor: float
    name = "turn_support_below"
    stages = frozenset({Stage.SAMPLES})

    def weights(self, episodes: Sequence[Episode], scores: Sequence[TeacherScores]) -> tuple[list[list[float]], dict[str, float]]:
        return step_turn_weights([e.tokens for e in episodes], [sc.logprobs for sc in scores], below=self.below, floor=self.floor)
