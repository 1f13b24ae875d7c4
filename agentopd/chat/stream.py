"""Token-stream assembly for one episode, exact by construction (docs/design.md 3.1).

    b = StreamBuilder(tokenizer, messages, tools, max_context=4096, max_tool_tokens=512)
    ids = b.token_ids                                   # the prompt: chat template + generation prompt
    text = b.add_assistant(result.token_ids, result.logprobs, finished_by_stop=True)   # verbatim, mask 1
    parsed = parse_assistant(text)
    obs, ... = env.step(action)
    try:
        seg = b.add_observation(obs)                    # delta-tokenized, mask 0; seg.messages are capped
    except ContextFull:
        ...                                             # stop_reason = length
    if b.remaining_context() <= 0: ...                  # no room for another turn: stop_reason = length
    stream = b.build()                                  # agentopd.types.TokenStream

How each part is made:
- Prompt: the chat template over the initial messages and tool schemas, with the generation
  prompt (`<|im_start|>assistant\\n`), tokenized once.
- Assistant turn: the engine's ids appended verbatim with the sampler's logprobs, mask 1.
  Never decoded and re-encoded. The returned text (for the parser) is their decoding without
  the stop token.
- Observation (tool results, env messages): rendered as a delta. A fixed synthetic
  conversation (system, user, assistant) is rendered alone and followed by the new messages
  plus the generation prompt; the tokens after the synthetic part are the delta. If the
  synthetic part's tokens are not a prefix of the longer render but only the synthetic assistant
  turn changed (Qwen3's template re-renders it without its reasoning when a user message follows),
  the delta is what follows that turn's closing, provided it tokenizes on its own there;
  otherwise `TemplateMismatch` is raised: the template is not append-only and deltas would be wrong.
- Junction: what the template puts after assistant content (`<|im_end|>\\n` for Qwen) is split
  in two: the stop token the engine sampled (already in the stream, mask 1) and the rest
  (`\\n`), which the engine never emits and is inserted before the delta with mask 0. A turn that
  ended without the stop token (max_tokens hit) gets the whole closing (`<|im_end|>\\n`) inserted,
  mask 0, so the next turn's context is a well-formed conversation.
- Tool output is capped in tokens: a `tool` message longer than `max_tool_tokens` tokens keeps
  its first tokens (cut at a character boundary) plus a visible marker (`TRUNCATION_MARKER`),
  and the capped text is what the returned messages hold, so the stored conversation shows it.
  The count is of the content tokenized on its own (±1 at its edges inside the template).
- Context: `max_context` bounds the whole stream. `add_observation` raises `ContextFull` (stream
  unchanged) when the segment plus `min_turn_tokens` generated tokens would not fit;
  `remaining_context()` is the generation budget of the next turn.
- turn_index: assistant turn k's tokens and the segment that follows it carry k.
- Harmony (gpt-oss, agentopd.chat.formats): a turn ends with `<|call|>` or `<|return|>` (both sampled, mask 1) and
  nothing is inserted after it; a turn cut by max_tokens gets `<|end|>` inserted (mask 0). The template names a tool
  message's sender after the assistant's last call (`<|start|>functions.NAME to=assistant...`), so a tool message's
  delta is rendered after a synthetic assistant call to its own `name` (agentopd.chat.harmony): a parse error comes
  from `functions.parse_error`, the results of a call from `functions.NAME` as in a full render.
Tool output that itself contains chat markup (`<|im_end|>`, `<tool_call>`) is tokenized as
that markup, exactly as a full render would; nothing is escaped.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from agentopd.chat.formats import H_END, HARMONY_STOPS, ToolFormat, detect_format
from agentopd.chat.harmony import harmony_caller, harmony_sender
from agentopd.chat.template import MessageLike, chat_template_of, encode, prompt_ids, render, to_template_messages
from agentopd.types import TokenStream

TRUNCATION_MARKER = "\n[truncated: {kept}/{total} tokens]"
# The synthetic conversation that observation deltas are rendered after. Its assistant turn
# carries a thinking block so templates that treat the last assistant turn specially (Qwen3)
# render it the same way whether or not messages follow it.
_SENTINEL = "Done."
_SYNTHETIC: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello."},
    {"role": "assistant", "content": "<think>\nOk.\n</think>\n\n" + _SENTINEL},
)


class TemplateMismatch(RuntimeError):
    """The chat template is not append-only: a delta cannot be cut off a longer render."""


class ContextFull(Exception):
    """An observation segment does not fit in `max_context` (the episode stops, stop_reason=length)."""

    def __init__(self, needed: int, available: int):
        super().__init__(f"observation needs {needed} tokens, {available} left in the context")
        self.needed = needed
        self.available = available


@dataclass(frozen=True)
class TemplateJunctions:
    """Facts about a tokenizer's chat template that delta tokenization needs."""

    base_ids: tuple[int, ...]  # the synthetic conversation, rendered and tokenized
    closing_ids: tuple[int, ...]  # what follows assistant content (e.g. <|im_end|> \n); inserted after a cut turn
    closing_text: str
    stop_ids: tuple[int, ...]  # a turn ending with one of these is closed (<|im_end|>; harmony: <|call|>, <|return|>)
    after_stop: tuple[int, ...]  # inserted after a closed turn (the rest of the closing: \n; harmony: nothing)
    harmony: bool = False


_JUNCTIONS: weakref.WeakKeyDictionary[Any, dict[str, TemplateJunctions]] = weakref.WeakKeyDictionary()


def template_junctions(tokenizer: PreTrainedTokenizerBase, **template_kwargs: Any) -> TemplateJunctions:
    """Render the synthetic conversation once per tokenizer/template (cached)."""
    key = repr((chat_template_of(tokenizer), sorted(template_kwargs.items())))
    per_tok = _JUNCTIONS.setdefault(tokenizer, {})
    if key not in per_tok:
        text = render(tokenizer, _SYNTHETIC, **template_kwargs)
        at = text.rfind(_SENTINEL)
        if at < 0:
            raise TemplateMismatch(f"the chat template dropped the assistant content {_SENTINEL!r}: {text!r}")
        closing_text = text[at + len(_SENTINEL) :]
        base_ids = encode(tokenizer, text)
        if detect_format(chat_template_of(tokenizer)) is ToolFormat.HARMONY:
            # the synthetic answer closes with <|return|> here, with <|end|> before any later message
            stops = tuple(tokenizer.convert_tokens_to_ids(t) for t in HARMONY_STOPS)
            per_tok[key] = TemplateJunctions(tuple(base_ids), tuple(encode(tokenizer, H_END)), H_END, stops, (), harmony=True)
            return per_tok[key]
        closing_ids = encode(tokenizer, closing_text)
        if closing_ids and base_ids[-len(closing_ids) :] != closing_ids:
            raise TemplateMismatch(f"the assistant closing {closing_text!r} does not tokenize on its own")
        per_tok[key] = TemplateJunctions(tuple(base_ids), tuple(closing_ids), closing_text, tuple(closing_ids[:1]), tuple(closing_ids[1:]))
    return per_tok[key]


def _cut_at_token(tokenizer: PreTrainedTokenizerBase, text: str, k: int) -> str:
    """The first `k` tokens of `text`, as text ending at a character boundary."""
    if k <= 0:
        return ""
    if getattr(tokenizer, "is_fast", False):
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        return text[: offsets[k - 1][1]]
    return tokenizer.decode(encode(tokenizer, text)[:k]).rstrip("\ufffd")


def cap_tool_text(tokenizer: PreTrainedTokenizerBase, text: str, max_tokens: int) -> tuple[str, bool]:
    """(text capped to about `max_tokens` tokens incl. the marker, whether it was cut)."""
    total = len(encode(tokenizer, text))
    if total <= max_tokens:
        return text, False
    kept = max(max_tokens - len(encode(tokenizer, TRUNCATION_MARKER.format(kept=max_tokens, total=total))), 0)
    while True:
        capped = _cut_at_token(tokenizer, text, kept) + TRUNCATION_MARKER.format(kept=kept, total=total)
        if kept == 0 or len(encode(tokenizer, capped)) <= max_tokens:
            return capped, True
        kept -= 1


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@dataclass
class ObservationSegment:
    """What `add_observation` appended."""

    token_ids: list[int]  # junction + delta, all mask 0
    num_junction_tokens: int  # leading tokens that close the previous assistant turn
    messages: list[dict[str, Any]]  # the new messages as rendered (tool output capped)
    truncated: list[bool] = field(default_factory=list)  # per message: tool output was capped


class StreamBuilder:
    """Builds one episode's TokenStream turn by turn (see the module docstring)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        messages: Sequence[MessageLike],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        max_context: int,
        max_tool_tokens: int | None = None,
        min_turn_tokens: int = 1,
        template_kwargs: dict[str, Any] | None = None,
    ):
        if max_tool_tokens is not None and max_tool_tokens < 1:
            raise ValueError(f"max_tool_tokens must be >= 1 or None, got {max_tool_tokens}")
        if min_turn_tokens < 1:
            raise ValueError(f"min_turn_tokens must be >= 1, got {min_turn_tokens}")
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.max_context = max_context
        self.max_tool_tokens = max_tool_tokens
        self.min_turn_tokens = min_turn_tokens
        self.template_kwargs = dict(template_kwargs or {})
        self.junctions = template_junctions(tokenizer, **self.template_kwargs)
        self._ids: list[int] = prompt_ids(tokenizer, messages, self.tools, **self.template_kwargs)
        self.prompt_len = len(self._ids)
        self._mask: list[int] = []
        self._logprobs: list[float] = []
        self._turn: list[int] = []
        self.raw_assistant_texts: list[str] = []  # decoded sampled text per turn, stop token excluded
        self.turn_closed: list[bool] = []  # per turn: ended with the template's stop token
        self.finished_by_stop: list[bool] = []  # per turn: the engine's finish reason was a stop id
        self._pending_junction: tuple[int, ...] | None = None  # set after an assistant turn

    # ---- reading -------------------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        """The whole stream so far (what the engine is given for the next turn)."""
        return list(self._ids)

    def prompt_ids(self) -> list[int]:
        return self._ids[: self.prompt_len]

    @property
    def num_turns(self) -> int:
        return len(self.raw_assistant_texts)

    def remaining_context(self) -> int:
        """Tokens the next assistant turn may generate (<= 0: it cannot run)."""
        return self.max_context - len(self._ids)

    def can_generate(self) -> bool:
        return self._pending_junction is None and self.remaining_context() >= self.min_turn_tokens

    # ---- appending -----------------------------------------------------------------------
    def add_assistant(self, token_ids: Sequence[int], logprobs: Sequence[float], finished_by_stop: bool, *, student: bool = True) -> str:
        """Append one generated turn verbatim (mask 1); return its text without the stop token.

        `finished_by_stop` (the engine's finish reason) is recorded; what decides the junction is
        whether the last id is the template's stop token (e.g. `<|im_end|>`; harmony's `<|call|>`, `<|return|>`): if not
        (max_tokens hit, or another stop id such as `<|endoftext|>`), the template's whole closing is
        inserted (mask 0) before the next observation. `student=False`: another policy generated
        the turn (a teacher's intervention, agentopd.recipes.intervene): it is the conversation's
        assistant turn like any other, but not the student's token: mask 0, logprob 0.0.
        """
        if self._pending_junction is not None:
            raise ValueError("add_assistant after an assistant turn: add the observation first")
        if len(token_ids) != len(logprobs):
            raise ValueError(f"token_ids ({len(token_ids)}) and logprobs ({len(logprobs)}) differ in length")
        if len(token_ids) > self.remaining_context():
            raise ValueError(f"{len(token_ids)} generated tokens exceed the remaining context {self.remaining_context()}")
        ids = [int(t) for t in token_ids]
        closing = self.junctions.closing_ids
        closed = bool(ids) and ids[-1] in self.junctions.stop_ids
        turn = self.num_turns
        self._ids.extend(ids)
        self._mask.extend([int(student)] * len(ids))
        self._logprobs.extend(float(x) if student else 0.0 for x in logprobs)
        self._turn.extend([turn] * len(ids))
        body = ids[:-1] if closed else ids
        self.raw_assistant_texts.append(self.tokenizer.decode(body, skip_special_tokens=False))
        self.turn_closed.append(closed)
        self.finished_by_stop.append(bool(finished_by_stop))
        self._pending_junction = self.junctions.after_stop if closed else closing
        return self.raw_assistant_texts[-1]

    def _delta(self, messages: list[dict[str, Any]]) -> list[int]:
        base = self.junctions.base_ids
        sender = harmony_sender(messages) if self.junctions.harmony else None
        if sender is not None:  # after a call to the sender (module docstring)
            synthetic = [*_SYNTHETIC[:-1], harmony_caller(sender)]
            base = tuple(encode(self.tokenizer, render(self.tokenizer, synthetic, None, **self.template_kwargs)))
            full = encode(self.tokenizer, render(self.tokenizer, [*synthetic, *messages], None, add_generation_prompt=True, **self.template_kwargs))
            if tuple(full[: len(base)]) != base:
                raise TemplateMismatch(f"rendering tool messages changed the call before them at token {_first_difference(base, full)}")
            return full[len(base) :]
        text = render(self.tokenizer, [*_SYNTHETIC, *messages], None, add_generation_prompt=True, **self.template_kwargs)
        full = encode(self.tokenizer, text)
        if tuple(full[: len(base)]) == base:
            return full[len(base) :]
        # The template re-rendered the synthetic assistant turn (Qwen3 drops the reasoning of turns before a new user
        # message): the delta is what follows that turn's closing, if all before the turn is unchanged and the rest
        # tokenizes on its own.
        end = text.find(_SENTINEL + self.junctions.closing_text)
        before = render(self.tokenizer, _SYNTHETIC[:-1], None, **self.template_kwargs)
        if end >= 0 and text.startswith(before):
            cut = end + len(_SENTINEL) + len(self.junctions.closing_text)
            rest = encode(self.tokenizer, text[cut:])
            if encode(self.tokenizer, text[:cut]) + rest == full:
                return rest
        i = _first_difference(base, full)
        raise TemplateMismatch(
            f"rendering new messages changed the tokens before them at token {i}: "
            f"expected {self.tokenizer.decode(base[max(0, i - 8) : i + 8])!r}, "
            f"got {self.tokenizer.decode(full[max(0, i - 8) : i + 8])!r}"
        )

    def cap_messages(self, messages: Sequence[MessageLike]) -> tuple[list[dict[str, Any]], list[bool]]:
        """Copies of `messages` with tool output capped to `max_tool_tokens` (and which were cut)."""
        out, cut = [], []
        for m in to_template_messages(messages):
            m = dict(m)
            was_cut = False
            if self.max_tool_tokens is not None and m["role"] == "tool" and isinstance(m.get("content"), str):
                m["content"], was_cut = cap_tool_text(self.tokenizer, m["content"], self.max_tool_tokens)
            out.append(m)
            cut.append(was_cut)
        return out, cut

    def add_observation(self, new_messages: Sequence[MessageLike]) -> ObservationSegment:
        """Append the closing junction and the delta of `new_messages` + generation prompt (mask 0).

        Raises ContextFull (stream unchanged) when it and `min_turn_tokens` do not fit.
        """
        if self._pending_junction is None:
            raise ValueError("add_observation must follow an assistant turn")
        if not new_messages:
            raise ValueError("add_observation needs at least one message")
        messages, cut = self.cap_messages(new_messages)
        seg = [*self._pending_junction, *self._delta(messages)]
        if len(seg) + self.min_turn_tokens > self.remaining_context():
            raise ContextFull(len(seg) + self.min_turn_tokens, self.remaining_context())
        self._ids.extend(seg)
        self._mask.extend([0] * len(seg))
        self._logprobs.extend([0.0] * len(seg))
        self._turn.extend([self.num_turns - 1] * len(seg))
        n_junction = len(self._pending_junction)
        self._pending_junction = None
        return ObservationSegment(token_ids=seg, num_junction_tokens=n_junction, messages=messages, truncated=cut)

    def build(self) -> TokenStream:
        return TokenStream(
            token_ids=list(self._ids),
            prompt_len=self.prompt_len,
            response_mask=list(self._mask),
            logprobs=list(self._logprobs),
            turn_index=list(self._turn),
        )
