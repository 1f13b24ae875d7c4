"""One episode, decoded for the JSON API and laid out turn by turn for the episode page.

    data = decode_row(row)                      # JSON columns parsed, non-finite numbers -> None
    data["turn_kl"]                             # mean log-ratio over the student tokens of each turn
    view = build_view(data, decoder)            # EpisodeView for templates/episode.html

Token-view legend (arrays over response tokens, docs/design.md 3.1):
    mask 1  sampled by the student: shaded by r = logprobs - teacher_logprobs (the per-token
            reverse-KL estimate, k1): red when r > 0 (the teacher finds the token less likely
            than the student did), blue when r < 0; darker = larger |r| (levels LEVELS)
    mask 0  tool output and chat-template tokens: grey on a hatched ground, never shaded
Runs of more than FOLD_TOKENS mask-0 tokens and messages longer than FOLD_CHARS characters
or FOLD_LINES lines are folded into <details> elements.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from agentopd.store import decode_json_columns
from agentopd.types import kl_k1, mean_by_turn
from agentopd.viewer.runs import TokenDecoder

LEVELS = (0.05, 0.25, 0.5, 1.0, 2.0)  # |log-ratio| thresholds of shading levels 1..5
FOLD_TOKENS = 48
FOLD_CHARS = 600
FOLD_LINES = 12


def _clean(xs: list[Any] | None) -> list[float | None] | None:
    if xs is None:
        return None
    return [x if isinstance(x, int | float) and math.isfinite(x) else None for x in xs]


def decode_row(row: dict[str, Any]) -> dict[str, Any]:
    """The episode row with its JSON columns parsed and per-turn KL added (`turn_kl`)."""
    out = decode_json_columns(row)
    out["logprobs"] = _clean(out.get("logprobs"))
    out["teacher_logprobs"] = _clean(out.get("teacher_logprobs"))
    if out.get("success") is not None:
        out["success"] = bool(out["success"])
    out["turn_kl"] = turn_kl(out)
    return out


def turn_kl(data: dict[str, Any]) -> list[float | None]:
    """Mean of logprobs - teacher_logprobs over each turn's mask-1 tokens (None: unscored/empty)."""
    mask, lp, tlp, turn = (data.get(k) for k in ("response_mask", "logprobs", "teacher_logprobs", "turn_index"))
    if not mask or not turn:
        return []
    means = mean_by_turn(kl_k1(mask, lp, tlp, turn)) if tlp is not None and lp is not None and len(tlp) == len(mask) else {}
    return [means.get(k) for k in range(max(turn) + 1)]


class Tok(NamedTuple):
    """One token of the token view: text (escaped by the template), CSS class, hover title."""

    text: str
    cls: str
    title: str
    student: bool


@dataclass
class TokenRun:
    tokens: list[Tok]
    student: bool
    folded: bool


@dataclass
class MessageView:
    role: str
    content: str
    name: str | None = None
    is_error: bool = False
    tool_calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments as JSON)

    @property
    def folded(self) -> bool:
        return len(self.content) > FOLD_CHARS or self.content.count("\n") >= FOLD_LINES

    @property
    def lines(self) -> int:
        return self.content.count("\n") + 1

    @property
    def preview(self) -> str:
        first = self.content.strip().split("\n", 1)[0]
        return first[:120] + ("…" if len(first) > 120 else "")


@dataclass
class TurnView:
    index: int
    assistant: MessageView | None
    observation: list[MessageView]
    raw_text: str
    parse_error: bool
    tool_errors: int
    kl: float | None
    student_tokens: int
    other_tokens: int
    runs: list[TokenRun]

    @property
    def has_error(self) -> bool:
        return self.parse_error or self.tool_errors > 0 or any(m.is_error for m in self.observation)


@dataclass
class EpisodeView:
    data: dict[str, Any]
    prompt: list[MessageView]
    prompt_tokens: list[Tok]
    turns: list[TurnView]
    scored: bool
    tokenizer: str | None  # where token text came from; None = ids shown


def _message(m: dict[str, Any]) -> MessageView:
    content = m.get("content") or ""
    if not isinstance(content, str):
        content = json.dumps(content, ensure_ascii=False, indent=2)
    calls = [
        (str(c.get("name", "")), json.dumps(c.get("arguments", {}), ensure_ascii=False, indent=2))
        for c in m.get("tool_calls") or []
    ]
    role = str(m.get("role", "?"))
    is_error = role == "tool" and content.lstrip().lower().startswith("error")
    return MessageView(role, content, m.get("name"), is_error, calls)


def _shade(r: float) -> str:
    level = sum(abs(r) >= t for t in LEVELS)
    return f"s {'p' if r > 0 else 'n'}{level}" if level else "s z"


def _display(piece: str) -> str:
    return piece.replace("\n", "↵\n") if "\n" in piece else piece


def _tokens(ids: list[int], pieces: list[str] | None, mask, lp, tlp) -> list[Tok]:
    out = []
    for i, tid in enumerate(ids):
        text = _display(pieces[i]) if pieces is not None else f"{tid} "
        if mask is None:
            out.append(Tok(text, "o pr", f"#{tid} prompt", False))
        elif mask[i]:
            a = lp[i] if lp else None
            b = tlp[i] if tlp else None
            if a is not None and b is not None:
                r = a - b
                out.append(Tok(text, _shade(r), f"#{tid} student logp {a:.4f} | teacher logp {b:.4f} | log-ratio {r:+.4f}", True))
            else:
                out.append(Tok(text, "s u", f"#{tid} student logp {a:.4f} | not scored" if a is not None else f"#{tid}", True))
        else:
            out.append(Tok(text, "o", f"#{tid} mask 0 (tool/template)", False))
    return out


def _runs(tokens: list[Tok]) -> list[TokenRun]:
    runs: list[TokenRun] = []
    for t in tokens:
        if runs and runs[-1].student == t.student:
            runs[-1].tokens.append(t)
        else:
            runs.append(TokenRun([t], t.student, False))
    for run in runs:
        run.folded = not run.student and len(run.tokens) > FOLD_TOKENS
    return runs


def build_view(data: dict[str, Any], decoder: TokenDecoder | None) -> EpisodeView:
    messages = [_message(m) for m in data.get("messages") or []]
    first = next((i for i, m in enumerate(messages) if m.role == "assistant"), len(messages))
    prompt, rest = messages[:first], messages[first:]
    assistants: list[MessageView] = []
    observations: list[list[MessageView]] = []
    for m in rest:
        if m.role == "assistant":
            assistants.append(m)
            observations.append([])
        else:
            observations[-1].append(m)
    turn_rows = data.get("turns") or []
    ids = data.get("token_ids") or []
    mask, turn_index = data.get("response_mask") or [], data.get("turn_index") or []
    lp, tlp = data.get("logprobs"), data.get("teacher_logprobs")
    n_turns = max(len(turn_rows), len(assistants), (max(turn_index) + 1) if turn_index else 0)
    prompt_len = data.get("prompt_len") or 0
    pieces = decoder.pieces(ids) if decoder is not None and ids else None
    prompt_tokens = _tokens(ids[:prompt_len], pieces[:prompt_len] if pieces else None, None, None, None)
    response = _tokens(ids[prompt_len:], pieces[prompt_len:] if pieces else None, mask, lp, tlp)
    per_turn: list[list[Tok]] = [[] for _ in range(n_turns)]
    for tok, k in zip(response, turn_index):
        per_turn[k].append(tok)
    kls = data.get("turn_kl") or []
    turns = []
    for k in range(n_turns):
        info = turn_rows[k] if k < len(turn_rows) else {}
        assistant = assistants[k] if k < len(assistants) else None
        if assistant is None and info.get("raw_text"):
            assistant = MessageView("assistant", info["raw_text"])
        n_student = sum(t.student for t in per_turn[k])
        turns.append(
            TurnView(
                index=k,
                assistant=assistant,
                observation=observations[k] if k < len(observations) else [],
                raw_text=info.get("raw_text") or "",
                parse_error=bool(info.get("parse_error")),
                tool_errors=int(info.get("tool_errors") or 0),
                kl=kls[k] if k < len(kls) else None,
                student_tokens=n_student,
                other_tokens=len(per_turn[k]) - n_student,
                runs=_runs(per_turn[k]),
            )
        )
    return EpisodeView(data, prompt, prompt_tokens, turns, tlp is not None, decoder.source if decoder else None)
