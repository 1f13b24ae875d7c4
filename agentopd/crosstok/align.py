"""Cross-tokenizer alignment: the student's episode as the teacher reads it, and which tokens cover which bytes.

    al = align_episode(episode, student_tok, teacher_tok)     # an Episode with .tokens (the student's stream)
    al.teacher_stream        # the episode in the teacher's chat template and tokenizer (a TokenStream: score it)
    al.student_span_R        # per student response token: its span (-1: outside the loss, mask 0)
    al.teacher_span_R        # per teacher response token: its span (-1: template, tool output, junctions)
    spans = align_bytes(student_token_bytes, teacher_token_bytes)   # the pure alignment of one turn

How the teacher reads the episode: its own chat template renders the system prompt, the tool schemas, the
user's messages and every tool result (agentopd.chat.StreamBuilder over the teacher's tokenizer: the same
delta rendering as for the student, tool output never re-capped); each assistant turn is the student's
sampled bytes verbatim, tokenized by the teacher's tokenizer on their own (a valid tokenization of that
text, not necessarily the one the teacher's tokenizer picks inside the whole render), followed by the
teacher template's stop token where the student's turn ended with its own.

Spans: within a turn, both token sequences cover one byte string; a cut is a byte offset where both
tokenizations start a token. Consecutive cuts bound a span: student tokens [s0, s1) and teacher tokens
[t0, t1) covering the same bytes. A span is 1:1 when it holds one token on each side. The student's stop
token and the teacher's form one more span (the turn ends here; same meaning, perhaps other text).
Everything else of the teacher's stream (template, tool results, junctions) belongs to no span, as the
student's mask-0 tokens do. Bytes that are not valid UTF-8 (a lone byte token sampled, a turn cut mid
character) reach the teacher as its single-byte tokens (`encode_bytes`), so both sides always spell the
same bytes; `align_bytes` still marks a span inexact if they did not (kept out of the loss).

Tokenizers must be byte-level (GPT-2 byte alphabet: Qwen, Llama 3, the embedded BPE); added tokens are
their own text. Legend: R = response tokens of a stream, S = spans.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from agentopd.chat.stream import StreamBuilder, template_junctions
from agentopd.teacher.compat import id_to_token
from agentopd.types import Episode, TokenStream


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable character each byte is written as -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_TABLES: weakref.WeakKeyDictionary[Any, list[bytes]] = weakref.WeakKeyDictionary()
_RAW: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def encode_exact(tokenizer: Any, text: str) -> list[int]:
    """Ids of `text` that decode to exactly its UTF-8 bytes: the tokenizer without its normalizer (Qwen's NFC
    would turn a compatibility ideograph such as U+F9xx into another character: other bytes than the student's)."""
    if tokenizer not in _RAW:
        from tokenizers import Tokenizer

        raw = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        raw.normalizer = None
        _RAW[tokenizer] = raw
    return _RAW[tokenizer].encode(text, add_special_tokens=False).ids


def token_bytes(tokenizer: Any) -> list[bytes]:
    """The bytes each id of a byte-level tokenizer stands for (added tokens: their UTF-8 text). Cached."""
    if tokenizer in _TABLES:
        return _TABLES[tokenizer]
    dec = _byte_decoder()
    added = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
    vocab = id_to_token(tokenizer)
    table = [b""] * (max(vocab) + 1)
    for i, tok in vocab.items():
        if i in added:
            table[i] = tok.encode("utf-8")
            continue
        try:
            table[i] = bytes(dec[c] for c in tok)
        except KeyError:
            raise ValueError(f"tokenizer is not byte-level (token {i} {tok!r}): cross-tokenizer alignment needs byte-level BPE") from None
    _TABLES[tokenizer] = table
    return table


def encode_bytes(tokenizer: Any, data: bytes) -> list[int]:
    """Ids spelling exactly `data`, valid UTF-8 or not: runs of valid text through `encode_exact`, each byte of an
    invalid sequence (a student that sampled a lone byte token, or a turn cut mid character) as the tokenizer's
    single-byte token (a byte-level vocabulary has all 256)."""
    single: dict[int, int] = {}
    for i, b in enumerate(token_bytes(tokenizer)):
        if len(b) == 1:
            single.setdefault(b[0], i)
    out: list[int] = []
    while data:
        try:
            return out + encode_exact(tokenizer, data.decode("utf-8"))
        except UnicodeDecodeError as e:
            out += encode_exact(tokenizer, data[: e.start].decode("utf-8")) if e.start else []
            out += [single[b] for b in data[e.start : e.end]]
            data = data[e.end :]
    return out


@dataclass(frozen=True)
class Span:
    """Student tokens [s0, s1) and teacher tokens [t0, t1) (indices within their turn) over the same bytes."""

    s0: int
    s1: int
    t0: int
    t1: int
    exact: bool = True  # False: the two sides cover different bytes (a cut-off UTF-8 tail, or the stop tokens)

    @property
    def one_to_one(self) -> bool:
        return self.s1 - self.s0 == 1 and self.t1 - self.t0 == 1


def align_bytes(student: list[bytes], teacher: list[bytes]) -> list[Span]:
    """Spans of two tokenizations of (nearly) one byte string: cut wherever both start a token.

    Every student and every teacher token lands in exactly one span, in order. Where the byte strings
    differ (a replacement character in a cut-off tail), the spans up to the first differing byte are exact
    and one inexact span takes the rest.
    """
    assert all(student) and all(teacher), "a token of zero bytes"
    a, b = b"".join(student), b"".join(teacher)
    same = 0
    while same < min(len(a), len(b)) and a[same] == b[same]:
        same += 1
    spans: list[Span] = []
    i = j = s0 = t0 = 0
    pa = pb = 0  # byte offset at the end of student token i-1 / teacher token j-1
    while i < len(student) and j < len(teacher):
        if pa + len(student[i]) <= pb + len(teacher[j]):
            pa += len(student[i])
            i += 1
        else:
            pb += len(teacher[j])
            j += 1
        if pa == pb and pa <= same:
            spans.append(Span(s0, i, t0, j))
            s0, t0 = i, j
    if s0 < len(student) or t0 < len(teacher):  # the bytes differ past `same`: one inexact span takes the rest
        if (s0 == len(student) or t0 == len(teacher)) and spans:  # one side has nothing left: fold into the last span
            last = spans.pop()
            s0, t0 = last.s0, last.t0
        rest_a = a[sum(len(t) for t in student[:s0]) :]
        rest_b = b[sum(len(t) for t in teacher[:t0]) :]
        spans.append(Span(s0, len(student), t0, len(teacher), exact=rest_a == rest_b))
    return spans


@dataclass
class Alignment:
    """One episode's alignment (see the module docstring). Spans are numbered across the episode."""

    teacher_stream: TokenStream
    student_span_R: list[int]
    teacher_span_R: list[int]
    span_turn: list[int] = field(default_factory=list)
    span_exact: list[bool] = field(default_factory=list)
    span_one_to_one: list[bool] = field(default_factory=list)

    @property
    def num_spans(self) -> int:
        return len(self.span_turn)

    def shares(self) -> dict[str, float]:
        """aligned: student tokens in exact spans; one_to_one: student tokens in 1:1 spans (of mask-1 tokens)."""
        n = sum(1 for s in self.student_span_R if s >= 0)
        exact = sum(1 for s in self.student_span_R if s >= 0 and self.span_exact[s])
        one = sum(1 for s in self.student_span_R if s >= 0 and self.span_one_to_one[s] and self.span_exact[s])
        return {"aligned": exact / n if n else 0.0, "one_to_one": one / n if n else 0.0, "tokens": float(n)}


def _turn_runs(stream: TokenStream) -> list[tuple[int, int]]:
    """[start, end) of each assistant turn's mask-1 tokens in the response, in turn order."""
    runs: dict[int, list[int]] = {}
    for r, (m, k) in enumerate(zip(stream.response_mask, stream.turn_index)):
        if m:
            runs.setdefault(k, []).append(r)
    out = []
    for k in sorted(runs):
        idx = runs[k]
        if idx != list(range(idx[0], idx[-1] + 1)):
            raise ValueError(f"turn {k}'s student tokens are not contiguous")
        out.append((idx[0], idx[-1] + 1))
    return out


def align_episode(episode: Episode, student_tok: Any, teacher_tok: Any, template_kwargs: dict[str, Any] | None = None) -> Alignment:
    """The student's episode rendered for the teacher, and its spans (module docstring)."""
    stream = episode.tokens
    assert stream is not None, "episode without a token stream"
    runs = _turn_runs(stream)
    if len(runs) != episode.num_turns:
        raise ValueError(f"{episode.num_turns} turns but {len(runs)} with student tokens: a turn the student did not "
                         "sample (recipe.intervene_below) is not supported by the cross-tokenizer losses yet")  # fmt: skip
    msgs = episode.messages
    first = next((n for n, m in enumerate(msgs) if m.role == "assistant"), len(msgs))
    after: list[list[Any]] = []  # the non-assistant messages following each assistant message
    for m in msgs[first:]:
        if m.role == "assistant":
            after.append([])
        elif after:
            after[-1].append(m)
    kwargs = dict(template_kwargs or {})
    builder = StreamBuilder(teacher_tok, msgs[:first], episode.tools, max_context=1 << 30, template_kwargs=kwargs)
    s_bytes, t_bytes = token_bytes(student_tok), token_bytes(teacher_tok)
    s_junctions, t_junctions = template_junctions(student_tok, **kwargs), template_junctions(teacher_tok, **kwargs)
    if s_junctions.harmony or t_junctions.harmony:  # two stop tokens, nothing after them: not handled below
        raise ValueError("cross-tokenizer alignment does not read harmony (gpt-oss) turns yet: give both models a non-harmony template")
    s_stop, t_stop = s_junctions.closing_ids[:1], t_junctions.closing_ids[:1]
    resp = stream.response_ids
    if not s_stop or not t_stop:
        raise ValueError("a chat template without an assistant closing: cannot tell where a turn ends")
    turn_spans: list[tuple[int, int, list[Span], int, bool]] = []  # student start, teacher start, body spans, body length, closed
    for k, (r0, r1) in enumerate(runs):
        ids = resp[r0:r1]
        closed = ids[-1] == s_stop[0]
        body = ids[:-1] if closed else ids
        t_ids = encode_bytes(teacher_tok, b"".join(s_bytes[t] for t in body)) + (list(t_stop) if closed else [])
        t_start = len(builder.token_ids) - builder.prompt_len
        builder.add_assistant(t_ids, [0.0] * len(t_ids), finished_by_stop=closed)
        t_body = t_ids[:-1] if closed else t_ids
        spans = align_bytes([s_bytes[t] for t in body], [t_bytes[t] for t in t_body]) if body else []
        turn_spans.append((r0, t_start, spans, len(body), closed))
        if k + 1 < len(runs):
            builder.add_observation(after[k])
    t_stream = builder.build()
    al = Alignment(t_stream, [-1] * len(stream.response_mask), [-1] * len(t_stream.response_mask))
    for k, (r0, t_start, spans, n_body, closed) in enumerate(turn_spans):
        t_body = max((sp.t1 for sp in spans), default=0)
        for sp in [*spans, *([Span(n_body, n_body + 1, t_body, t_body + 1)] if closed else [])]:
            sid = al.num_spans
            al.span_turn.append(k)
            al.span_exact.append(sp.exact)
            al.span_one_to_one.append(sp.one_to_one)
            for r in range(r0 + sp.s0, r0 + sp.s1):
                al.student_span_R[r] = sid
            for r in range(t_start + sp.t0, t_start + sp.t1):
                al.teacher_span_R[r] = sid
    return al
