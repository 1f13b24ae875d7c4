"""Token-stream assembly: exact by construction, checked over many random multi-turn episodes.

`simulate_episode` plays the agent loop's part with a fake engine whose "sampled" ids are the
tokenizer's encoding of random assistant text + `<|im_end|>` (sometimes a non-canonical
encoding, sometimes cut by max_tokens), and random tool outputs (unicode, chat markup, long).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentopd.chat import (
    TRUNCATION_MARKER,
    ContextFull,
    StreamBuilder,
    TemplateMismatch,
    build_tokenizer,
    cap_tool_text,
    check_episode,
    encode,
    parse_assistant,
    render,
)
from agentopd.chat.stream import template_junctions

TOOLS = [
    {"type": "function", "function": {"name": "calc", "description": "Evaluate.", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "sql_query", "description": "Run SQL.", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}},
]
PIECES = [
    "the", "answer", "is", "SELECT", "name", "FROM", "users", "WHERE", "id", "=", "42", "3.14159", "ünïcödé",
    "日本語テキスト", "🙂🚀", "\u200b", "tab\there", "line\n", "\n\n", "  ", "{\"k\": [1, 2]}", "<tool_response>",
    "</tool_response>", "<|im_end|>", "<tool_call>", "<think>", "\r\n", "'quoted'", "-7", "0",
]


def rand_text(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(PIECES) + rng.choice(["", " ", " ", "\n"]) for _ in range(rng.randint(lo, hi)))


def rand_assistant(rng: random.Random) -> str:
    parts = []
    if rng.random() < 0.3:
        parts.append("<think>\n" + rand_text(rng, 0, 6).replace("<think>", "") + "\n</think>\n\n")
    if rng.random() < 0.7:
        parts.append(rand_text(rng, 1, 8).replace("<tool_call>", "").replace("<think>", ""))
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        name = rng.choice(["calc", "sql_query", "nope"])
        sep = rng.choice([(", ", ": "), (",", ":")])  # the model may format JSON its own way
        body = json.dumps({"name": name, "arguments": {"x": rand_text(rng, 0, 3)}}, separators=sep, ensure_ascii=rng.random() < 0.5)
        if rng.random() < 0.1:
            body = body[: rng.randint(0, len(body))]  # broken JSON
        parts.append(("\n" if parts else "") + "<tool_call>\n" + body + "\n</tool_call>")
    return "".join(parts)


def sample_ids(tok, rng: random.Random, text: str) -> tuple[list[int], bool]:
    """(ids the engine 'sampled' for text + <|im_end|>, whether the encoding is non-canonical)."""
    if rng.random() < 0.2 and text:
        ids = [i for ch in text for i in encode(tok, ch)]  # same text, other tokens
        return ids + [tok.eos_token_id], ids != encode(tok, text)
    return encode(tok, text) + [tok.eos_token_id], False


@dataclass
class SimEpisode:
    builder: StreamBuilder
    init: list[dict]
    messages: list[dict]
    sampled: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    tool_texts: list[list[str]] = field(default_factory=list)  # per turn: capped tool contents
    non_canonical: list[bool] = field(default_factory=list)
    capped: int = 0
    context_full: bool = False


def simulate_episode(tok, rng: random.Random) -> SimEpisode:
    init = ([{"role": "system", "content": rand_text(rng, 1, 5)}] if rng.random() < 0.8 else []) + [{"role": "user", "content": rand_text(rng, 1, 10)}]
    prompt_len = len(encode(tok, render(tok, init, TOOLS, add_generation_prompt=True)))
    max_context = rng.choice([1 << 20, prompt_len + rng.randint(20, 600)])
    b = StreamBuilder(tok, init, TOOLS, max_context=max_context, max_tool_tokens=rng.choice([None, 12, 64]))
    ep = SimEpisode(b, init, list(init))
    for turn in range(rng.randint(1, 5)):
        if not b.can_generate():
            break
        text = rand_assistant(rng)
        ids, odd = sample_ids(tok, rng, text)
        if rng.random() < 0.15:  # max_tokens hit before the stop token
            ids = ids[: rng.randint(1, max(1, len(ids) - 1))]
        ids = ids[: b.remaining_context()]
        lps = [-rng.random() * 5 for _ in ids]
        raw = b.add_assistant(ids, lps, finished_by_stop=ids[-1:] == [tok.eos_token_id])
        parsed = parse_assistant(raw)
        ep.messages.append({"role": "assistant", "content": parsed.content, "tool_calls": [c.to_dict() for c in parsed.tool_calls]})
        ep.sampled.append(ids)
        ep.logprobs.append(lps)
        ep.non_canonical.append(odd)
        if rng.random() < 0.25:
            break  # final answer
        obs = [{"role": "tool", "name": "calc", "content": rand_text(rng, 0, rng.choice([3, 30, 120]))} for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.1:
            obs.append({"role": "user", "content": "Please answer now."})
        try:
            seg = b.add_observation(obs)
        except ContextFull:
            ep.context_full = True
            break
        ep.messages.extend(seg.messages)
        ep.capped += sum(seg.truncated)
        ep.tool_texts.append([m["content"] for m in seg.messages if m["role"] == "tool"])
    return ep


@pytest.fixture(scope="module")
def tok():
    rng = random.Random(0)
    texts = [render(build_tokenizer(["x"], 300), [{"role": "user", "content": "u"}], TOOLS)]
    texts += [rand_text(rng, 5, 40) for _ in range(400)] + [TRUNCATION_MARKER.format(kept=12, total=345)] * 20
    return build_tokenizer(texts, vocab_size=800)


def raw_texts(ep: SimEpisode) -> list[str]:
    return ep.builder.raw_assistant_texts


def test_stream_properties_over_many_episodes(tok):
    rng = random.Random(1234)
    stats = dict(turns=0, capped=0, context_full=0, unclosed=0, non_canonical=0, retokenize_info=0)
    for _ in range(300):
        ep = simulate_episode(tok, rng)
        b, s = ep.builder, ep.builder.build()
        n = len(s.token_ids) - s.prompt_len
        assert len(s.response_mask) == n == len(s.logprobs) == len(s.turn_index)
        assert len(s.token_ids) <= b.max_context
        assert s.token_ids[: s.prompt_len] == encode(tok, render(tok, ep.init, TOOLS, add_generation_prompt=True))
        assert s.turn_index == sorted(s.turn_index)
        resp = s.response_ids
        for k, ids in enumerate(ep.sampled):
            pos = [i for i in range(n) if s.turn_index[i] == k and s.response_mask[i] == 1]
            assert [resp[i] for i in pos] == ids  # verbatim
            assert [s.logprobs[i] for i in pos] == ep.logprobs[k]
            assert pos == list(range(pos[0], pos[0] + len(ids)))  # one contiguous span
            closed = ids[-1] == tok.eos_token_id
            assert tok.decode(ids, skip_special_tokens=False) == raw_texts(ep)[k] + ("<|im_end|>" if closed else "")
            stats["unclosed"] += not closed
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.response_mask) if m == 0)
        for k, contents in enumerate(ep.tool_texts):  # tool results lie in mask-0 tokens
            seg = [resp[i] for i in range(n) if s.turn_index[i] == k and s.response_mask[i] == 0]
            seg_text = tok.decode(seg, skip_special_tokens=False)
            for c in contents:
                assert "<tool_response>\n" + c + "\n</tool_response>" in seg_text
                if b.max_tool_tokens is not None:
                    assert len(encode(tok, c)) <= b.max_tool_tokens
        # decoded stream == full re-render of the conversation (assistant turns as sampled text)
        msgs = list(ep.messages)
        ai = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        for i, t in zip(ai, raw_texts(ep)):
            msgs[i] = {"role": "assistant", "content": t}
        ends_with_assistant = msgs[-1]["role"] == "assistant"
        expected = render(tok, msgs, TOOLS, add_generation_prompt=not ends_with_assistant)
        decoded = tok.decode(s.token_ids, skip_special_tokens=False)
        if ends_with_assistant:
            tail = "\n" if b.turn_closed[-1] else "<|im_end|>\n"
            assert expected == decoded + tail
        else:
            assert expected == decoded
        report = check_episode(tok, ep.messages, TOOLS, s, raw_texts(ep))
        assert report.ok, report.findings
        stats["retokenize_info"] += len(report.info)
        stats["turns"] += len(ep.sampled)
        stats["capped"] += ep.capped
        stats["context_full"] += ep.context_full
        stats["non_canonical"] += sum(ep.non_canonical)
    # the generator really exercised every case
    assert all(v > 10 for v in stats.values()), stats
    assert stats["retokenize_info"] >= stats["non_canonical"] - 5, stats


def test_junction_tokens_inserted_with_mask_zero(tok):
    b = StreamBuilder(tok, [{"role": "user", "content": "q"}], None, max_context=1000)
    assert b.token_ids == encode(tok, "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")
    ids = encode(tok, "a<|im_end|>")
    b.add_assistant(ids, [-1.0] * len(ids), finished_by_stop=True)
    seg = b.add_observation([{"role": "tool", "content": "r"}])
    assert seg.num_junction_tokens == 1 and seg.token_ids[:1] == encode(tok, "\n")
    assert tok.decode(seg.token_ids) == "\n<|im_start|>user\n<tool_response>\nr\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # a turn cut by max_tokens: the whole closing is inserted
    ids = encode(tok, "cut")
    assert b.add_assistant(ids, [-1.0] * len(ids), finished_by_stop=False) == "cut"
    seg = b.add_observation([{"role": "tool", "content": "r2"}])
    assert seg.num_junction_tokens == 2 and tok.decode(seg.token_ids[:2]) == "<|im_end|>\n"
    s = b.build()
    assert s.response_mask == [1, 1] + [0] * (len(s.response_mask) - 2 - len(ids) - 2 - (len(seg.token_ids) - 2)) + [1] * len(ids) + [0] * len(seg.token_ids)
    assert template_junctions(tok).closing_text == "<|im_end|>\n"


def test_tool_output_capped_in_tokens_with_visible_marker(tok):
    long = "SELECT name FROM users WHERE id = 42; " * 80
    msgs = [{"role": "tool", "name": "sql_query", "content": long}]
    b = StreamBuilder(tok, [{"role": "user", "content": "q"}], TOOLS, max_context=100_000, max_tool_tokens=40)
    b.add_assistant([tok.eos_token_id], [-0.1], finished_by_stop=True)
    seg = b.add_observation(msgs)
    capped = seg.messages[0]["content"]
    assert msgs[0]["content"] == long  # input untouched
    assert seg.truncated == [True] and capped != long
    assert capped.endswith(TRUNCATION_MARKER.format(kept=_kept(capped), total=len(encode(tok, long))))
    assert _kept(capped) > 20
    assert long.startswith(capped[: capped.index("\n[truncated")])
    assert len(encode(tok, capped)) <= 40
    assert capped in tok.decode(seg.token_ids)
    short = b.cap_messages([{"role": "tool", "content": "ok"}, {"role": "user", "content": long}])
    assert short == ([{"role": "tool", "content": "ok"}, {"role": "user", "content": long}], [False, False])  # users are not capped


def _kept(capped: str) -> int:
    return int(capped.rsplit("[truncated: ", 1)[1].split("/")[0])


@settings(max_examples=150, deadline=None)
@given(text=st.text(min_size=0, max_size=300), max_tokens=st.integers(1, 60))
def test_cap_tool_text_property(tok, text, max_tokens):
    capped, cut = cap_tool_text(tok, text, max_tokens)
    if not cut:
        assert capped == text and len(encode(tok, text)) <= max_tokens
    else:
        body = capped.rsplit("\n[truncated: ", 1)[0]
        assert text.startswith(body)
        assert len(encode(tok, capped)) <= max_tokens or _kept(capped) == 0


def test_context_full_leaves_stream_unchanged(tok):
    prompt = [{"role": "user", "content": "q"}]
    b = StreamBuilder(tok, prompt, None, max_context=len(b_ids := encode(tok, render(tok, prompt, add_generation_prompt=True))) + 8)
    ids = encode(tok, "hi<|im_end|>")
    b.add_assistant(ids, [-1.0] * len(ids), True)
    before = b.build()
    with pytest.raises(ContextFull) as e:
        b.add_observation([{"role": "tool", "content": "a long tool output " * 5}])
    assert e.value.available == 8 - len(ids)
    assert b.build() == before and b.token_ids[: len(b_ids)] == b_ids
    # the budget for the next turn
    assert b.remaining_context() == 8 - len(ids)


def test_misuse_is_a_value_error(tok):
    b = StreamBuilder(tok, [{"role": "user", "content": "q"}], None, max_context=50)
    with pytest.raises(ValueError, match="follow an assistant turn"):
        b.add_observation([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="differ in length"):
        b.add_assistant([1, 2], [0.0], True)
    with pytest.raises(ValueError, match="remaining context"):
        b.add_assistant([5] * 100, [0.0] * 100, False)
    b.add_assistant([5], [-1.0], False)
    with pytest.raises(ValueError, match="add the observation first"):
        b.add_assistant([5], [-1.0], False)
    with pytest.raises(ValueError, match="at least one message"):
        b.add_observation([])
    with pytest.raises(ValueError, match="max_tool_tokens"):
        StreamBuilder(tok, [], None, max_context=10, max_tool_tokens=0)


def test_non_append_only_template_fails_loudly(tok):
    odd = build_tokenizer(["some text 123"], vocab_size=400)
    # The first line counts the messages: appending messages rewrites the prefix.
    odd.chat_template = "{{ messages | length }}\n{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    b = StreamBuilder(odd, [{"role": "user", "content": "q"}], None, max_context=1000)
    b.add_assistant(encode(odd, "a<|im_end|>"), [-1.0, -1.0], True)
    with pytest.raises(TemplateMismatch, match="changed the tokens before them"):
        b.add_observation([{"role": "tool", "content": "r"}])


def test_template_that_special_cases_the_last_assistant_turn(tok):
    """Like Qwen3's own template: the final assistant turn gets an empty think block when it has
    none. The synthetic prefix carries a think block, so deltas stay exact."""
    qwen_like = build_tokenizer(["some text 123"], vocab_size=400)
    qwen_like.chat_template = (
        "{% for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}\n"
        "{% if m.role == 'assistant' and loop.last and '</think>' not in m.content %}<think>\n\n</think>\n\n{% endif %}"
        "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    b = StreamBuilder(qwen_like, [{"role": "user", "content": "q"}], None, max_context=1000)
    ids = encode(qwen_like, "<think>\nx\n</think>\n\na<|im_end|>")
    b.add_assistant(ids, [-1.0] * len(ids), True)
    seg = b.add_observation([{"role": "tool", "content": "r"}])
    assert qwen_like.decode(seg.token_ids) == "\n<|im_start|>user\nr<|im_end|>\n<|im_start|>assistant\n"
