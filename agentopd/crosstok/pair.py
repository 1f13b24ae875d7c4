"""check-pair for a teacher with another tokenizer (`agentopd check-pair --loss xtok_k1`): what a cross-tokenizer run
relies on, measured on one conversation (the env's oracle on its first training task, or a fixed one).

    report = check_cross_pair("path/to/student", "path/to/teacher", env="sql_db")    # agentopd.pair.PairReport

- vocabulary: both tokenizers byte-level (agentopd.crosstok.align.token_bytes); the shared-vocabulary share (token
  strings spelling the same bytes, the map of the full-distribution term, agentopd.losses.crosstok.vocab_map);
- chat_template: the conversation rendered by each template: identical, or where they first differ (expected:
  the teacher reads the episode in its own template);
- alignment: the conversation played through the agent loop with the student's tokenizer (agentopd.pair), re-
  rendered for the teacher and aligned: the share of student tokens in exact spans (must be 1) and aligning 1:1;
- max_context: as agentopd.pair;
- self_score (loads the teacher): the teacher plays the student, its own log-probs as the sampler's, and the whole
  cross-tokenizer path (align, score the re-rendered stream, project back) must give span k1 ~ 0 (< 1e-3): the
  re-rendering reproduces what the model saw and the scores land on the right spans.
"""

from __future__ import annotations

from pathlib import Path

from agentopd.chat import render
from agentopd.pair import SELF_SCORE_TOL, PairReport, _context, _Fail, load_pair, run_checks
from agentopd.pair_stream import play_conversation


def _vocabulary(student_tok, teacher_tok) -> str:
    from agentopd.crosstok.align import token_bytes
    from agentopd.losses.crosstok import vocab_map

    try:
        s_bytes, t_bytes = token_bytes(student_tok), token_bytes(teacher_tok)
    except ValueError as e:
        raise _Fail(str(e)) from None
    map_w, share = vocab_map(s_bytes, t_bytes)
    mapped = int((map_w >= 0).sum())
    same = "identical tokenizers" if s_bytes == t_bytes else "different tokenizers"
    return (f"{same}: student {len(s_bytes):,} ids, teacher {len(t_bytes):,}; shared vocabulary (same bytes): {mapped:,} tokens = "
            f"{share:.1%} of the teacher's, {mapped / max(1, len(s_bytes)):.1%} of the student's")  # fmt: skip


def _template(student_tok, teacher_tok, messages, tools, source: str) -> str:
    s_text, t_text = (render(tok, messages, tools or None) for tok in (student_tok, teacher_tok))
    if s_text == t_text:
        return f"{source}: identical renders ({len(s_text):,} characters)"
    i = next((i for i, (a, b) in enumerate(zip(s_text, t_text)) if a != b), min(len(s_text), len(t_text)))
    return (f"{source}: the templates differ (the teacher reads its own): {len(s_text):,} vs {len(t_text):,} characters, first at "
            f"character {i}: student {s_text[max(0, i - 20) : i + 30]!r} vs teacher {t_text[max(0, i - 20) : i + 30]!r}")  # fmt: skip


def _alignment(student_tok, teacher_tok, messages, tools, source: str) -> str:
    from agentopd.crosstok import align_episode

    episode = play_conversation(student_tok, messages, tools)
    if "error" in episode.info:
        raise _Fail(f"the agent loop could not play {source}: {episode.info['error']}")
    al = align_episode(episode, student_tok, teacher_tok)
    shares = al.shares()
    detail = (f"{source}: {int(shares['tokens'])} student tokens in {al.num_spans} spans over {episode.num_turns} turns; "
              f"aligned {shares['aligned']:.1%}, 1:1 {shares['one_to_one']:.1%}; the teacher reads "
              f"{len(al.teacher_stream.token_ids):,} tokens for the student's {len(episode.tokens.token_ids):,}")  # fmt: skip
    if shares["aligned"] < 1.0:
        raise _Fail(detail + " (every span should spell the same bytes on both sides)")
    return detail


def _self_score(teacher: str, teacher_tok, messages, tools) -> str:
    import torch

    from agentopd.crosstok import align_episode
    from agentopd.crosstok.project import project
    from agentopd.teacher import HFTeacher, TeacherMode
    from agentopd.types import TokenStream

    episode = play_conversation(teacher_tok, messages, tools)
    stream = episode.tokens
    scorer = HFTeacher(teacher, device="cpu", dtype=torch.float32, offload_after_score=False)
    (own,) = scorer.score([stream], mode=TeacherMode.LOGPROBS)  # the teacher as its own sampler
    episode.tokens = TokenStream(stream.token_ids, stream.prompt_len, stream.response_mask, list(own.logprobs), stream.turn_index)
    al = align_episode(episode, teacher_tok, teacher_tok)
    (scores,) = scorer.score([al.teacher_stream], mode=TeacherMode.LOGPROBS)
    xs = project(al, episode.tokens, scores)
    worst = max((abs(k) for k in xs.span_kl), default=0.0)
    detail = f"{al.num_spans} spans of {episode.num_turns} turns re-rendered and scored: max |span k1| {worst:.1e}"
    if worst >= SELF_SCORE_TOL:
        raise _Fail(detail + " (should be ~0: the re-rendering or the span scores disagree with the model)")
    return detail


def check_cross_pair(student: str | Path, teacher: str | Path, env: str | None = None, *, max_context: int | None = None,
                     self_score: bool = True) -> PairReport:  # fmt: skip
    """Every cross-tokenizer pair check (module docstring)."""
    student, teacher = str(student), str(teacher)
    report = PairReport(student, teacher)
    p = load_pair(student, teacher, env, max_context)
    student_tok, teacher_tok, messages, tools, source = p.student_tok, p.teacher_tok, p.messages, p.tools, p.source
    steps = [
        ("vocabulary", lambda: _vocabulary(student_tok, teacher_tok)),
        ("chat_template", lambda: _template(student_tok, teacher_tok, messages, tools, source)),
        ("alignment", lambda: _alignment(student_tok, teacher_tok, messages, tools, source)),
        ("max_context", lambda: _context(p.student_cfg, p.teacher_cfg, p.max_context)),
    ]
    if self_score:
        steps.append(("self_score", lambda: _self_score(teacher, teacher_tok, messages, tools)))
    run_checks(report, steps, after_a_pass=("alignment", "self_score"))
    return report
