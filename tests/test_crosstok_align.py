"""Cross-tokenizer alignment (agentopd.crosstok.align): property tests over hostile text with the embedded
byte-level BPE and Qwen3's real BPE as the two sides, and whole episodes rendered for a teacher."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from agentopd.bootstrap import TINY_SPEC, ensure_tokenizer
from agentopd.chat.stream import StreamBuilder
from agentopd.chat.template import encode
from agentopd.crosstok.align import Span, align_bytes, align_episode, encode_exact, token_bytes
from agentopd.types import Episode, Message, StopReason, ToolCall, Turn


@pytest.fixture(scope="module")
def small_tok(tmp_path_factory):
    return ensure_tokenizer(TINY_SPEC, home=tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="module")
def qwen3_tok(qwen3_dir):
    return AutoTokenizer.from_pretrained(qwen3_dir)


@pytest.fixture(scope="module")
def qwen35_tok(qwen35_dir):
    return AutoTokenizer.from_pretrained(qwen35_dir)


# hostile text: unicode of every plane, whitespace runs, JSON and markup (chat markers included)
_PIECES = st.sampled_from(["{\"a\": [1, 2.5e-3, null]}", "<tool_call>", "</tool_call>", "<|im_end|>", "<think>\n", "\n\n\n",
                           "   ", "\t", "\r\n", "SELECT * FROM t WHERE x='é';", "<div class=\"x\">", "  ", "日本語", "🙂👍🏽",
                           "e\u0301", "\u200b", "ﬁ", "Ωmega", "1234567", "'s", "'ll", " I'm"])  # fmt: skip
HOSTILE = st.lists(st.one_of(st.text(min_size=1, max_size=12), _PIECES), min_size=1, max_size=12).map("".join)


def _check_partition(spans: list[Span], n_s: int, n_t: int) -> None:
    s_cover = [k for sp in spans for k in range(sp.s0, sp.s1)]
    t_cover = [k for sp in spans for k in range(sp.t0, sp.t1)]
    assert s_cover == list(range(n_s)) and t_cover == list(range(n_t))  # each token in exactly one span, in order


def _tokens(tok, text: str) -> list[bytes]:
    table = token_bytes(tok)
    return [table[i] for i in encode_exact(tok, text)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=HOSTILE)
def test_spans_partition_and_reassemble_hostile_text(small_tok, qwen3_tok, text):
    s, t = _tokens(small_tok, text), _tokens(qwen3_tok, text)
    assert b"".join(s) == b"".join(t) == text.encode("utf-8")  # both byte tables are exact, no normalizer
    spans = align_bytes(s, t)
    _check_partition(spans, len(s), len(t))
    for sp in spans:
        assert sp.exact and b"".join(s[sp.s0 : sp.s1]) == b"".join(t[sp.t0 : sp.t1])  # same bytes on both sides
        # a cut inside a span would be a shared boundary: spans are minimal
        offs_s = {sum(map(len, s[sp.s0 : k])) for k in range(sp.s0 + 1, sp.s1)}
        offs_t = {sum(map(len, t[sp.t0 : k])) for k in range(sp.t0 + 1, sp.t1)}
        assert not offs_s & offs_t
    assert b"".join(b"".join(s[sp.s0 : sp.s1]) for sp in spans) == text.encode("utf-8")


def test_identical_tokenizations_are_one_to_one(small_tok):
    s = _tokens(small_tok, "SELECT name FROM people WHERE age > 30;")
    spans = align_bytes(s, list(s))
    assert all(sp.one_to_one and sp.exact for sp in spans) and len(spans) == len(s)


def test_differing_tail_is_one_inexact_span():
    spans = align_bytes([b"ab", b"c", b"\xe6"], [b"a", b"bc", "\ufffd".encode()])
    assert spans == [Span(0, 2, 0, 2), Span(2, 3, 2, 3, exact=False)]
    spans = align_bytes([b"ab", b"\xe6\x97"], [b"ab", b"\xe6", b"\x97\xa5"])  # one side runs out first
    _check_partition(spans, 2, 3)
    assert spans[-1].exact is False and spans[0] == Span(0, 1, 0, 1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=1, max_size=40))
def test_invalid_utf8_reaches_the_teacher_byte_for_byte(small_tok, qwen3_tok, data):
    from agentopd.crosstok.align import encode_bytes

    for tok in (small_tok, qwen3_tok):
        assert b"".join(token_bytes(tok)[i] for i in encode_bytes(tok, data)) == data


def _episode(tok, turns: list[str], closed: list[bool]) -> Episode:
    """A 2-tool-call episode sampled 'by the student' = its own tokenizer's encoding of each turn's text."""
    msgs = [Message("system", "You answer with SQL."), Message("user", "How many people are older than 30?")]
    tools = [{"type": "function", "function": {"name": "sql", "description": "run SQL",
                                              "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]  # fmt: skip
    b = StreamBuilder(tok, msgs, tools, max_context=1 << 20)
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    ep_msgs, ep_turns = list(msgs), []
    for k, (text, c) in enumerate(zip(turns, closed)):
        ids = encode(tok, text) + ([stop] if c else [])
        b.add_assistant(ids, [-0.5] * len(ids), finished_by_stop=c)
        am = Message("assistant", text, tool_calls=[ToolCall("sql", {"q": "SELECT 1"})])
        ep_msgs.append(am)
        obs = [Message("tool", "[[3]] <|im_end|> é\n\n", name="sql")]
        if k + 1 < len(turns):
            b.add_observation(obs)
            ep_msgs.extend(obs)
        ep_turns.append(Turn(am, obs if k + 1 < len(turns) else []))
    return Episode("sql_db", "t0", ep_msgs, tools, ep_turns, 1.0, True, StopReason.ANSWER, tokens=b.build())


TURNS = ['<think>\nCount them.\n</think>\n\n<tool_call>\n{"name": "sql", "arguments": {"q": "SELECT count(*) FROM p WHERE age > 30"}}\n</tool_call>',
         "There are 3 people  🙂 older than 30.\n\n"]  # fmt: skip


@pytest.mark.parametrize("closed", [[True, True], [True, False]])
def test_episode_alignment_covers_every_student_token(small_tok, qwen3_tok, closed):
    ep = _episode(small_tok, TURNS, closed)
    al = align_episode(ep, small_tok, qwen3_tok)
    s = ep.tokens
    # every student (mask 1) token is in exactly one span, nothing else is
    assert [sid >= 0 for sid in al.student_span_R] == [bool(m) for m in s.response_mask]
    t = al.teacher_stream
    assert [sid >= 0 for sid in al.teacher_span_R] == [bool(m) for m in t.response_mask]  # tool output, junctions: no span
    s_tab, t_tab = token_bytes(small_tok), token_bytes(qwen3_tok)
    for sid in range(al.num_spans):
        s_b = b"".join(s_tab[i] for i, x in zip(s.response_ids, al.student_span_R) if x == sid)
        t_b = b"".join(t_tab[i] for i, x in zip(t.response_ids, al.teacher_span_R) if x == sid)
        assert s_b == t_b  # exact spans and the shared <|im_end|> stop token
    # the teacher read the conversation in its own template: its rendering of the tool result is in its stream
    text = qwen3_tok.decode(t.token_ids)
    assert "<tool_response>\n[[3]] <|im_end|> é\n\n" in text and TURNS[0] in text and TURNS[1] in text
    shares = al.shares()
    assert shares["aligned"] == 1.0 and 0.3 < shares["one_to_one"] <= 1.0
    assert al.span_turn == sorted(al.span_turn) and set(al.span_turn) == {0, 1}


def test_qwen3_student_qwen35_teacher(qwen3_tok, qwen35_tok):
    """Real vocabularies both sides: Qwen3.5's template (its own system/tools rendering) reads a Qwen3 episode."""
    ep = _episode(qwen3_tok, TURNS, [True, True])
    al = align_episode(ep, qwen3_tok, qwen35_tok)
    assert [sid >= 0 for sid in al.student_span_R] == [bool(m) for m in ep.tokens.response_mask]
    assert al.shares()["aligned"] == 1.0 and al.shares()["one_to_one"] > 0.5
    assert al.teacher_stream.token_ids != ep.tokens.token_ids


def test_same_tokenizer_alignment_is_all_one_to_one(small_tok):
    ep = _episode(small_tok, TURNS, [True, True])
    al = align_episode(ep, small_tok, small_tok)
    assert al.shares()["one_to_one"] == 1.0
    assert al.teacher_stream.token_ids == ep.tokens.token_ids  # the teacher re-renders exactly the student's stream


@pytest.mark.parametrize("closed", [[True, True], [True, False]])
def test_a_teachers_episode_re_rendered_for_a_student_of_another_tokenizer(small_tok, qwen3_tok, closed):
    """SFT across tokenizers (agentopd.crosstok.retokenize): the teacher (Qwen3's BPE) played; the student (the
    embedded BPE) trains on the same conversation in its own template and tokens, its turns' bytes verbatim."""
    from agentopd.crosstok.retokenize import RETOKENIZED, as_student_episode

    teacher_ep = _episode(qwen3_tok, TURNS, closed)
    ep = as_student_episode(teacher_ep, qwen3_tok, small_tok)
    s = ep.tokens
    assert max(s.token_ids) < len(small_tok) and s.logprobs == [0.0] * len(s.response_mask)
    own = _episode(small_tok, TURNS, closed).tokens  # what the student itself would have sampled and rendered
    assert s.token_ids == own.token_ids and s.response_mask == own.response_mask and s.turn_index == own.turn_index
    assert ep.info[RETOKENIZED] == {"from_tokens": len(teacher_ep.tokens.token_ids), "aligned": 1.0}
    assert teacher_ep.tokens is not s and ep.messages == teacher_ep.messages
