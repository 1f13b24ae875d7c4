"""Tool calls as instruct models really write them in the hermes family: bare JSON, or a fenced JSON block.

    turn = read_bare_calls(text, {"calculate"})    # a ParsedTurn with the calls, or None: the text is an answer

Qwen2.5-Coder-1.5B-Instruct, asked with its own hermes tool block in the system prompt, writes
`{"name": "calculate", "arguments": {"expression": "(31 * 14) + 9"}}` with no `<tool_call>` tags, and the 0.5B the
same inside a ```` ```json ```` fence. `rollout.tool_parsing=lenient` (the default) reads such a turn as a call when,
and only when, it names a tool the episode offers:

- the whole turn (thinking aside) is one or more JSON objects, or it holds fenced blocks (```` ``` ````,
  ```` ```json ````) whose bodies are JSON objects, each `{"name": <an offered tool>, "arguments": {...}}`
  (`"parameters"` is read too, as Llama writes it). Text around fenced calls, other fenced code included, is the
  turn's content.
- an object of exactly a call's shape (`{"name": ..., "arguments": {...}}`, no other key) that names a tool not offered
  is a call gone wrong, not an answer: the model reads "no tool is named 'employees'; the tools are ..." and tries
  again (the 1.5B takes sql_db's table names for tools: 4 of 8 held-out tasks, 2026-11-29).
- any other JSON (`{"answer": 42}`, `{"name": "Amanda Campbell", "total": 100}`, `[1, 2]`, `42`) leaves the turn an
  answer, exactly as strict parsing would read it. Beside a call, such an object is reported (an error the model
  reads) and the call is kept.
- text that opens like a call of an offered tool (`{"name": "calculate"` ...) but is not valid JSON, or a fence left
  open, is an error the model reads, not an answer: a call cut off by max_new_tokens is never graded as an answer.
- a turn with `<tool_call>` tags is not looked at here: the strict hermes parser reads it.
- a call wrapped in doubled braces, `{{"name": ..., "arguments": {...}}}`, is read as the call inside: the 1.5B's GGUF
  template shows its example call escaped so, and the model writes what it was shown.

The parser reads text only: the sampled tokens stay in the stream as they are (check-tokens re-renders each turn from
its raw text), so what lenient reading changes is what the env executes, never what the trainer sees.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from enum import StrEnum

from agentopd.chat.parser import ParsedTurn, _parse_call


class ToolParsing(StrEnum):
    STRICT = "strict"  # only the format's own markup (`<tool_call>` tags in hermes) is a call
    LENIENT = "lenient"  # also bare or fenced JSON naming an offered tool (this module)


_FENCE = re.compile(r"```[A-Za-z0-9_-]*[ \t]*\n?(.*?)```", re.S)


def _objects(body: str) -> list[object] | str:
    """The JSON values of `body`, one after another with only whitespace between; the error text where it is not. A
    body wrapped in doubled braces, `{{"name": ...}}`, is read without them: a template that escapes its example call
    badly shows the model `{{"name": <function-name>, ...}}`, and the model copies it (Qwen2.5-Coder-1.5B's GGUF)."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    body = body.strip()
    if body.startswith("{{"):  # the model closes with one, two or three braces: `{{...}}}` as often as `{{...}}`
        try:
            value, end = decoder.raw_decode(body, 1)
        except json.JSONDecodeError:
            pass
        else:
            if re.fullmatch(r"\s*\}{0,2}\s*", body[end:]):
                return [value]
    while pos < len(body):
        try:
            value, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            return f"invalid JSON ({e.msg} at column {e.colno})"
        values.append(value)
        pos = end
        while pos < len(body) and body[pos].isspace():
            pos += 1
    return values


def _names_tool(value: object, tools: Collection[str]) -> bool:
    return isinstance(value, dict) and isinstance(value.get("name"), str) and value["name"].strip() in tools


def _call_shaped(value: object) -> bool:
    """Exactly a call's keys, `{"name": "...", "arguments": {...}}` (or "parameters"), whatever the name: what the
    1.5B writes when it takes a table for the tool (`{"name": "employees", "arguments": {"query": "SELECT ..."}}`)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or len(value) != 2:
        return False
    return isinstance(value.get("arguments", value.get("parameters")), dict)


def _is_call(value: object, tools: Collection[str]) -> bool:
    return _names_tool(value, tools) or _call_shaped(value)


def _opens_call(text: str, tools: Collection[str]) -> bool:
    """Does `text` start like a JSON call of an offered tool (what a cut-off call looks like)?"""
    m = re.match(r'\s*\{\{?\s*"name"\s*:\s*"([^"]*)"', text)
    return m is not None and m.group(1).strip() in tools


def _calls(values: list[object], tools: Collection[str], first: int) -> tuple[list, list[str]]:
    calls, errors = [], []
    for i, value in enumerate(values, first):
        if _call_shaped(value) and not _names_tool(value, tools):
            assert isinstance(value, dict)
            errors.append(f"tool call {i}: no tool is named {value['name']!r}; the tools are {', '.join(sorted(tools))}")
            continue
        if not _names_tool(value, tools):
            errors.append(f"tool call {i}: a JSON value beside the tool call that is not a call of an offered tool")
            continue
        assert isinstance(value, dict)
        if "parameters" in value and "arguments" not in value:
            value = {**value, "arguments": value["parameters"]}
        result = _parse_call(json.dumps(value), i)
        (errors if isinstance(result, str) else calls).append(result)
    return calls, errors


def read_bare_calls(text: str, tools: Collection[str]) -> ParsedTurn | None:
    """The calls of an untagged turn (thinking already split off), or None when the turn is an answer."""
    if not tools or not text.strip():
        return None
    fences = list(_FENCE.finditer(text))
    if not fences:
        opened = text.find("```")
        if opened >= 0 and _opens_call(re.sub(r"^```[A-Za-z0-9_-]*", "", text[opened:]), tools):
            return ParsedTurn(content="", errors=["tool call 1: unclosed ``` fence (the output ended inside the block)"])
        values = _objects(text)
        if isinstance(values, str):
            return ParsedTurn(content="", errors=[f"tool call 1: {values}"]) if _opens_call(text, tools) else None
        if not any(_is_call(v, tools) for v in values):
            return None
        calls, errors = _calls(values, tools, 1)
        return ParsedTurn(content="", tool_calls=calls, errors=errors)
    calls, errors, index, rest, pos = [], [], 1, [], 0
    for m in fences:
        body = _objects(m.group(1))
        if isinstance(body, str) and _opens_call(m.group(1), tools):
            errors.append(f"tool call {index}: {body}")
            index += 1
        elif not isinstance(body, str) and any(_is_call(v, tools) for v in body):
            got, bad = _calls(body, tools, index)
            calls += got
            errors += bad
            index += len(body)
        else:
            continue  # other code (SQL, an example): it stays in the content
        rest.append(text[pos : m.start()])
        pos = m.end()
    if index == 1:
        return None  # fenced code, but no call of an offered tool: an answer
    content = "".join([*rest, text[pos:]]).strip()
    return ParsedTurn(content=content, tool_calls=calls, errors=errors)
