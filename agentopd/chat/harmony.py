"""How gpt-oss's chat template (trl's `gptoss.jinja`, harmony format) renders history, for the stream builder and the
drift checker (agentopd.chat.formats reads and writes the turns themselves).

    harmony_caller("fetch")                       # an assistant call to `fetch`: what its tool messages render after
    text = render_with_turns(tok, msgs, texts, tools)   # the conversation, each assistant turn as sampled
    history_rewrites(msgs, raw, ends)             # [(turn, kind)]: how the template re-renders parsed turns
    day = render_date(prompt_text)                # the date the template wrote into the system message

The template renders an assistant message from `thinking`, `content` and one call, and a tool message only after a
call: it names the sender after the last call (`<|start|>functions.NAME to=assistant...`). A sampled turn cannot be
given to it as text, and a turn that failed to parse has no call for the error message after it. So the stream
builder renders a tool message after a synthetic call to its own `name` (a parse error comes from
`functions.parse_error`), and the drift checker re-renders a conversation with a stand-in per assistant turn (that
call, or an answer) whose rendering it replaces by `<|start|>assistant` + the sampled text: the prompt and the tool
messages are the template's, the turns what was sampled.

How the template re-renders a cleanly parsed turn from its parsed messages, as a pipeline re-rendering history would
(read from trl's gptoss.jinja), each a history rewrite by design:
- reasoning_dropped: an answer's analysis messages unless it is the last message; a call's once a later assistant
  message without a call follows;
- end_rewritten: an answer that ended with `<|return|>` is closed with `<|end|>` once messages follow it;
- message_reformatted: the last message's header or JSON differs from the template's form (` to=functions.NAME
  <|channel|>commentary json<|message|>` + `json.dumps` arguments; `<|channel|>final<|message|>` + the answer).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from agentopd.chat.formats import H_CALL, H_CHANNEL, H_MESSAGE, H_RETURN, H_START, ToolFormat, parse_turn, turn_text
from agentopd.chat.template import render

REASONING_DROPPED, END_REWRITTEN, MESSAGE_REFORMATTED = "reasoning_dropped", "end_rewritten", "message_reformatted"
_DATE = re.compile(r"Current date: (\d{4}-\d{2}-\d{2})\n")
_TURN = H_START + "assistant"


def harmony_caller(name: str, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
    """An assistant message calling `name`: what a tool message from `name` is rendered after."""
    return {"role": "assistant", "content": "", "tool_calls": [{"name": name, "arguments": arguments or {}}]}


def harmony_sender(messages: Sequence[dict[str, Any]]) -> str | None:
    """The name the template gives the tool messages at the start of `messages` (None: they start otherwise)."""
    if not messages or messages[0]["role"] != "tool":
        return None
    return str(messages[0].get("name") or "tool")


def render_with_turns(tokenizer: PreTrainedTokenizerBase, msgs: list[dict[str, Any]], turn_texts: list[str],
                      tools: Sequence[dict[str, Any]] | None, **kw: Any) -> str:  # fmt: skip
    """The template over `msgs` with a stand-in per assistant turn, each stand-in's rendering replaced by
    `<|start|>assistant` + that turn's text (`turn_texts[k]`: what was sampled, with its stop or closing)."""
    standins, markers = [], []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            standins.append(m)
            continue
        k = len(markers)
        sender = harmony_sender(msgs[i + 1 :])
        if sender is not None:
            standins.append(harmony_caller(sender, {"agentopd_turn": k}))
            markers.append(json.dumps({"agentopd_turn": k}) + H_CALL)
        else:
            standins.append({"role": "assistant", "content": f"agentopd-turn-{k}"})
            markers.append(f"agentopd-turn-{k}<|")  # then end|> or return|>
    text = render(tokenizer, standins, tools, **kw)
    out, pos = [], 0
    for k, marker in enumerate(markers):
        at = text.index(marker, pos)
        start = text.rindex(_TURN, pos, at)
        out += [text[pos:start], _TURN, turn_texts[k]]
        pos = at + len(marker) if marker.endswith(H_CALL) else text.index("|>", at + len(marker)) + 2
    return "".join([*out, text[pos:]])


def render_date(text: str) -> tuple[str, int] | None:
    """(the date the template wrote into the system message, its position in `text`), if any."""
    m = _DATE.search(text)
    return (m.group(1), m.start(1)) if m else None


def history_rewrites(msgs: list[dict[str, Any]], raw: Sequence[str], ends: Mapping[int, str]) -> list[tuple[int, str]]:
    """(turn, kind) for each way the template re-renders a cleanly parsed turn (module docstring). `raw[k]`: turn k's
    sampled text without its stop; `ends[k]`: the stop it ended with."""
    out = []
    assistant_at = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    for k, text in enumerate(raw):
        parsed = parse_turn(text, ToolFormat.HARMONY)
        if parsed.errors:
            continue  # the template has no rendering of a malformed turn: the re-render holds the stand-in
        i = assistant_at[k]
        has_analysis = f"{H_CHANNEL}analysis{H_MESSAGE}" in text
        if parsed.tool_calls:
            later_answer = any(m["role"] == "assistant" and not m.get("tool_calls") for m in msgs[i + 1 :])
            dropped, canonical = has_analysis and later_answer, turn_text(ToolFormat.HARMONY, "", parsed.tool_calls[:1])
        else:
            dropped, canonical = has_analysis and i + 1 < len(msgs), turn_text(ToolFormat.HARMONY, parsed.content)
            if ends.get(k) == H_RETURN and i + 1 < len(msgs):
                out.append((k, END_REWRITTEN))
        if dropped:
            out.append((k, REASONING_DROPPED))
        if text.rpartition(_TURN)[2] != canonical:  # the turn's last message
            out.append((k, MESSAGE_REFORMATTED))
    return out
