"""Drift checker: zero drift on streams built by StreamBuilder; planted drift is found and located."""

from __future__ import annotations

import random

import pytest

from agentopd.chat import FindingKind, Severity, StreamBuilder, build_tokenizer, check_episode, check_stored_episode, encode, format_report, parse_assistant, render
from agentopd.types import Episode, Message, StopReason, TokenStream, Turn
from test_stream import TOOLS, simulate_episode, tok  # noqa: F401  (tok is a fixture)

# The model formats its call its own way (no spaces) and thinks first: a re-render of the
# parsed message would differ from what was sampled.
SAMPLED_1 = '<think>\nadd them\n</think>\n\nLet me check.\n<tool_call>\n{"name":"calc","arguments":{"x":"1+1"}}\n</tool_call>'
SAMPLED_2 = "The answer is 2."


def play(tok, texts=(SAMPLED_1, SAMPLED_2), tool_out="2", non_canonical_first=False):
    """A two-turn episode: (messages as the agent loop stores them, stream, raw texts, builder)."""
    init = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 1+1?"}]
    b = StreamBuilder(tok, init, TOOLS, max_context=4096)
    msgs = list(init)
    for k, text in enumerate(texts):
        ids = [i for ch in text for i in encode(tok, ch)] if (k == 0 and non_canonical_first) else encode(tok, text)
        ids = ids + [tok.eos_token_id]
        raw = b.add_assistant(ids, [-0.5] * len(ids), finished_by_stop=True)
        p = parse_assistant(raw)
        msgs.append({"role": "assistant", "content": p.content, "tool_calls": [c.to_dict() for c in p.tool_calls]})
        if k < len(texts) - 1:
            msgs += b.add_observation([{"role": "tool", "name": "calc", "content": tool_out}]).messages
    return msgs, b.build(), b.raw_assistant_texts, b


def kinds(report):
    return {f.kind for f in report.drift}


def rebuild(s: TokenStream, ids: list[int], mask: list[int], turns: list[int]) -> TokenStream:
    return TokenStream(ids, s.prompt_len, mask, [(-0.5 if m else 0.0) for m in mask], turns)


def test_good_streams_have_zero_drift(tok):
    msgs, s, raw, _ = play(tok)
    report = check_episode(tok, msgs, TOOLS, s, raw)
    assert report.ok and report.findings == [] and report.num_turns == 2
    assert format_report(report, "ep 1").startswith("ep 1: OK — ")
    rng = random.Random(7)
    for _ in range(50):
        ep = simulate_episode(tok, rng)
        assert check_episode(tok, ep.messages, TOOLS, ep.builder.build(), ep.builder.raw_assistant_texts).ok


def test_dropped_newline_is_found_and_located(tok):
    msgs, s, raw, b = play(tok)
    n0 = s.response_mask.index(0)  # the first junction token: the newline after <|im_end|>
    at = s.prompt_len + n0
    assert tok.decode([s.token_ids[at]]) == "\n"
    keep = [i for i in range(len(s.response_mask)) if i != n0]
    bad = rebuild(s, s.token_ids[:at] + s.token_ids[at + 1 :], [s.response_mask[i] for i in keep], [s.turn_index[i] for i in keep])
    report = check_episode(tok, msgs, TOOLS, bad, raw)
    assert not report.ok and FindingKind.TEXT in kinds(report)
    f = next(f for f in report.drift if f.kind == FindingKind.TEXT)
    assert f.token_pos == at  # the token that stands where the newline should be
    assert "<|im_end|>" in f.context and "<|im_start|>user" in f.context
    text = format_report(report, "ep 2")
    assert "DRIFT" in text and f"token {at}" in text and "[text]" in text


def test_rerendered_history_is_found(tok):
    """A pipeline that rebuilds history from parsed messages (re-render + re-tokenize) drifts."""
    msgs, s, raw, b = play(tok)
    parsed_text = render(tok, [msgs[2]])[len("<|im_start|>assistant\n") : -len("<|im_end|>\n")]
    assert parsed_text != raw[0]  # JSON spacing and thinking differ from what was sampled
    span = [i for i, (m, t) in enumerate(zip(s.response_mask, s.turn_index)) if m == 1 and t == 0]
    new_span = encode(tok, parsed_text + "<|im_end|>")
    resp = s.response_ids
    ids = s.token_ids[: s.prompt_len] + new_span + resp[span[-1] + 1 :]
    mask = [1] * len(new_span) + s.response_mask[span[-1] + 1 :]
    turns = [0] * len(new_span) + s.turn_index[span[-1] + 1 :]
    report = check_episode(tok, msgs, TOOLS, rebuild(s, ids, mask, turns), raw)
    assert {FindingKind.ASSISTANT, FindingKind.TEXT} <= kinds(report)
    # the same stream is consistent with the parsed messages: only the raw texts expose it
    assert check_episode(tok, msgs, TOOLS, rebuild(s, ids, mask, turns)).ok


def test_without_raw_texts_a_good_stream_shows_the_rerender_gap(tok):
    msgs, s, raw, _ = play(tok)
    assert check_episode(tok, msgs, TOOLS, s, raw).ok
    report = check_episode(tok, msgs, TOOLS, s)  # messages hold parsed calls: re-render differs
    assert FindingKind.TEXT in kinds(report)
    # raw texts given with the stop token are accepted too
    assert check_episode(tok, msgs, TOOLS, s, [t + "<|im_end|>" for t in raw]).ok


def test_non_canonical_sample_is_info_not_drift(tok):
    msgs, s, raw, _ = play(tok, non_canonical_first=True)
    report = check_episode(tok, msgs, TOOLS, s, raw)
    assert report.ok and [f.kind for f in report.info] == [FindingKind.RETOKENIZE]
    assert report.info[0].severity == Severity.INFO and "turn 0" in report.info[0].message
    assert "info [retokenize]" in format_report(report)


def test_retokenized_non_assistant_segment_is_token_drift(tok):
    msgs, s, raw, _ = play(tok)
    # split one multi-character prompt token into single-character tokens: same text, other ids
    i = next(i for i, t in enumerate(s.token_ids[: s.prompt_len]) if len(tok.decode([t])) >= 3 and t > 8)
    pieces = [x for ch in tok.decode([s.token_ids[i]]) for x in encode(tok, ch)]
    ids = s.token_ids[:i] + pieces + s.token_ids[i + 1 :]
    bad = TokenStream(ids, s.prompt_len + len(pieces) - 1, s.response_mask, s.logprobs, s.turn_index)
    report = check_episode(tok, msgs, TOOLS, bad, raw)
    assert kinds(report) == {FindingKind.TOKENS}
    assert report.drift[0].token_pos == i and "the prompt" in report.drift[0].message


def test_invariants(tok):
    msgs, s, raw, _ = play(tok)
    d = s.to_dict()

    def check(**changes):
        return check_episode(tok, msgs, TOOLS, {**d, **changes}, raw)

    r = check(logprobs=d["logprobs"][:-1])
    assert [f.kind for f in r.findings] == [FindingKind.INVARIANT] and "len(logprobs)" in r.findings[0].message
    assert "prompt_len" in check(prompt_len=len(d["token_ids"]) + 1).findings[0].message
    first0 = d["response_mask"].index(0)
    lp = list(d["logprobs"])
    lp[first0] = -0.1
    r = check(logprobs=lp)
    assert any("where the mask is 0" in f.message and f.token_pos == s.prompt_len + first0 for f in r.drift)
    lp = list(d["logprobs"])
    lp[0] = 0.5
    assert any("not a finite value <= 0" in f.message for f in check(logprobs=lp).drift)
    mask = list(d["response_mask"])
    mask[0] = 2
    assert any("not 0/1" in f.message for f in check(response_mask=mask).drift)
    turns = [t * 2 for t in d["turn_index"]]
    assert any("does not follow" in f.message for f in check(turn_index=turns).drift)
    mask = list(d["response_mask"])
    mask[first0 + 1] = 1  # a "sampled" token inside the observation
    assert any("mask 1 after mask 0" in f.message for f in check(response_mask=mask).drift)
    ids = list(d["token_ids"])
    ids[3] = len(tok) + 5
    assert any("outside the vocabulary" in f.message for f in check(token_ids=ids).drift)


def test_structure_and_tail(tok):
    msgs, s, raw, _ = play(tok)
    r = check_episode(tok, msgs[:-1], TOOLS, s, raw[:-1])
    assert FindingKind.STRUCTURE in kinds(r)
    # messages the stream never reached (e.g. a tool result dropped without a trace) are drift
    r = check_episode(tok, msgs + [{"role": "tool", "content": "late"}], TOOLS, s, raw)
    assert FindingKind.TEXT in kinds(r)
    # a final turn cut by max_tokens: the missing closing is allowed
    msgs2, s2, raw2, b2 = play(tok, texts=(SAMPLED_1,))
    cut = TokenStream(s2.token_ids[:-1], s2.prompt_len, s2.response_mask[:-1], s2.logprobs[:-1], s2.turn_index[:-1])
    raw_cut = [tok.decode(cut.response_ids)]
    msgs_cut = msgs2[:-1] + [{"role": "assistant", "content": raw_cut[0]}]
    assert check_episode(tok, msgs_cut, TOOLS, cut, raw_cut).ok


def test_check_stored_episode(tok):
    msgs, s, raw, _ = play(tok)
    turns = [Turn(assistant=Message.from_dict(msgs[2]), observation=[Message.from_dict(msgs[3])], raw_text=raw[0]),
             Turn(assistant=Message.from_dict(msgs[4]), observation=[], raw_text=raw[1])]
    ep = Episode(env="calculator", task_id="t1", messages=[Message.from_dict(m) for m in msgs], tools=TOOLS, turns=turns,
                 reward=1.0, success=True, stop_reason=StopReason.ANSWER, tokens=s)
    assert check_stored_episode(tok, ep).ok
    ep.tokens = None
    with pytest.raises(ValueError, match="no token stream"):
        check_stored_episode(tok, ep)


def test_a_template_that_rewrites_history_is_named_not_drift():
    """A Qwen3-like template (Qwen3's own, with a real BPE and thinking on and off: tests/test_real_vocab_streams.py)
    re-renders the last turn with an empty think block and drops earlier turns' reasoning: check-tokens names each
    rewrite (severity "rewrite") and reports no drift, since the stream holds what was sampled. A turn whose mask-1
    tokens are the template's re-render, not the sample, is still drift."""
    qwen_like = build_tokenizer(["some text 123 <think> </think>"], vocab_size=400)
    qwen_like.chat_template = (
        "{% for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}\n"
        "{% if m.role == 'assistant' and '</think>' in m.content %}{% set c = m.content.split('</think>')[-1].lstrip('\\n') %}"
        "{% if loop.last %}{{ '<think>\\n' + m.content.split('</think>')[0].split('<think>')[-1].strip('\\n') + '\\n</think>\\n\\n' }}{% endif %}"
        "{% elif m.role == 'assistant' and loop.last %}{% set c = '<think>\\n\\n</think>\\n\\n' + m.content %}"
        "{% else %}{% set c = m.content %}{% endif %}"
        "{{ c }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    init = [{"role": "user", "content": "q"}]
    b = StreamBuilder(qwen_like, init, None, max_context=1000)
    msgs = list(init)
    for k, text in enumerate(["<think>\nx\n</think>\n\ncall", "answer"]):
        ids = encode(qwen_like, text) + [qwen_like.eos_token_id]
        b.add_assistant(ids, [-1.0] * len(ids), True)
        msgs.append({"role": "assistant", "content": text})
        if k == 0:
            msgs += b.add_observation([{"role": "tool", "content": "r"}]).messages
    s, raw = b.build(), b.raw_assistant_texts
    report = check_episode(qwen_like, msgs, None, s, raw)
    assert report.ok and [(f.kind, f.severity) for f in report.findings] == [
        (FindingKind.REASONING_DROPPED, Severity.REWRITE), (FindingKind.REASONING_INSERTED, Severity.REWRITE)]
    assert "rewrite [reasoning_inserted]" in format_report(report) and "2 template rewrites" in format_report(report)
    # a pipeline that trained on the re-rendered last turn (the empty think block, mask 1) drifts
    last = s.turn_index.index(1)
    rerendered = encode(qwen_like, "<think>\n\n</think>\n\nanswer") + [qwen_like.eos_token_id]
    bad = TokenStream(s.token_ids[: s.prompt_len + last] + rerendered, s.prompt_len, s.response_mask[:last] + [1] * len(rerendered),
                      s.logprobs[:last] + [-1.0] * len(rerendered), s.turn_index[:last] + [1] * len(rerendered))  # fmt: skip
    assert FindingKind.ASSISTANT in kinds(check_episode(qwen_like, msgs, None, bad, raw))
