"""The Teacher protocol and the record it returns (what the loss needs, on CPU).

A teacher scores finished token streams (docs/design.md 3.1) position by position. Index
convention, shared by every teacher: the logits at absolute position p predict token p+1,
so response token i (absolute position prompt_len + i) is predicted by position
prompt_len + i - 1. A stream therefore needs prompt_len >= 1 to be scored.

    scores = teacher.score(streams, mode=TeacherMode.LOGPROBS)
    scores[0].logprobs        # one float per response token, 0.0 where response_mask is 0

Legend: R = response tokens of one stream, K = top-k, H = the teacher's hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from agentopd.kinds import TeacherMode
from agentopd.types import TokenStream


def as_mode(mode: TeacherMode | str) -> TeacherMode:
    try:
        return TeacherMode(mode)
    except ValueError:
        raise ValueError(f"teacher mode must be one of {[m.value for m in TeacherMode]}, got {mode!r}") from None


@dataclass
class TeacherScores:
    """The teacher's view of one stream's response tokens (all on CPU).

    logprobs       R floats: log p_teacher(sampled token) at temperature T; 0.0 where the mask is 0
    topk_ids       R x K token ids, best first (TOPK mode; every response position, mask 0 included)
    topk_logprobs  R x K logprobs matching topk_ids (TOPK mode)
    hidden         R x H final hidden states of the positions that predict the response tokens
                   (HIDDEN mode; row i predicts response token i; the teacher's dtype)
    entropy        R floats: the entropy of the teacher's distribution at each response position (TOPK mode, a local
                   teacher; a server gives None: agentopd.teacher.selftest bounds it from the top-k)
    """

    logprobs: list[float]
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None
    hidden: torch.Tensor | None = None
    entropy: list[float] | None = None


@runtime_checkable
class Teacher(Protocol):
    """Anything that scores token streams."""

    def score(self, streams: list[TokenStream], *, mode: TeacherMode | str = TeacherMode.LOGPROBS) -> list[TeacherScores]:
        """One TeacherScores per stream, in order."""
        ...


def check_scorable(streams: list[TokenStream]) -> None:
    """A response token needs a predecessor: refuse streams with an empty prompt."""
    for n, s in enumerate(streams):
        if s.prompt_len < 1 and len(s.response_mask) > 0:
            raise ValueError(f"stream {n}: prompt_len must be >= 1 to score its response (got {s.prompt_len})")


def is_server(ref: object) -> bool:
    """A teacher reference that is a vLLM OpenAI-compatible server (`teacher=http://host:8000`): scored
    through agentopd.teacher.ServerTeacher, never loaded as a model."""
    return str(ref).startswith(("http://", "https://"))
