"""Truncated-horizon OPD (`recipe.horizon_turns: [start, end]`): train on the first k turns of each episode, k growing.

    k = horizon(step, steps=300, start=1, end=4)        # 1 for the first quarter of the steps, ... 4 for the last
    config = horizon_rollout(rollout_cfg, k)            # the training rollouts of that step stop after k turns
    Horizon(steps=300, start=1, end=4)                  # the recipe (agentopd.recipes.base): play stage + horizon/turns

A long episode's late turns cost the most: every token is generated and scored after the whole conversation before
it, and their states are the furthest from anything the student has learned. Early in training the student's late
turns mostly follow its early mistakes, so their teacher signal is worth least. Training episodes are played only
to k assistant turns (an episode still ends earlier on an answer): the student's states at turns < k are exactly
those of a full episode (the policy that reaches them is the same), so training on them is training on the first
k turns of full episodes, without generating or scoring the rest. k steps up from `start` at step 1 to `end` in
equal shares of the run, so the last share trains on `end` turns (set it to rollout.max_turns for whole episodes at
the end). The episodes cut at k stop with `max_turns` and no reward; evals always play whole episodes.
The loss mask needs nothing more: the streams hold no turn >= k.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from agentopd.recipes.base import Recipe, Stage
from agentopd.rollout import RolloutConfig

if TYPE_CHECKING:
    from agentopd.step.values import Played


def horizon(step: int, *, steps: int, start: int, end: int) -> int:
    """The turn horizon at training step `step` (1-based) of `steps`: start, start + 1, ..., end, each for an equal
    share of the steps (the first share gets the remainder's rounding)."""
    assert 1 <= start <= end and steps >= 1, (start, end, steps)
    return start + (end - start + 1) * (min(step, steps) - 1) // steps


def horizon_rollout(config: RolloutConfig, k: int) -> RolloutConfig:
    """The rollout settings of a training step with horizon k: at most k assistant turns."""
    return replace(config, max_turns=min(k, config.max_turns))


@dataclass
class Horizon(Recipe):
    """`recipe.horizon_turns`: each step's training episodes played to its horizon k; `horizon/turns` reports k."""

    steps: int
    start: int
    end: int
    name = "horizon_turns"
    stages = frozenset({Stage.PLAY, Stage.REPORT})

    def turns(self, step: int) -> int:
        return horizon(step, steps=self.steps, start=self.start, end=self.end)

    def rollout(self, step: int, config: RolloutConfig) -> RolloutConfig:
        return horizon_rollout(config, self.turns(step))

    def report(self, played: Played) -> dict[str, float]:
        return {"horizon/turns": float(self.turns(played.step))}
