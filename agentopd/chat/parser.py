"""Hermes tool-call parser for sampled assistant text; it never raises.

    turn = parse_assistant(text)   # ParsedTurn(content, tool_calls, errors, thinking)

Format (what the default template teaches): optional `<think>...</think>`, free text, then one or
more blocks `<tool_call>\\n{"name": "...", "arguments": {...}}\\n</tool_call>`.

- `tool_calls`: every well-formed call, in order. `arguments` may also be a JSON string holding
  an object (OpenAI style); a missing `arguments` means `{}`.
- `errors`: one line per problem, written for the model to read (the agent loop turns them into
  a parse-error observation and counts them): unclosed `<tool_call>` (e.g. the output hit
  max_tokens mid-call), a stray `</tool_call>`, invalid JSON, a call that is not an object,
  a missing or non-string name, arguments that are not an object, empty output (no answer and
  no call, thinking aside), an unclosed `<think>`. A broken call is reported and dropped; the well-formed calls around it are kept.
- `content`: the text outside thinking and tool-call blocks, stripped (text after the last call
  is kept, not an error). This is the answer an environment grades.
- `thinking`: the text inside `<think>` blocks, joined. History in the token stream keeps the
  thinking verbatim regardless: the parser only reads.
A trailing `<|im_end|>` / `<|endoftext|>` (the stop token, when decoded with the text) is ignored.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agentopd.types import ToolCall

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_STOP_SUFFIXES = ("<|im_end|>", "<|endoftext|>")


@dataclass
class ParsedTurn:
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    thinking: str = ""

    @property
    def ok(self) -> bool:
        return not self.errors


def _split_thinking(text: str, errors: list[str]) -> tuple[str, str]:
    """(text without think blocks, joined thinking)."""
    rest, thoughts = [], []
    pos = 0
    while True:
        start = text.find(THINK_OPEN, pos)
        if start < 0:
            rest.append(text[pos:])
            break
        rest.append(text[pos:start])
        end = text.find(THINK_CLOSE, start + len(THINK_OPEN))
        if end < 0:
            thoughts.append(text[start + len(THINK_OPEN) :])
            errors.append("unclosed <think>: the output ended before </think>")
            break
        thoughts.append(text[start + len(THINK_OPEN) : end])
        pos = end + len(THINK_CLOSE)
    # Qwen3 emits only the closing tag when the prompt opened the block.
    joined = "".join(rest)
    if THINK_CLOSE in joined and not thoughts:
        head, _, tail = joined.partition(THINK_CLOSE)
        thoughts.append(head)
        joined = tail
    return joined, "\n".join(t.strip("\n") for t in thoughts)


def _parse_call(body: str, index: int) -> ToolCall | str:
    """A ToolCall, or the error message for call number `index` (1-based)."""
    where = f"tool call {index}"
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"{where}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    if not isinstance(obj, dict):
        return f'{where}: expected a JSON object {{"name": ..., "arguments": {{...}}}}, got {type(obj).__name__}'
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return f'{where}: missing "name" (a non-empty string)'
    args = obj.get("arguments", {})
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return f'{where} ({name}): "arguments" is a string that is not valid JSON ({e.msg})'
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f'{where} ({name}): "arguments" must be a JSON object, got {type(args).__name__}'
    return ToolCall(name=name.strip(), arguments=args)


def parse_assistant(text: str, parse_call: Callable[[str, int], ToolCall | str] | None = None) -> ParsedTurn:
    """Split sampled assistant text into content, tool calls, thinking and errors. Never raises. Each
    `<tool_call>...</tool_call>` body goes to `parse_call(body, index)` (a ToolCall, or an error message): the hermes
    JSON body by default; agentopd.chat.formats passes Qwen3.5's XML body parser."""
    parse_call = parse_call or _parse_call
    errors: list[str] = []
    for suffix in _STOP_SUFFIXES:
        if text.endswith(suffix):
            text = text[: -len(suffix)]
            break
    if not text.strip():
        return ParsedTurn(content="", errors=["empty output"])
    text, thinking = _split_thinking(text, errors)
    content_parts: list[str] = []
    calls: list[ToolCall] = []
    pos, index = 0, 0
    while True:
        start = text.find(CALL_OPEN, pos)
        stray = text.find(CALL_CLOSE, pos)
        if stray >= 0 and (start < 0 or stray < start):
            errors.append(f"stray {CALL_CLOSE} without a matching {CALL_OPEN}")
            content_parts.append(text[pos:stray])
            pos = stray + len(CALL_CLOSE)
            continue
        if start < 0:
            content_parts.append(text[pos:])
            break
        content_parts.append(text[pos:start])
        index += 1
        end = text.find(CALL_CLOSE, start + len(CALL_OPEN))
        if end < 0:
            errors.append(f"tool call {index}: unclosed {CALL_OPEN} (the output ended before {CALL_CLOSE})")
            break
        result = parse_call(text[start + len(CALL_OPEN) : end], index)
        if isinstance(result, str):
            errors.append(result)
        else:
            calls.append(result)
        pos = end + len(CALL_CLOSE)
    content = "".join(content_parts).strip()
    if not content and not calls and not errors:
        errors.append("empty output: no answer and no tool call")
    return ParsedTurn(content=content, tool_calls=calls, errors=errors, thinking=thinking)


def assistant_turn_text(content: str, tool_calls: Sequence[ToolCall | dict] = ()) -> str:
    """The canonical text of an assistant turn in the hermes format (what a demonstration samples);
    `parse_assistant` reads it back."""
    parts = [content] if content else []
    for c in tool_calls:
        c = c.to_dict() if isinstance(c, ToolCall) else c
        parts.append("<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False) + "\n</tool_call>")
    return "\n".join(parts)
