"""Tool-call parser: well-formed calls, and every malformed case becomes an error, never an exception."""

import random

import pytest

from agentopd.chat import parse_assistant
from agentopd.types import ToolCall


def call(name, args, sep=(", ", ": ")):
    import json

    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, separators=sep, ensure_ascii=False) + "\n</tool_call>"


def test_plain_answer():
    t = parse_assistant("The answer is 42.")
    assert (t.content, t.tool_calls, t.errors, t.ok) == ("The answer is 42.", [], [], True)


def test_one_and_several_calls_with_content():
    t = parse_assistant("Let me look.\n" + call("sql_query", {"query": "SELECT 1"}) + "\n" + call("calc", {"x": "日本"}, (",", ":")))
    assert t.ok and t.content == "Let me look."
    assert t.tool_calls == [ToolCall("sql_query", {"query": "SELECT 1"}), ToolCall("calc", {"x": "日本"})]


def test_stop_token_suffix_ignored():
    t = parse_assistant(call("calc", {"x": 1}) + "<|im_end|>")
    assert t.ok and t.tool_calls == [ToolCall("calc", {"x": 1})] and t.content == ""


def test_thinking_split_off():
    t = parse_assistant("<think>\nI should add.\n</think>\n\n" + call("calc", {"x": "1+1"}))
    assert t.ok and t.thinking == "I should add." and t.content == "" and len(t.tool_calls) == 1
    t = parse_assistant("only the close tag</think>\n\nfinal")  # Qwen3: the prompt opened the block
    assert t.ok and t.thinking == "only the close tag" and t.content == "final"


def test_unclosed_think():
    t = parse_assistant("<think>\nI am still thinking when max_tokens hits")
    assert not t.ok and "unclosed <think>" in t.errors[0] and t.content == ""


@pytest.mark.parametrize(
    "text, needle",
    [
        ('<tool_call>\n{"name": "calc", "arguments": {"x": 1', "unclosed <tool_call>"),  # max_tokens mid-call
        ('<tool_call>\n{"name": "calc", "arguments": {"x": 1}\n</tool_call>', "invalid JSON"),
        ("<tool_call>\nnot json at all\n</tool_call>", "invalid JSON"),
        ('<tool_call>\n["calc", {}]\n</tool_call>', "expected a JSON object"),
        ('<tool_call>\n{"arguments": {"x": 1}}\n</tool_call>', 'missing "name"'),
        ('<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>', 'missing "name"'),
        ('<tool_call>\n{"name": "  ", "arguments": {}}\n</tool_call>', 'missing "name"'),
        ('<tool_call>\n{"name": "calc", "arguments": [1, 2]}\n</tool_call>', "must be a JSON object"),
        ('<tool_call>\n{"name": "calc", "arguments": "{bad"}\n</tool_call>', "not valid JSON"),
        ('<tool_call>\n{"name": "calc", "arguments": "[1]"}\n</tool_call>', "must be a JSON object"),
        ("answer </tool_call>", "stray </tool_call>"),
        ("", "empty output"),
        ("   \n ", "empty output"),
        ("<|im_end|>", "empty output"),
        ("<think>hmm</think>", "empty output"),
    ],
)
def test_malformed_becomes_error(text, needle):
    t = parse_assistant(text)
    assert not t.ok and any(needle in e for e in t.errors), t.errors
    assert t.tool_calls == []


def test_lenient_arguments_forms():
    assert parse_assistant('<tool_call>\n{"name": "f"}\n</tool_call>').tool_calls == [ToolCall("f", {})]
    assert parse_assistant('<tool_call>{"name": "f", "arguments": null}</tool_call>').tool_calls == [ToolCall("f", {})]
    assert parse_assistant('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>').tool_calls == [ToolCall("f", {"a": 1})]


def test_broken_call_among_good_ones_keeps_the_good_ones_and_numbers_the_bad():
    t = parse_assistant(call("a", {}) + "\n<tool_call>\n{oops}\n</tool_call>\n" + call("b", {"k": [1]}))
    assert [c.name for c in t.tool_calls] == ["a", "b"]
    assert len(t.errors) == 1 and t.errors[0].startswith("tool call 2: invalid JSON")


def test_text_after_calls_is_content_not_error():
    t = parse_assistant(call("a", {}) + "\nand then some words")
    assert t.ok and t.content == "and then some words" and t.tool_calls == [ToolCall("a", {})]


def test_unclosed_after_a_good_call():
    t = parse_assistant(call("a", {}) + '\n<tool_call>\n{"name": "b", "argu')
    assert t.tool_calls == [ToolCall("a", {})] and "tool call 2: unclosed" in t.errors[0]


def test_never_raises_on_random_garbage():
    rng = random.Random(0)
    pieces = ["<tool_call>", "</tool_call>", "<think>", "</think>", "{", "}", '"name"', ":", '"arguments"', "[", "]", ",", "x", "\n", " ", "null", "1e999", '"', "\\", "<|im_end|>", "日本"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        t = parse_assistant(text)
        assert isinstance(t.content, str) and all(isinstance(c, ToolCall) for c in t.tool_calls)
        assert all(isinstance(c.arguments, dict) and c.name for c in t.tool_calls)
