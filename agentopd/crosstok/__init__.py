"""Cross-tokenizer on-policy distillation (issue 31): a teacher whose tokenizer differs from the student's.

    from agentopd.crosstok import align_episode
    al = align_episode(episode, student_tok, teacher_tok)   # the teacher's stream + per-token span ids

align.py   the episode re-rendered in the teacher's chat template; byte-offset spans of each assistant turn
project.py span scores brought back onto the student's tokens; the step's alignment metrics
score.py   CrossScorer: the teacher-scoring stage of a cross-tokenizer run (align, score, project)
pair.py    check-pair's report for a cross-tokenizer pair
retokenize.py  a teacher's own episode re-rendered for the student (SFT across tokenizers)
The losses over spans are pure functions in agentopd.losses.crosstok.
"""

from agentopd.crosstok.align import Alignment, Span, align_bytes, align_episode, encode_exact, token_bytes

__all__ = ["Alignment", "Span", "align_bytes", "align_episode", "encode_exact", "token_bytes"]
