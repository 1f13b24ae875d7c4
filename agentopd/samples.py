"""A step's training samples: its episodes and what their teachers returned, as TrainSamples for the trainer.

    samples = train_samples(planned, episodes, scores, token_weights, teacher_index)

An episode's sample carries its stream, its teacher's scores (logprobs, top-k or hidden states: whichever
the loss needs), its reward and its GRPO group (the episodes of one task in one step), a per-token loss weight
(recipe.turn_support_below) and which of the step's teachers scored it (`teacher_index`: whose lm_head applies).
The student turns a guide replaced (`Episode.branches`, recipe.intervene_below) follow as samples of their own,
scored in the same order after the episodes. Samples without a student token are dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentopd.batch import TrainSample

if TYPE_CHECKING:
    from agentopd.plan import Planned
    from agentopd.teacher import TeacherScores
    from agentopd.types import Episode, TokenStream


def train_samples(planned: list[Planned], episodes: list[Episode], scores: list[TeacherScores] | None,
                  token_weights: list[list[float]] | None = None, teacher_index: list[int] | None = None) -> list[TrainSample]:  # fmt: skip
    """`scores`: one per episode, then one per branch (None: unscored, e.g. GRPO). `teacher_index[i]`: which of the
    step's teachers scored episode i; the branches are scored by the run's one teacher."""
    group = {key: i for i, key in enumerate(dict.fromkeys((p.source, p.spec.task_id) for p in planned))}
    samples = []
    for i, (p, ep) in enumerate(zip(planned, episodes)):
        samples.append(sample(ep.tokens, scores[i] if scores is not None else None, reward=ep.reward,
                              group_id=group[p.source, ep.task_id],
                              token_weights=token_weights[i] if token_weights is not None else None,
                              teacher_index=teacher_index[i] if teacher_index else 0))  # fmt: skip
    samples += _branch_samples(episodes, scores[len(episodes) :] if scores is not None else None, first_group=len(group))
    return [s for s in samples if s.num_student_tokens > 0]


def _branch_samples(episodes: list[Episode], scores: list[TeacherScores] | None, first_group: int) -> list[TrainSample]:
    """The student turns a guide replaced, scored by `scores` in the same order. Each is a group of its own: its
    episode's outcome came after the teacher's turn, so a branch carries no task-reward signal (a group of one:
    GRPO advantage 0, reward weight 1)."""
    branches = [(ep, b) for ep in episodes for b in ep.branches]
    return [sample(b, scores[j] if scores is not None else None, reward=ep.reward, group_id=first_group + j)
            for j, (ep, b) in enumerate(branches)]  # fmt: skip


def sample(stream: TokenStream, sc: TeacherScores | None, *, reward: float, group_id: int,
           token_weights: list[float] | None = None, teacher_index: int = 0) -> TrainSample:  # fmt: skip
    """One stream and what its teacher returned for it (None: unscored) as a TrainSample."""
    return TrainSample.from_stream(
        stream,
        teacher_logprobs=sc.logprobs if sc else None,
        teacher_topk_ids=sc.topk_ids if sc else None,
        teacher_topk_logprobs=sc.topk_logprobs if sc else None,
        teacher_hidden=sc.hidden if sc else None,
        reward=reward,
        group_id=group_id,
        token_weights=token_weights,
        teacher_index=teacher_index,
    )
