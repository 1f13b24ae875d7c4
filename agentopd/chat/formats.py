"""Tool-call formats by model family: which one a chat template speaks, a parser for each, and its inverse.

    fmt = detect_format(chat_template_of(tokenizer))   # ToolFormat.HERMES / LLAMA3_JSON / QWEN_XML / HARMONY
    turn = parse_turn(text, fmt)                        # ParsedTurn(content, tool_calls, errors, thinking); never raises
    text = turn_text(fmt, content, tool_calls)          # what a model speaking the format samples (parse_turn reads it back)
    config: rollout.tool_format=auto|hermes|llama3_json|qwen_xml|harmony   (auto: detected from the template)

- `hermes` (Qwen2.5/Qwen3, NousResearch hermes; agentopd's own template): `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>` blocks after the text (agentopd.chat.parser).
- `llama3_json` (Llama 3.1/3.2/3.3 with JSON tool calling): the whole turn is one JSON object `{"name": ...,
  "parameters": {...}}` (Meta's templates render it so, one call per turn; `"arguments"` is read too), optionally
  after `<|python_tag|>`. A turn whose text is not an object with a "name" is an answer. Text that starts with
  `{"name"` or `<|python_tag|>` but does not parse is an error, not an answer; so is text after the call (the call
  is kept). No reasoning block: Llama 3.x has none.
- `qwen_xml` (Qwen3.5/3.6, Qwen3-Coder): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
  </function>\\n</tool_call>`. A VALUE that is valid JSON (a number, true, null, an object or array) is read as
  that JSON value, anything else as the string itself: without the tool's schema, a string argument "42" comes back
  as the number 42 (the template renders both alike).
- `harmony` (gpt-oss; trl's `gptoss` template, detected by its `<|channel|>` header): a turn is one or more messages
  after the generation prompt `<|start|>assistant`, each `[ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ TYPE]
  <|message|>BODY<|end|>`, the next one opened by `<|start|>assistant`. `analysis` is reasoning (`thinking`);
  `final` (and `commentary` without a recipient) is the answer; a message to `functions.NAME` is a call, its body
  a JSON object, ended by `<|call|>` (the template writes the header ` to=functions.NAME<|channel|>commentary json`,
  the model may also write `<|channel|>commentary to=functions.NAME <|constrain|>json`: both are read). One call
  per turn, the last message (`<|call|>` stops generation; the template renders one call per message). Text before
  the first `<|channel|>`, a message without `<|message|>` or its `<|end|>`, another channel, a recipient outside
  `functions.`, a header over 256 characters and text after the call are errors; the trailing stop (`<|call|>`,
  `<|return|>`) is ignored. The stop ids are `<|call|>` and `<|return|>`, not `<|end|>`: a turn goes on after an
  analysis message's `<|end|>`. How the template renders history (tool messages, rewrites): agentopd.chat.harmony.
Thinking (`<think>` blocks, or only `</think>` when the prompt opened the block) is read as in hermes; a trailing
stop token is ignored. Errors are lines for the model to read; the agent loop sends them back as an
`Error:` tool message with `error_hint(fmt)`.
Not built: Mistral `[TOOL_CALLS]`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from enum import StrEnum
from typing import Any

from agentopd.chat.bare_calls import read_bare_calls
from agentopd.chat.parser import _STOP_SUFFIXES, CALL_CLOSE, CALL_OPEN, ParsedTurn, _parse_call, assistant_turn_text, parse_assistant
from agentopd.types import ToolCall


class ToolFormat(StrEnum):
    AUTO = "auto"  # config only: detect from the chat template
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    QWEN_XML = "qwen_xml"
    HARMONY = "harmony"


PYTHON_TAG = "<|python_tag|>"
# gpt-oss's harmony tokens (o200k_harmony has them as special tokens); CALL and RETURN end a sampled turn.
H_START, H_END, H_MESSAGE, H_CHANNEL, H_CONSTRAIN, H_RETURN, H_CALL = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                                                                     "<|constrain|>", "<|return|>", "<|call|>")  # fmt: skip
HARMONY_SPECIAL_TOKENS = (H_START, H_END, H_MESSAGE, H_CHANNEL, H_CONSTRAIN, H_RETURN, H_CALL)
HARMONY_STOPS = (H_CALL, H_RETURN)
LLAMA_STOPS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
# Llama 3.x's template tokens (Meta's tokenizer has them as special tokens)
LLAMA_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                        "<|eom_id|>", PYTHON_TAG)  # fmt: skip


def detect_format(template: str) -> ToolFormat:
    """The tool-call format a chat template renders assistant tool calls in."""
    if H_CHANNEL in template:
        return ToolFormat.HARMONY
    if "<function=" in template:
        return ToolFormat.QWEN_XML
    if "<|start_header_id|>" in template and '"parameters": ' in template:
        return ToolFormat.LLAMA3_JSON
    return ToolFormat.HERMES


def resolve_format(name: str | ToolFormat, template: str) -> ToolFormat:
    """The config's `rollout.tool_format` made concrete (`auto` = detected from the template); ValueError if unknown."""
    try:
        fmt = ToolFormat(name)
    except ValueError:
        raise ValueError(f"unknown rollout.tool_format {name!r}: choose one of {[f.value for f in ToolFormat]}") from None
    return detect_format(template) if fmt is ToolFormat.AUTO else fmt


def error_hint(fmt: ToolFormat) -> str:
    """How a call is written in `fmt`, for the parse-error message the model reads."""
    if fmt is ToolFormat.LLAMA3_JSON:
        return 'Use {"name": ..., "parameters": {...}} as the whole reply.'
    if fmt is ToolFormat.QWEN_XML:
        return "Use <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>."
    if fmt is ToolFormat.HARMONY:
        return "Call a tool with <|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>; answer with <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>."
    return 'Use <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'


def parse_turn(text: str, fmt: ToolFormat = ToolFormat.HERMES, *, bare_tools: Collection[str] = ()) -> ParsedTurn:
    """Sampled assistant text in `fmt` -> ParsedTurn; never raises. `bare_tools` (hermes only): the names of the offered
    tools whose calls written as bare or fenced JSON count as calls (`rollout.tool_parsing=lenient`,
    agentopd.chat.bare_calls); empty: only `<tool_call>` blocks do."""
    if fmt is ToolFormat.LLAMA3_JSON:
        return _parse_llama(text)
    if fmt is ToolFormat.QWEN_XML:
        return _parse_xml(text)
    if fmt is ToolFormat.HARMONY:
        return _parse_harmony(text)
    turn = parse_assistant(text)
    if not bare_tools or turn.tool_calls or CALL_OPEN in text or CALL_CLOSE in text:
        return turn
    bare = read_bare_calls(turn.content, bare_tools)
    if bare is None:
        return turn
    return ParsedTurn(content=bare.content, tool_calls=bare.tool_calls, errors=turn.errors + bare.errors, thinking=turn.thinking)


def turn_text(fmt: ToolFormat, content: str, tool_calls: Sequence[ToolCall | dict] = ()) -> str:
    """The canonical text of an assistant turn in `fmt`, as the family's template renders it (`parse_turn` reads it back)."""
    calls = [c.to_dict() if isinstance(c, ToolCall) else c for c in tool_calls]
    if fmt is ToolFormat.LLAMA3_JSON:
        if len(calls) > 1:
            raise ValueError(f"llama3_json has one tool call per turn, got {len(calls)}")
        return json.dumps({"name": calls[0]["name"], "parameters": calls[0]["arguments"]}, ensure_ascii=False) if calls else content
    if fmt is ToolFormat.QWEN_XML:
        blocks = []
        for c in calls:
            params = "".join(f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n" for k, v in c["arguments"].items())
            blocks.append(f"{CALL_OPEN}\n<function={c['name']}>\n{params}</function>\n{CALL_CLOSE}")
        return "\n\n".join(p for p in (content.strip(), "\n".join(blocks)) if p)
    if fmt is ToolFormat.HARMONY:
        return _harmony_text(content, calls)
    return assistant_turn_text(content, calls)


_PY_LITERALS = {"True": True, "False": False, "None": None}


def _xml_value(v: Any) -> str:
    """As Qwen3.5's template writes a parameter: objects and arrays as JSON, anything else as Python's str()."""
    return json.dumps(v, ensure_ascii=False) if isinstance(v, dict | list | tuple) else str(v)


def _strip_stop(text: str, stops: Sequence[str]) -> str:
    for suffix in stops:
        if text.endswith(suffix):
            return text[: -len(suffix)]
    return text


# ---- llama3_json ------------------------------------------------------------------------------------------------


def _parse_llama(text: str) -> ParsedTurn:
    text = _strip_stop(text, (*LLAMA_STOPS, *_STOP_SUFFIXES))
    body = text.strip()
    if not body:
        return ParsedTurn(content="", errors=["empty output: no answer and no tool call"])
    tagged = body.startswith(PYTHON_TAG)
    if tagged:
        body = body[len(PYTHON_TAG) :].strip()
    looks_like_call = tagged or re.match(r'\{\s*"name"\s*:', body) is not None
    try:
        obj, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as e:
        if not looks_like_call:
            return ParsedTurn(content=body)  # an answer
        return ParsedTurn(content="", errors=[f"tool call 1: invalid JSON ({e.msg} at column {e.colno})"])
    if not looks_like_call and not (isinstance(obj, dict) and "name" in obj):
        return ParsedTurn(content=body)  # an answer that happens to start with JSON
    if isinstance(obj, dict) and "parameters" in obj and "arguments" not in obj:
        obj = {**obj, "arguments": obj["parameters"]}
    result = _parse_call(json.dumps(obj), 1)
    if isinstance(result, str):
        return ParsedTurn(content="", errors=[result.replace('"arguments"', '"parameters"')])
    errors = []
    if body[end:].strip():  # Meta's templates render one call per turn
        errors.append(f"text after the tool call: {body[end:].strip()[:40]!r} (one call per turn, nothing after it)")
    return ParsedTurn(content="", tool_calls=[result], errors=errors)


# ---- qwen_xml -----------------------------------------------------------------------------------------------------

_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*?)</function>\s*", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.S)


def _xml_call(body: str, index: int) -> ToolCall | str:
    where = f"tool call {index}"
    m = _FUNCTION.fullmatch(body)
    if m is None:
        return f"{where}: expected <function=NAME> ... </function> inside {CALL_OPEN}"
    name, inner = m.group(1).strip(), m.group(2)
    if not name:
        return f"{where}: missing the function name in <function=NAME>"
    args: dict[str, Any] = {}
    pos = 0
    for p in _PARAM.finditer(inner):
        if inner[pos : p.start()].strip():
            return f"{where} ({name}): unexpected text {inner[pos : p.start()].strip()[:40]!r} between parameters"
        key, raw = p.group(1).strip(), p.group(2)
        if not key:
            return f"{where} ({name}): a <parameter=KEY> without a key"
        value = raw[1:] if raw.startswith("\n") else raw
        value = value[:-1] if value.endswith("\n") else value
        try:
            args[key] = _PY_LITERALS[value] if value in _PY_LITERALS else json.loads(value)
        except json.JSONDecodeError:
            args[key] = value
        pos = p.end()
    if inner[pos:].strip():
        return f"{where} ({name}): unclosed or stray text in the parameters: {inner[pos:].strip()[:40]!r}"
    return ToolCall(name=name, arguments=args)


def _parse_xml(text: str) -> ParsedTurn:
    """Qwen3.5's turns: `<tool_call>` blocks as in hermes, each body `<function=NAME>` with `<parameter=KEY>`s."""
    return parse_assistant(text, _xml_call)


# ---- harmony (gpt-oss) --------------------------------------------------------------------------------------------

_CHANNELS = ("analysis", "commentary", "final")
# a message header after `<|start|>assistant`: ` to=R` before or after the channel, then an optional content type
_HEADER = re.compile(r"\s*(?:to=(?P<pre>[^\s<]+)\s*)?<\|channel\|>(?P<channel>[^\s<]*)(?:\s+to=(?P<post>[^\s<]+))?"
                     r"(?:(?:\s+|\s*<\|constrain\|>)(?P<ctype>[^\s<]+))?\s*")  # fmt: skip
_MAX_HEADER = 256  # characters; longer headers are errors (and the regex stays linear on sampled garbage)


def _harmony_text(content: str, calls: list[dict]) -> str:
    """As trl's gptoss template renders the turn after its generation prompt `<|start|>assistant` (stop excluded): a
    call's text (content before a call is its analysis message), or the answer in the final channel."""
    if len(calls) > 1:
        raise ValueError(f"harmony has one tool call per turn, got {len(calls)}")
    if not calls:
        return f"{H_CHANNEL}final{H_MESSAGE}{content}"
    analysis = f"{H_CHANNEL}analysis{H_MESSAGE}{content}{H_END}{H_START}assistant" if content else ""
    args = json.dumps(calls[0]["arguments"], ensure_ascii=False)
    return f"{analysis} to=functions.{calls[0]['name']}{H_CHANNEL}commentary json{H_MESSAGE}{args}"


def harmony_stop(text: str) -> str:
    """The stop token a harmony turn with this text ends with: `<|call|>` when its last message has a recipient."""
    head = text.rpartition(H_START)[2].partition(H_MESSAGE)[0]
    m = _HEADER.fullmatch(head.removeprefix("assistant")) if len(head) <= _MAX_HEADER else None
    return H_CALL if m is not None and (m["pre"] or m["post"]) else H_RETURN


def _harmony_call(name: str, body: str, where: str) -> ToolCall | str:
    try:
        args = json.loads(body)
    except json.JSONDecodeError as e:
        return f"{where} ({name}): invalid JSON arguments ({e.msg} at column {e.colno})"
    if not isinstance(args, dict):
        return f"{where} ({name}): the arguments must be a JSON object, got {type(args).__name__}"
    return ToolCall(name=name, arguments=args)


def _parse_harmony(text: str) -> ParsedTurn:
    """gpt-oss's turns (module docstring): the messages after the generation prompt's `<|start|>assistant`."""
    text = _strip_stop(text, (*HARMONY_STOPS, H_END, *_STOP_SUFFIXES))
    if not text.strip():
        return ParsedTurn(content="", errors=["empty output: no answer and no tool call"])
    errors: list[str] = []
    thoughts: list[str] = []
    content: list[str] = []
    calls: list[ToolCall] = []
    pieces = text.split(H_START)
    for i, piece in enumerate(pieces, 1):
        where = f"message {i}"
        if i > 1 and not piece.startswith("assistant"):
            errors.append(f"{where}: expected {H_START}assistant, got {(H_START + piece)[:40]!r}")
            continue
        head, has_body, body = piece.removeprefix("assistant" if i > 1 else "").partition(H_MESSAGE)
        if not has_body:
            errors.append(f"{where}: no {H_MESSAGE} after the header {head[:40]!r} (expected {H_CHANNEL}CHANNEL{H_MESSAGE}...)")
            continue
        body, closed, after = body.partition(H_END)
        if after.strip():
            errors.append(f"{where}: text after {H_END}: {after.strip()[:40]!r} (the next message starts with {H_START}assistant)")
        elif not closed and i < len(pieces):
            errors.append(f"{where}: not closed by {H_END} before the next {H_START}")
        m = _HEADER.fullmatch(head) if len(head) <= _MAX_HEADER else None
        if m is None or m["channel"] not in _CHANNELS:
            errors.append(f"{where}: malformed header {head[:40]!r} (expected {H_CHANNEL}analysis, commentary or final)")
            continue
        if calls:
            errors.append(f"{where}: a message after the tool call (one call per turn, ended by {H_CALL})")
            continue
        recipient = m["pre"] or m["post"]
        if recipient is None:
            (thoughts if m["channel"] == "analysis" else content).append(body)
            continue
        name = recipient.removeprefix("functions.") if recipient.startswith("functions.") else ""
        result = _harmony_call(name, body, f"tool call 1 in {where}") if name else f"{where}: unknown recipient {recipient!r} (call functions.NAME)"
        if isinstance(result, str):
            errors.append(result)
        else:
            calls.append(result)
    answer = "\n".join(c.strip() for c in content if c.strip())
    if not answer and not calls and not errors:
        errors.append("empty output: no final answer and no tool call")
    return ParsedTurn(content=answer, tool_calls=calls, errors=errors, thinking="\n".join(t.strip("\n") for t in thoughts))
