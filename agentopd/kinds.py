"""The modes the parts of a run agree on, below all of them: config, backends, engines, teacher and trainer import
them from here, so none has to import another for them (tests/test_layout.py).

    BackendKind     `run.backend`: where the stages run (local | ray)
    TeacherMode     what a teacher returns per response token (logprobs | topk | hidden)
    EmbeddedSize    `embedded.size`: which pair of built-in models `builtin` means
    sampled_vocab   the vocabulary rows engines sample from and the teacher and trainer normalise over

This module imports nothing from agentopd.
"""

from __future__ import annotations

from enum import StrEnum


class BackendKind(StrEnum):
    """`run.backend`: where the stages run."""

    LOCAL = "local"  # backends/local.py: every stage in this process
    RAY = "ray"  # backends/ray.py: Ray actors


class TeacherMode(StrEnum):
    """What a teacher keeps per response token besides the sampled token's logprob."""

    LOGPROBS = "logprobs"  # only the sampled token's logprob (cheapest; servers can do it)
    TOPK = "topk"  # plus the top-k token ids and their logprobs
    HIDDEN = "hidden"  # plus the final hidden states (the loss applies the teacher's lm_head)


class EmbeddedSize(StrEnum):
    """`embedded.size`: which pair of built-in models `builtin` means (agentopd.bootstrap.sized_spec)."""

    TINY = "tiny"  # the default: a ~0.5M-parameter teacher and a ~0.3M student, built on the CPU in minutes
    GPU = "gpu"  # a ~150M-parameter teacher and a ~25M student, built on one GPU in minutes (issue 33)
    TEST = "test"  # tests only: the sized pair's plumbing at toy sizes, built on the CPU in seconds


def sampled_vocab(vocab_size: int | None, rows: int) -> int:
    """The ids an engine samples from: the tokenizer's `vocab_size` (None: all `rows` of the model's head)."""
    if vocab_size is None:
        return rows
    if not 0 < vocab_size <= rows:
        raise ValueError(f"vocab_size={vocab_size}: the model has {rows} vocabulary rows; give the tokenizer's size (<= rows)")
    return vocab_size
