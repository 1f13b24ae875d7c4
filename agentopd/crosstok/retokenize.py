"""A teacher's own episode re-rendered for a student of another tokenizer: SFT on the teacher's episodes across
tokenizers (run.objective=sft, or recipe.sft_steps before a cross-tokenizer loss).

    ep = as_student_episode(teacher_episode, teacher_tok, student_tok)
    ep.tokens            # the same conversation in the student's chat template and tokenizer: the student's stream
    ep.info["retokenized"] == {"from_tokens": ..., "aligned": ...}

The teacher plays with its own tokenizer and template (agentopd.backends.stages.Players); its stream is re-rendered
as `align_episode` renders a student's episode for a teacher, the roles swapped: the system prompt, the tools, the
user's messages and every tool result in the student's template, each assistant turn the teacher's sampled bytes
verbatim, tokenized by the student's tokenizer, closed by the student template's stop token where the teacher's turn
ended with its own. Those tokens are the ones trained on (mask 1); their sampler log-probabilities are unknown in the
student's tokenization and stored as 0.0 (SFT does not read them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from agentopd.crosstok.align import align_episode
from agentopd.types import TEMPLATE_KWARGS, Episode, TokenStream

RETOKENIZED = "retokenized"  # Episode.info key: the teacher's stream length and the share of its bytes aligned exactly


def as_student_episode(episode: Episode, teacher_tok: Any, student_tok: Any) -> Episode:
    """`episode` (played by the teacher, its stream in the teacher's tokenizer) with the stream re-rendered for the
    student (module docstring). ValueError where it cannot be (a turn the teacher did not sample, a harmony template)."""
    if episode.tokens is None:
        return episode
    al = align_episode(episode, teacher_tok, student_tok, episode.info.get(TEMPLATE_KWARGS))
    s = al.teacher_stream  # align_episode's "teacher" is the target here: the student
    stream = TokenStream(list(s.token_ids), s.prompt_len, list(s.response_mask), [0.0] * len(s.response_mask),
                         list(s.turn_index))
    info = {**episode.info, RETOKENIZED: {"from_tokens": len(episode.tokens.token_ids), "aligned": al.shares()["aligned"]}}
    return dataclasses.replace(episode, tokens=stream, teacher_logprobs=None, info=info)
