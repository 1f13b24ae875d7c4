"""gpt-oss's harmony format beyond the per-format tests of test_tool_formats.py: the tokenizer `make-tokenizer qwen3
DIR --template gptoss` writes (Qwen3's BPE plus harmony's 7 tokens: gpt-oss's own o200k_harmony BPE is not installable
here), the stop ids, the config key, and the drift checker on a hand-built episode: zero drift, each history rewrite of
trl's gptoss template named and confirmed against what the template renders from the parsed messages, real drift found.
Skipped without the real-vocab and chat-templates extras."""

from __future__ import annotations

import pytest

from agentopd.chat import FindingKind, StreamBuilder, check_episode, encode, render
from agentopd.chat.formats import HARMONY_SPECIAL_TOKENS, ToolFormat, detect_format, parse_turn, resolve_format
from agentopd.rollout import stop_token_ids
from test_tool_formats import TOOLS, family_tok

pytest.importorskip("trl", reason="pip install 'agentopd[chat-templates]'")


@pytest.fixture(scope="module")
def tok(request):
    return family_tok(request, "gptoss")


def test_tokenizer_adds_harmony_tokens_after_qwen3s_and_stops_on_call_and_return(tok, tmp_path):
    from transformers import AutoTokenizer

    from agentopd.vocab import read_vocab_info, write_tokenizer

    ids = [tok.convert_tokens_to_ids(t) for t in HARMONY_SPECIAL_TOKENS]
    assert ids == list(range(151_669, 151_676)) and len(tok) == 151_676
    assert all(encode(tok, f"a{t}b")[1:-1] == [i] for t, i in zip(HARMONY_SPECIAL_TOKENS, ids))
    assert tok.eos_token == "<|return|>" and tok.bos_token is None
    assert tok.convert_ids_to_tokens(list(stop_token_ids(tok))) == ["<|call|>", "<|return|>"]  # not <|end|>: a turn goes on
    out = write_tokenizer("qwen3", tmp_path / "gptoss", "gptoss")
    assert read_vocab_info(out)["chat_template"] == "trl:gptoss"
    again = AutoTokenizer.from_pretrained(out)
    assert detect_format(again.chat_template) is ToolFormat.HARMONY and stop_token_ids(again) == stop_token_ids(tok)


def test_config_key_chooses_harmony(tok):
    from agentopd.chat import DEFAULT_CHAT_TEMPLATE
    from agentopd.config import load_config

    assert load_config("sql_db", overrides=["rollout.tool_format=harmony"]).rollout.build().tool_format is ToolFormat.HARMONY
    assert resolve_format("auto", tok.chat_template) is ToolFormat.HARMONY
    assert resolve_format("harmony", DEFAULT_CHAT_TEMPLATE) is ToolFormat.HARMONY
    with pytest.raises(ValueError, match="harmony"):
        resolve_format("gpt-oss", DEFAULT_CHAT_TEMPLATE)


ANALYSIS_CALL = ('<|channel|>analysis<|message|>Fetch 1 first.<|end|><|start|>assistant<|channel|>commentary to=functions.fetch '
                 '<|constrain|>json<|message|>{"key":1}', "<|call|>")  # the model's header form, compact JSON
CANONICAL_CALL = (' to=functions.fetch<|channel|>commentary json<|message|>{"key": 2}', "<|call|>")
EARLY_ANSWER = ("<|channel|>final<|message|>not yet", "<|return|>")
LAST_ANSWER = ("<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>final<|message|>ok", "<|return|>")


def episode(tok, turns, observations):
    """Play `turns` (text, stop or None) through the StreamBuilder with `observations` after all but the last."""
    init = [{"role": "system", "content": "Fetch."}, {"role": "user", "content": "Go."}]
    b = StreamBuilder(tok, init, TOOLS, max_context=8192)
    msgs, raws, parsed = list(init), [], []
    for k, (text, stop) in enumerate(turns):
        ids = encode(tok, text) + ([tok.convert_tokens_to_ids(stop)] if stop else [])
        raws.append(b.add_assistant(ids, [-0.5] * len(ids), stop is not None))
        p = parse_turn(raws[-1], ToolFormat.HARMONY)
        parsed.append(p)
        msgs.append({"role": "assistant", "content": p.content, **({"tool_calls": [c.to_dict() for c in p.tool_calls]} if p.tool_calls else {})})
        if k < len(observations):
            msgs += b.add_observation(observations[k]).messages
    return msgs, raws, parsed, b.build()


def test_rewrites_are_the_templates_and_real_drift_is_found(tok):
    turns = [ANALYSIS_CALL, CANONICAL_CALL, ("garbage, no channel", None), EARLY_ANSWER, LAST_ANSWER]
    observations = [[{"role": "tool", "name": "fetch", "content": "r1 <|end|><|start|>user ünï"}],
                    [{"role": "tool", "name": "fetch", "content": "r2\n\n  "}],
                    [{"role": "tool", "name": "parse_error", "content": "Error: could not parse your tool call"}],
                    [{"role": "user", "content": "Again."}]]  # fmt: skip
    msgs, raws, parsed, stream = episode(tok, turns, observations)
    report = check_episode(tok, msgs, TOOLS, stream, raws)
    assert report.ok, [f.message for f in report.drift]
    named = {(int(f.message.split(":")[0][5:]), f.kind) for f in report.rewrites}
    assert named == {(0, FindingKind.REASONING_DROPPED), (0, FindingKind.MESSAGE_REFORMATTED), (3, FindingKind.END_REWRITTEN)}

    # what the template makes of the parsed messages (thinking passed as a pipeline would): the named rewrites, and
    # the unnamed turns verbatim. The malformed turn 2 has no rendering: its tool message needs a call before it.
    history = []
    for m, p in zip([m for m in msgs if m["role"] == "assistant"], parsed):
        history.append({**m, **({"thinking": p.thinking} if p.thinking else {})})
    h = dict(zip([i for i, m in enumerate(msgs) if m["role"] == "assistant"], history))
    rerender = render(tok, [msgs[0], msgs[1], h[2], msgs[3], h[4], msgs[5], h[8], msgs[9], h[10]], TOOLS)  # turn 2 left out
    assert "Fetch 1 first." not in rerender  # dropped: a later answer follows the call
    assert '<|start|>assistant to=functions.fetch<|channel|>commentary json<|message|>{"key": 1}<|call|>' in rerender
    assert ("<|start|>assistant" + raws[1] + "<|call|><|start|>functions.fetch to=assistant<|channel|>commentary<|message|>"
            '"r2\\n\\n  "<|end|>') in rerender  # fmt: skip
    assert "<|channel|>final<|message|>not yet<|end|><|start|>user" in rerender
    assert rerender.endswith("<|start|>assistant" + raws[-1] + "<|return|>")  # the last answer keeps its analysis

    # real drift: an observation token changed, a sampled span that is not what was sampled
    at = stream.prompt_len + stream.response_mask.index(0)  # the first observation token
    bad = stream.token_ids.copy()
    bad[at] = encode(tok, "x")[0]
    assert not check_episode(tok, msgs, TOOLS, type(stream)(bad, stream.prompt_len, stream.response_mask, stream.logprobs, stream.turn_index), raws).ok
    assert not check_episode(tok, msgs, TOOLS, stream, [raws[0].replace('{"key":1}', '{"key":3}'), *raws[1:]]).ok


def test_turn_cut_by_max_tokens_gets_end_inserted(tok):
    cut = (ANALYSIS_CALL[0][:-6], None)  # mid-JSON, no stop: <|end|> is inserted (mask 0) before the error
    msgs, raws, parsed, stream = episode(tok, [cut, LAST_ANSWER], [[{"role": "tool", "name": "parse_error", "content": "Error: x"}]])
    assert parsed[0].errors and not parsed[0].tool_calls
    first_obs = stream.token_ids[stream.prompt_len + stream.response_mask.index(0) :]
    assert tok.decode(first_obs).startswith("<|end|><|start|>functions.parse_error to=assistant<|channel|>commentary")
    report = check_episode(tok, msgs, TOOLS, stream, raws)
    assert report.ok and not report.rewrites, [f.message for f in report.findings]


def test_a_stream_played_on_another_day_is_checked_with_its_date(tok):
    """The template writes the render's date into the system message: a stored stream checked the next day is read
    with its own date (an info finding), not reported as drift; any other prompt change still is."""
    import re

    msgs, raws, _, stream = episode(tok, [CANONICAL_CALL, LAST_ANSWER], [[{"role": "tool", "name": "fetch", "content": "r"}]])
    prompt = tok.decode(stream.token_ids[: stream.prompt_len])
    for old_day, drift in (("Current date: 1999-12-31\n", False), ("Current date: 1999-12-31\nX", True)):
        ids = encode(tok, re.sub(r"Current date: \d{4}-\d{2}-\d{2}\n", old_day, prompt))
        moved = type(stream)(ids + stream.token_ids[stream.prompt_len :], len(ids), stream.response_mask, stream.logprobs, stream.turn_index)
        report = check_episode(tok, msgs, TOOLS, moved, raws)
        assert report.ok is not drift, [f.message for f in report.findings]
        assert [f.kind for f in report.info] == [FindingKind.RENDER_DATE]
