"""Drift checker: does one episode's TokenStream equal its conversation, token for token?

    report = check_episode(tokenizer, messages, tools, stream, raw_assistant_texts)
    report.ok, report.drift, report.info, report.rewrites
    print(format_report(report, name="episode 12"))
    report = check_stored_episode(tokenizer, episode)      # an agentopd.types.Episode

What counts as drift (a finding with severity "drift"), in the order checked:
1. invariant: the stream contract of docs/design.md 3.1 is broken: prompt_len out of range; mask,
   logprobs or turn_index not of length len(token_ids) - prompt_len; a mask value not 0/1;
   a logprob not 0.0 where the mask is 0, or > 0 / not finite where it is 1; turn_index not
   starting at 0, decreasing or skipping; within a turn, a mask-1 token after a mask-0 one
   (each turn is: sampled span, then the junction/observation span); an id outside the
   vocabulary. Later checks need the lengths, so a length error ends the check.
2. structure: the number of turns in the stream differs from the number of assistant messages
   (or from the number of raw assistant texts given).
3. assistant: a turn's mask-1 span does not decode to that turn's raw sampled text (with or
   without the trailing stop token) — the mask covers something the student did not sample.
4. text: the decoded stream differs from the re-rendered conversation. The re-render is the
   chat template over `messages` and `tools`, assistant messages replaced by their raw sampled
   text (tool calls unparsed, thinking kept) when `raw_assistant_texts` is given, with the
   generation prompt when the last message is not an assistant one, passed through the
   tokenizer's normalizer (Qwen's NFC) as its tokens are. The decoded stream is the concatenation
   of the decoded segments (prompt, each turn's sampled span, each mask-0 span); they are walked
   along the re-render in order: every mask-0 segment must appear there verbatim, and every
   sampled span too, or as one of the template's history rewrites (below; a sampled span that fits
   none of them is drift). The only other allowed difference: the stream may stop right after
   the final assistant turn without the template's closing of that turn (the `\\n` after `<|im_end|>`, or `<|im_end|>\\n` if it hit max_tokens).
5. tokens: a non-assistant segment (the prompt, or a turn's mask-0 span) is not exactly the
   tokenization of its own text: a dropped, added or re-tokenized template/tool token.
Reported as information only (severity "info"), not drift:
- retokenize: encoding a turn's raw sampled text gives other ids than the ones sampled. The
  stream is right (it holds what was sampled); a pipeline that re-tokenizes history would have
  trained on different tokens here (rLLM #272). Such drift, once baked into a stored stream,
  cannot be told from a canonical sample without the engine's record — only text and
  non-assistant token differences are visible afterwards.
Reported as history rewrites (severity "rewrite"), not drift: the template renders an assistant
turn otherwise than it was sampled, by design. The stream keeps what was sampled (the agent loop is
token-in/token-out), so neither the trainer nor the teacher sees the rewrite; only a pipeline that
re-renders history would. Each is named (Qwen3's own template does the first three):
- reasoning_inserted ("template re-renders reasoning"): the re-render puts a reasoning block the
  model did not sample before the turn (Qwen3: an empty `<think>\\n\\n</think>\\n\\n` on the last turn);
- reasoning_dropped: the re-render leaves out the turn's reasoning block (earlier turns' thinking;
  with `enable_thinking=False` the empty block the generation prompt put before each turn);
- reasoning_reformatted: the re-render keeps the reasoning with other whitespace around it;
- content_trimmed: the re-render strips the whitespace around the turn's text (Qwen3.5's template trims
  every message's content).
Harmony (gpt-oss's template, agentopd.chat.formats): the template cannot render sampled text as an assistant message
(it renders a message from `thinking`, `content` and one call, and refuses a tool message that no call precedes), so
check 4 re-renders the conversation with a stand-in per assistant turn and puts the sampled text, with its `<|call|>`
/ `<|return|>` (`<|end|>` when the turn was cut), in the stand-in's place (agentopd.chat.harmony): the prompt, the
tool messages and their senders' headers are the template's, the turns are what was sampled. Then the turns the parser
reads cleanly are compared with how the template renders their parsed messages, each difference named as a rewrite:
- reasoning_dropped: the template drops analysis messages: of an answer before the last message, of a call once a
  later answer follows;
- end_rewritten: an answer that ended with `<|return|>` is closed with `<|end|>` once messages follow it;
- message_reformatted: the template writes the turn's headers or JSON in its own form (`to=functions.NAME<|channel|>
  commentary json`, `json.dumps` arguments, the `final` channel) where the model wrote another valid form.
The system message holds the date of the render (`Current date: ...`, the template's `strftime_now`): a stream
checked on another day than it was played is re-rendered with the date its prompt holds (reported as information,
`render_date`), not as drift.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from transformers import PreTrainedTokenizerBase

from agentopd.chat import harmony
from agentopd.chat.stream import template_junctions
from agentopd.chat.template import MessageLike, encode, render, to_template_messages
from agentopd.types import INTERVENED, INTERVENED_TOKENS, TEMPLATE_KWARGS, Episode, TokenStream

_CONTEXT_CHARS = 40


class Severity(StrEnum):
    DRIFT = "drift"
    INFO = "info"
    REWRITE = "rewrite"  # the template re-renders history otherwise, by design (module docstring)


class FindingKind(StrEnum):
    INVARIANT = "invariant"
    STRUCTURE = "structure"
    ASSISTANT = "assistant"
    TEXT = "text"
    TOKENS = "tokens"
    RETOKENIZE = "retokenize"
    RENDER_DATE = "render_date"
    REASONING_INSERTED = "reasoning_inserted"
    REASONING_DROPPED = "reasoning_dropped"
    REASONING_REFORMATTED = "reasoning_reformatted"
    CONTENT_TRIMMED = "content_trimmed"
    END_REWRITTEN = "end_rewritten"
    MESSAGE_REFORMATTED = "message_reformatted"


REWRITES = {
    FindingKind.REASONING_INSERTED: "the template re-renders this turn with a reasoning block the model did not sample",
    FindingKind.REASONING_DROPPED: "the template drops this turn's reasoning block when it re-renders history",
    FindingKind.REASONING_REFORMATTED: "the template re-renders this turn's reasoning block with other whitespace",
    FindingKind.CONTENT_TRIMMED: "the template re-renders this turn with the whitespace around its content trimmed",
    FindingKind.END_REWRITTEN: "the template closes this answer with <|end|> in history; the model sampled <|return|>",
    FindingKind.MESSAGE_REFORMATTED: "the template re-renders this turn's message headers or JSON arguments in its own form",
}


@dataclass
class Finding:
    kind: FindingKind
    message: str
    token_pos: int | None = None  # index into token_ids
    char_pos: int | None = None  # index into the decoded stream
    context: str = ""  # the decoded text around the position
    severity: Severity = Severity.DRIFT


@dataclass
class DriftReport:
    num_tokens: int
    num_turns: int
    findings: list[Finding] = field(default_factory=list)

    @property
    def drift(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == Severity.DRIFT]

    @property
    def info(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == Severity.INFO]

    @property
    def rewrites(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == Severity.REWRITE]

    @property
    def ok(self) -> bool:
        return not self.drift


@dataclass
class _Segment:
    start: int  # token index into token_ids
    ids: list[int]
    sampled: bool
    turn: int  # -1 for the prompt
    text: str = ""
    char_start: int = 0


def _field(stream: TokenStream | Mapping[str, Any], name: str) -> Any:
    return stream[name] if isinstance(stream, Mapping) else getattr(stream, name)


def _check_invariants(ids: list[int], prompt_len: int, mask: list, logprobs: list, turns: list, vocab: int) -> tuple[list[Finding], bool]:
    """(findings, fatal): fatal when the lengths are wrong and nothing else can be checked."""
    out: list[Finding] = []

    def bad(msg: str, pos: int | None = None) -> None:
        out.append(Finding(FindingKind.INVARIANT, msg, token_pos=pos))

    if not 0 <= prompt_len <= len(ids):
        bad(f"prompt_len {prompt_len} outside [0, {len(ids)}]")
        return out, True
    n = len(ids) - prompt_len
    for name, seq in (("response_mask", mask), ("logprobs", logprobs), ("turn_index", turns)):
        if len(seq) != n:
            bad(f"len({name}) = {len(seq)}, expected len(token_ids) - prompt_len = {n}")
    if out:
        return out, True
    first = lambda pred: next((i for i in range(n) if pred(i)), None)  # noqa: E731
    checks = [
        (lambda i: mask[i] not in (0, 1), "response_mask value {v} is not 0/1", mask),
        (lambda i: mask[i] == 0 and logprobs[i] != 0.0, "logprob {v} where the mask is 0 (must be 0.0)", logprobs),
        (lambda i: mask[i] == 1 and not (math.isfinite(logprobs[i]) and logprobs[i] <= 1e-6), "sampled logprob {v} is not a finite value <= 0", logprobs),
        (lambda i: turns[i] != (0 if i == 0 else turns[i - 1]) and not (i > 0 and turns[i] == turns[i - 1] + 1), "turn_index {v} does not follow its predecessor (start at 0, step 0 or 1)", turns),
        (lambda i: i > 0 and turns[i] == turns[i - 1] and mask[i] == 1 and mask[i - 1] == 0, "mask 1 after mask 0 within turn {v} (a turn is a sampled span, then a mask-0 span)", turns),
    ]
    for pred, msg, values in checks:
        i = first(pred)
        if i is not None:
            bad(msg.format(v=values[i]), prompt_len + i)
    i = next((j for j, t in enumerate(ids) if not 0 <= t < vocab), None)
    if i is not None:
        bad(f"token id {ids[i]} outside the vocabulary [0, {vocab})", i)
    return out, False


def _segments(ids: list[int], prompt_len: int, mask: list[int], turns: list[int], guided: Mapping[int, int]) -> list[_Segment]:
    """The prompt, then per turn its sampled span and its mask-0 span. A guided turn's first `guided[turn]`
    tokens (mask 0: another policy sampled them) are its sampled span."""
    segs = [_Segment(0, ids[:prompt_len], sampled=False, turn=-1)]
    into_turn = 0
    for j, (m, t) in enumerate(zip(mask, turns)):
        into_turn = into_turn + 1 if j and turns[j - 1] == t else 0
        sampled = bool(m) or into_turn < guided.get(t, 0)
        if segs[-1].turn != t or segs[-1].sampled != sampled:
            segs.append(_Segment(prompt_len + j, [], sampled=sampled, turn=t))
        segs[-1].ids.append(ids[prompt_len + j])
    return segs


def _around(text: str, pos: int) -> str:
    return repr(text[max(0, pos - _CONTEXT_CHARS) : pos]) + " | " + repr(text[pos : pos + _CONTEXT_CHARS])


def _first_diff(a: Sequence, b: Sequence) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _token_at_char(tokenizer: PreTrainedTokenizerBase, segs: list[_Segment], char_pos: int) -> int:
    seg = next((s for s in reversed(segs) if s.char_start <= char_pos), segs[0])
    local = char_pos - seg.char_start
    for i in range(1, len(seg.ids) + 1):
        if len(tokenizer.decode(seg.ids[:i], skip_special_tokens=False)) > local:
            return seg.start + i - 1
    return seg.start + len(seg.ids)


_THINK, _END_THINK = "<think>", "</think>"


def opened_reasoning(tokenizer: PreTrainedTokenizerBase, template_kwargs: dict[str, Any]) -> str:
    """What the generation prompt opens the assistant turn with from `<think>` on (Qwen3 with enable_thinking=False:
    an empty block; Qwen3.5: an open `<think>\\n`), else "": the template renders it as part of the turn."""
    probe = [{"role": "user", "content": "Hello."}]
    prompt = render(tokenizer, probe, add_generation_prompt=True, **template_kwargs)
    plain = render(tokenizer, probe, **template_kwargs)
    gen = prompt[len(plain) :] if prompt.startswith(plain) else ""
    return gen[gen.find(_THINK) :] if _THINK in gen else ""


def _reasoning_variants(view: str, prefix: int, stop_text: str) -> list[tuple[FindingKind, str]]:
    """How a reasoning template (Qwen's) may re-render an assistant turn: `view` is the turn as the stream holds it
    (its first `prefix` characters the generation prompt's reasoning opening, then the sampled text with its stop
    token); the template sees the sampled text only, as the message's content."""
    body = view[prefix:]
    body, tail = (body[: -len(stop_text)], stop_text) if stop_text and body.endswith(stop_text) else (body, "")
    out = []
    for trimmed in (False, True):  # Qwen3.5's template trims every message's content (and its reasoning) first
        text = body.strip() if trimmed else body
        if _END_THINK in text:
            reasoning = text.split(_END_THINK)[0].rstrip("\n").split(_THINK)[-1].lstrip("\n")
            reasoning = reasoning.strip() if trimmed else reasoning.strip("\n")
            content = text.split(_END_THINK)[-1].lstrip("\n")
            renders = [content, f"{_THINK}\n{reasoning}\n{_END_THINK}\n\n{content}"]
        else:
            renders = [text, f"{_THINK}\n\n{_END_THINK}\n\n" + text.lstrip("\n")]
        for render_ in renders:
            had, has = _END_THINK in view, _END_THINK in render_
            kind = (FindingKind.REASONING_DROPPED if had and not has else FindingKind.REASONING_INSERTED if has and not had
                    else FindingKind.CONTENT_TRIMMED if trimmed and render_ == text else FindingKind.REASONING_REFORMATTED)  # fmt: skip
            out.append((kind, render_ + tail))
    return out


def _walk_text(segs: list[_Segment], expected: str, stop_text: str, closing: str, injected: str,
               norm: Callable[[str], str]) -> list[Finding]:  # fmt: skip
    """Check 4 (module docstring): the segments along the re-render; rewrites found, then the first drift if any.

    A sampled span takes with it the reasoning opening (`injected`) that the mask-0 segment before it ends with:
    the template renders that opening as part of the turn. Texts pass through the tokenizer's normalizer (`norm`,
    applied to `expected` by the caller): a sampled span may decode to text the normalizer would change."""
    units: list[list[Any]] = []  # [sampled?, text, turn, char start in the (normalised) stream, token start, prefix length]
    offset = 0
    for s in segs:
        text, prefix = norm(s.text), ""
        if s.sampled and injected and units and not units[-1][0] and units[-1][1].endswith(injected):
            units[-1][1], prefix = units[-1][1][: -len(injected)], injected
        units.append([s.sampled, prefix + text, s.turn, offset - len(prefix), s.start, len(prefix)])
        offset += len(text)
    stream_text = "".join(u[1] for u in units)
    out: list[Finding] = []
    pos = 0  # into expected

    def fits(text: str, j: int) -> bool:
        if not expected.startswith(text, pos):
            return False
        if j + 1 < len(units):
            return expected.startswith(units[j + 1][1], pos + len(text))
        return closing.endswith(expected[pos + len(text) :])  # only the final turn's closing may be missing

    for j, (sampled, text, turn, start, token, prefix) in enumerate(units):
        last = j + 1 == len(units)
        if not sampled and expected.startswith(text, pos) and (not last or pos + len(text) == len(expected)):
            pos += len(text)
            continue
        if sampled and fits(text, j):
            pos = len(expected) if last else pos + len(text)
            continue
        variants = _reasoning_variants(text, prefix, stop_text) if sampled else []
        rewrite = next(((kind, v) for kind, v in variants if v != text and fits(v, j)), None)
        if rewrite is None:
            i = _first_diff(stream_text[start:], expected[pos:])
            out.append(Finding(
                FindingKind.TEXT,
                f"decoded stream differs from the re-rendered conversation at char {start + i} of the stream, char {pos + i} of the "
                f"re-render (stream {len(stream_text)} chars, re-render {len(expected)}); re-render there: {_around(expected, pos + i)}",
                char_pos=start + i, context=_around(stream_text, start + i)))  # fmt: skip
            return out
        kind, variant = rewrite
        out.append(Finding(kind, f"turn {turn}: {REWRITES[kind]} (history rewrite by design: the stream keeps what was sampled)",
                           token_pos=token, char_pos=start, severity=Severity.REWRITE,
                           context=_around(expected, pos)))  # fmt: skip
        pos = len(expected) if last else pos + len(variant)
    return out


def check_episode(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[MessageLike],
    tools: Sequence[dict[str, Any]] | None,
    stream: TokenStream | Mapping[str, Any],
    raw_assistant_texts: Sequence[str] | None = None,
    *,
    template_kwargs: dict[str, Any] | None = None,
    guided: Mapping[int, int] | None = None,
) -> DriftReport:
    """Check one episode's stream against its conversation (see the module docstring). `guided`: turn -> the
    number of tokens at its start that a guide (recipe.intervene_below: the teacher) sampled in the student's
    place, mask 0; they are checked as that turn's sampled span."""
    kw = dict(template_kwargs or {})
    ids = [int(t) for t in _field(stream, "token_ids")]
    prompt_len = int(_field(stream, "prompt_len"))
    mask, logprobs, turns = (list(_field(stream, k)) for k in ("response_mask", "logprobs", "turn_index"))
    report = DriftReport(num_tokens=len(ids), num_turns=(max(turns) + 1 if turns else 0))
    findings, fatal = _check_invariants(ids, prompt_len, mask, logprobs, turns, len(tokenizer))
    report.findings += findings
    if fatal:
        return report
    segs = _segments(ids, prompt_len, mask, turns, guided or {})
    junctions = template_junctions(tokenizer, **kw)
    stop_texts = [tokenizer.decode([i], skip_special_tokens=False) for i in junctions.stop_ids]
    stop_text = stop_texts[0] if stop_texts else ""

    msgs = [dict(m) for m in to_template_messages(messages)]
    assistant_at = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if len(assistant_at) != report.num_turns:
        report.findings.append(Finding(FindingKind.STRUCTURE, f"{report.num_turns} turns in the stream, {len(assistant_at)} assistant messages"))
    raw: list[str] | None = None
    if raw_assistant_texts is not None:
        raw = [next((t[: -len(x)] for x in stop_texts if x and t.endswith(x)), t) for t in raw_assistant_texts]
        if len(raw) != len(assistant_at):
            report.findings.append(Finding(FindingKind.STRUCTURE, f"{len(raw)} raw assistant texts for {len(assistant_at)} assistant messages"))
            raw = None
        elif not junctions.harmony:
            for i, text in zip(assistant_at, raw):
                msgs[i] = {"role": "assistant", "content": text}

    # Decode segment by segment; check sampled spans against the raw texts.
    pos = 0
    ends = {}  # turn -> how its sampled span ends: the stop's text, or the closing inserted after a cut turn
    for s in segs:
        s.text, s.char_start = tokenizer.decode(s.ids, skip_special_tokens=False), pos
        pos += len(s.text)
        if not s.sampled or raw is None or s.turn >= len(raw):
            continue
        closed = bool(s.ids) and s.ids[-1] in junctions.stop_ids
        ends[s.turn] = tokenizer.decode(s.ids[-1:], skip_special_tokens=False) if closed else junctions.closing_text
        want = raw[s.turn] + (ends[s.turn] if closed else "")
        if s.text != want:
            i = _first_diff(s.text, want)
            report.findings.append(Finding(FindingKind.ASSISTANT, f"turn {s.turn}: the sampled span decodes to other text than the raw sampled text (stream | raw: {_around(want, i)})", token_pos=s.start, char_pos=s.char_start + i, context=_around(s.text, i)))
        elif encode(tokenizer, want) != s.ids:
            j = _first_diff(encode(tokenizer, want), s.ids)
            report.findings.append(Finding(FindingKind.RETOKENIZE, f"turn {s.turn}: re-encoding the sampled text gives other ids from token {j} of the turn ({len(s.ids)} sampled, {len(encode(tokenizer, want))} re-encoded)", token_pos=s.start + j, context=repr(tokenizer.decode(s.ids[max(0, j - 3) : j + 3], skip_special_tokens=False)), severity=Severity.INFO))
    stream_text = "".join(s.text for s in segs)

    last_is_assistant = bool(msgs) and msgs[-1]["role"] == "assistant"
    if junctions.harmony and raw is not None:
        turn_texts = [text + ends.get(k, junctions.closing_text) for k, text in enumerate(raw)]
        expected = harmony.render_with_turns(tokenizer, msgs, turn_texts, tools, add_generation_prompt=not last_is_assistant, **kw)
        was, now = harmony.render_date(segs[0].text), harmony.render_date(expected)
        if was is not None and now is not None and was[0] != now[0]:  # played on another day (module docstring)
            expected = expected[: now[1]] + was[0] + expected[now[1] + len(now[0]) :]
            report.findings.append(Finding(FindingKind.RENDER_DATE, f"the prompt was rendered on {was[0]}, the re-render on {now[0]} "
                                           "(the template writes the day's date): checked with the prompt's date", severity=Severity.INFO))  # fmt: skip
        spans = {s.turn: s for s in segs if s.sampled}
        for k, kind in harmony.history_rewrites(msgs, raw, ends):
            kind, span = FindingKind(kind), spans.get(k)
            report.findings.append(Finding(kind, f"turn {k}: {REWRITES[kind]} (history rewrite by design: the stream keeps what was sampled)",
                                           token_pos=span.start if span else None, char_pos=span.char_start if span else None,
                                           severity=Severity.REWRITE))  # fmt: skip
    else:
        expected = render(tokenizer, msgs, tools, add_generation_prompt=not last_is_assistant, **kw)
    normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
    norm = normalizer.normalize_str if normalizer is not None else (lambda text: text)
    closing = junctions.closing_text if last_is_assistant else ""
    for f in _walk_text(segs, norm(expected), stop_text, closing, opened_reasoning(tokenizer, kw), norm):
        if f.kind == FindingKind.TEXT:
            f.token_pos = _token_at_char(tokenizer, segs, f.char_pos)
        report.findings.append(f)

    for s in segs:
        if s.sampled:
            continue
        want_ids = encode(tokenizer, s.text)
        if want_ids != s.ids:
            j = _first_diff(s.ids, want_ids)
            where = "the prompt" if s.turn < 0 else f"the observation after turn {s.turn}"
            local = len(tokenizer.decode(s.ids[:j], skip_special_tokens=False))
            report.findings.append(Finding(FindingKind.TOKENS, f"{where}: token {j} of the segment is {s.ids[j:j + 3]}, its text tokenizes to {want_ids[j:j + 3]}", token_pos=s.start + j, char_pos=s.char_start + local, context=_around(stream_text, s.char_start + local)))
    return report


def check_stored_episode(tokenizer: PreTrainedTokenizerBase, episode: Episode, **template_kwargs: Any) -> DriftReport:
    """`check_episode` over an Episode: its messages, tools, tokens, the turns' raw texts and the chat-template
    options the agent loop rendered with (`info["template_kwargs"]`, e.g. enable_thinking)."""
    if episode.tokens is None:
        raise ValueError(f"episode {episode.task_id!r} has no token stream")
    # Turn.raw_text is "" when the agent loop did not record it: then the messages are rendered as they are.
    raw = [t.raw_text for t in episode.turns] if any(t.raw_text for t in episode.turns) else None
    guided = dict(zip(episode.info.get(INTERVENED, ()), episode.info.get(INTERVENED_TOKENS, ()), strict=True))
    kw = {**episode.info.get(TEMPLATE_KWARGS, {}), **template_kwargs}  # what the agent loop rendered with
    return check_episode(tokenizer, episode.messages, episode.tools, episode.tokens, raw, template_kwargs=kw, guided=guided)


def format_report(report: DriftReport, name: str = "episode") -> str:
    """Human-readable lines for `agentopd check-tokens`."""
    status = "OK" if report.ok else f"DRIFT ({len(report.drift)} finding{'s' * (len(report.drift) != 1)})"
    extra = "".join(f", {len(found)} {label}" for found, label in ((report.info, "info"), (report.rewrites, "template rewrites")) if found)
    lines = [f"{name}: {status} — {report.num_tokens} tokens, {report.num_turns} turns{extra}"]
    for f in report.findings:
        where = " ".join(x for x in (f"token {f.token_pos}" if f.token_pos is not None else "", f"char {f.char_pos}" if f.char_pos is not None else "") if x)
        severity = "" if f.severity == Severity.DRIFT else f"{f.severity} "
        lines.append(f"  {severity}[{f.kind}]{' at ' + where if where else ''}: {f.message}")
        if f.context:
            lines.append(f"      {'re-render' if f.severity == Severity.REWRITE else 'stream'}: {f.context}")
    return "\n".join(lines)
