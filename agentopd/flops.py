"""Compute accounting: the FLOPs a run spends, per model and per role, from the models' shapes and the token streams.

    shape = ModelShape.from_ref(ref)   # agentopd.shape: one record per model, its one parameter count
    shape.forward(length)            # one forward over a causal sequence of `length` tokens (a prefill)
    shape.forward(length, start=s)   # the tokens s..length-1 of it, the first s already in a KV cache (decode)
    shape.train(length)              # forward + backward: 3 x forward

What is counted (per token at position p, 0-based, attending to p + 1 keys; everything multiply-add = 2 FLOPs):
    2 x N                          N = every parameter except the input embedding table, plus the output head's
                                   V x H (its matmul runs at every position, tied to the embedding or not)
    4 x layers x d_attn x (p + 1)  attention scores (QK^T) and the weighted sum of values (AV), d_attn = heads x head_dim
Left out: norms' and activations' elementwise work, softmax, rotary embeddings (each O(H) per token, against O(H^2)).
So a causal forward over T tokens is 2·N·T + 2·layers·d_attn·T·(T+1), and a training step over a sequence is 3x its
forward (the backward costs two forwards). Prefix sharing, padding and recomputation (gradient checkpointing, an
engine that re-prefills) are not counted: these are the FLOPs the work needs, not what a kernel happened to run.

How a run spends them (agentopd.step.report, the `flops/*` metrics of docs/design.md 3.6):
    flops/teacher_score        the teacher's forward over every stream it scored (prefill cost), branches included,
                               plus `flops/teacher_guide_score` (recipe.intervene_below: each student turn it judged)
    flops/teacher_generate     the episodes the teacher played (objective=sft, recipe.teacher_fraction,
                               recipe.sft_steps): one forward over each whole stream (its prompt and observations
                               prefilled, its tokens decoded with a KV cache); and each turn it took over
                               (recipe.intervene_below): its prefix prefilled and the turn decoded
    flops/student_rollout      the episodes the student played, the same way; its rejected turns (branches) decoded
    flops/student_train        3 x forward over every training sample
    flops/teacher, flops/student   the step's sums; flops/teacher_cum, flops/student_cum the run's so far
    flops/eval_student, flops/eval_teacher   the eval episodes (not part of the training budgets above)
A server teacher (no config here) costs 0 in these; a cross-tokenizer teacher's streams are counted at the student's
lengths (its own re-rendering of an episode is close to it, not equal); a privileged teacher's at its own (longer).
"""

from __future__ import annotations

from collections.abc import Sequence
from agentopd.shape import ModelShape
from agentopd.types import INTERVENED_TOKENS, Episode

__all__ = ["ModelShape", "played_flops", "step_flops"]


def step_flops(
    episodes: Sequence[Episode],
    players: Sequence[ModelShape | None],
    by_teacher: Sequence[bool],
    guides: Sequence[ModelShape | None],
    *,
    student: ModelShape,
    scored: Sequence[tuple[ModelShape | None, int]],
    train_lengths: Sequence[int],
) -> dict[str, float]:
    """One step's `flops/*` (module docstring) but the cumulative ones. Per episode: the shape of who played it
    (`players[i]`, the teacher's when `by_teacher[i]`, else the student's) and of the teacher that took over its
    turns (`guides[i]`, recipe.intervene_below); `scored`: (teacher shape, length) of every stream a teacher
    scored; `train_lengths`: every training sample's length. A shape of None (a server teacher: no config here)
    costs nothing."""
    assert len(episodes) == len(players) == len(by_teacher) == len(guides)
    score = sum(shape.forward(n) for shape, n in scored if shape is not None)
    generate = rollout = 0.0
    for ep, player, teacher_played, guide in zip(episodes, players, by_teacher, guides):
        if ep.tokens is None:
            continue
        whole = player.forward(len(ep.tokens.token_ids)) if player is not None else 0.0
        if teacher_played:
            generate += whole
            continue
        rollout += whole
        for branch, taken in zip(ep.branches, ep.info.get(INTERVENED_TOKENS, ()), strict=True):
            rollout += student.forward(len(branch.token_ids), start=branch.prompt_len)  # the rejected turn, decoded
            if guide is not None:  # the teacher's engine prefills the prefix and decodes its turn
                generate += guide.forward(branch.prompt_len + taken)
    train = sum(student.train(n) for n in train_lengths)
    return {
        "flops/teacher_score": score,
        "flops/teacher_generate": generate,
        "flops/student_rollout": rollout,
        "flops/student_train": train,
        "flops/teacher": score + generate,
        "flops/student": rollout + train,
    }


def played_flops(episodes: Sequence[Episode], shape: ModelShape | None) -> float:
    """What playing `episodes` cost their player (an eval): one forward over each whole stream."""
    return 0.0 if shape is None else shape.forwards(len(e.tokens.token_ids) for e in episodes if e.tokens is not None)
