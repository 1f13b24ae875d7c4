"""check-pair's chat_template check: do the student's and the teacher's templates show a conversation the same way?

    detail = compare_templates(student_tok, teacher_tok, messages, tools, source)   # TemplateDiffers names the difference

Two renders per tokenizer: the whole conversation (history as every later turn sees it) and the generation prompt
before the first assistant turn (what the model is asked to continue). Both must be the same text and the same ids.
When they differ only inside reasoning blocks (`<think>...</think>`, or a block the generation prompt opens) — a
thinking and a non-thinking variant of one family, Qwen3's own template against one that keeps reasoning verbatim —
the failure says so, shows both sides, and names the way to make them agree where there is one (both rendered with
`enable_thinking=False`: `rollout.enable_thinking=false`). Such a pair is not accepted silently: the teacher would
score the student's turns in a reasoning layout its own template never produces.
"""

from __future__ import annotations

import re
from typing import Any

from transformers import PreTrainedTokenizerBase

from agentopd.chat import chat_template_of, encode, render

_REASONING = re.compile(r"<think>.*?</think>\s*|<think>\s*$", re.S)


class TemplateDiffers(Exception):
    """The two templates render the conversation differently (the message names where and how)."""


def _first_diff(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _renders(tok: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[dict[str, Any]], **kw: Any) -> dict[str, str]:
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return {"the conversation": render(tok, messages, tools or None, **kw),
            "the generation prompt": render(tok, messages[:first], tools or None, add_generation_prompt=True, **kw)}  # fmt: skip


def _without_reasoning(text: str) -> str:
    return _REASONING.sub("", text)


def _thinking_off_agrees(student_tok, teacher_tok, messages, tools) -> bool:
    if not all("enable_thinking" in chat_template_of(t) for t in (student_tok, teacher_tok)):
        return False
    return _renders(student_tok, messages, tools, enable_thinking=False) == _renders(teacher_tok, messages, tools, enable_thinking=False)


def compare_templates(student_tok: PreTrainedTokenizerBase, teacher_tok: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]], source: str, template_kwargs: dict[str, Any] | None = None) -> str:  # fmt: skip
    """The check's detail when both templates agree, rendered with `template_kwargs` (the run's, e.g.
    enable_thinking=False); else TemplateDiffers (module docstring)."""
    kw = dict(template_kwargs or {})
    s_renders, t_renders = _renders(student_tok, messages, tools, **kw), _renders(teacher_tok, messages, tools, **kw)
    for what in s_renders:
        s_text, t_text = s_renders[what], t_renders[what]
        if s_text == t_text:
            continue
        i = _first_diff(s_text, t_text)
        where = f"{source}: {what} renders differently at character {i}: student {s_text[max(0, i - 30) : i + 30]!r} vs teacher {t_text[max(0, i - 30) : i + 30]!r}"
        if _without_reasoning(s_text) != _without_reasoning(t_text):
            raise TemplateDiffers(where)
        remedy = ("; both agree with thinking off: run with rollout.enable_thinking=false" if not kw and _thinking_off_agrees(student_tok, teacher_tok, messages, tools)
                  else "; give both models the same chat template")  # fmt: skip
        raise TemplateDiffers(f"the templates differ only in the reasoning block ({where}): the teacher would score the student's "
                              f"turns with reasoning laid out as its own template never shows it{remedy}")  # fmt: skip
    text = s_renders["the conversation"]
    s_ids, t_ids = encode(student_tok, text), encode(teacher_tok, text)
    if s_ids != t_ids:
        i = next((i for i, (a, b) in enumerate(zip(s_ids, t_ids)) if a != b), min(len(s_ids), len(t_ids)))
        raise TemplateDiffers(f"{source} tokenizes differently at token {i}: student {student_tok.convert_ids_to_tokens(s_ids[i : i + 4])} "
                              f"vs teacher {teacher_tok.convert_ids_to_tokens(t_ids[i : i + 4])}")  # fmt: skip
    calls = sum(len(m.get("tool_calls") or []) for m in messages)
    rendered = f" (rendered with {kw})" if kw else ""
    return f"{source}: {len(text):,} characters, {len(s_ids):,} tokens, {calls} tool call(s), and the generation prompt, identical{rendered}"
