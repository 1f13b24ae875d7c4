"""The shared vocabulary of agentopd: small typed records passed between layers.

Environments speak in `Message`s; the agent loop turns an episode into an `Episode`
(messages, reward, stop reason) and a `TokenStream` (exactly the tokens the engine saw,
with a mask of what the student sampled). Everything above — store, teacher, trainer,
viewer — reads these records. This module imports nothing from agentopd.

Token-stream contract (docs/design.md 3.1):
    token_ids        prompt, then every assistant turn as sampled, then tool segments
    prompt_len       tokens before the first assistant turn
    response_mask    len(token_ids) - prompt_len; 1 = sampled by the student, 0 = anything else
    logprobs         sampler logprob per response token; 0.0 where the mask is 0
    turn_index       per response token: the assistant turn it belongs to or follows
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


class StopReason(StrEnum):
    """Why an episode ended."""

    ANSWER = "answer"  # the assistant replied without a tool call
    MAX_TURNS = "max_turns"  # the env's turn limit (gymnasium `truncated`)
    LENGTH = "length"  # the context or a generation budget ran out
    TIMEOUT = "timeout"  # the per-episode wall-clock budget ran out
    ERROR = "error"  # the engine or env failed; the episode is kept for inspection


@dataclass(frozen=True)
class ToolCall:
    """One call the assistant asked for: a tool name and its JSON arguments."""

    name: str
    arguments: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": dict(self.arguments)}


@dataclass
class Message:
    """One chat message. `tool_calls` only on assistant messages, `name` only on tool ones."""

    role: Role
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    name: str | None = None  # the tool that produced a `tool` message

    def to_dict(self) -> dict[str, Any]:
        """The chat-template / JSON form: `{"role", "content"[, "tool_calls"][, "name"]}`."""
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        if self.name is not None:
            d["name"] = self.name
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Message:
        calls = [ToolCall(c["name"], dict(c.get("arguments") or {})) for c in d.get("tool_calls") or []]
        return cls(role=d["role"], content=d.get("content") or "", tool_calls=calls, name=d.get("name"))


@dataclass
class TokenStream:
    """One episode as tokens, exactly as the engine saw them (docs/design.md 3.1)."""

    token_ids: list[int]
    prompt_len: int
    response_mask: list[int]
    logprobs: list[float]
    turn_index: list[int]

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        n = len(self.token_ids) - self.prompt_len
        assert self.prompt_len >= 0 and n >= 0, (self.prompt_len, len(self.token_ids))
        assert len(self.response_mask) == n, ("response_mask", len(self.response_mask), n)
        assert len(self.logprobs) == n, ("logprobs", len(self.logprobs), n)
        assert len(self.turn_index) == n, ("turn_index", len(self.turn_index), n)
        assert all(m in (0, 1) for m in self.response_mask)

    @property
    def response_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_llm_tokens(self) -> int:
        return sum(self.response_mask)

    @property
    def num_tool_tokens(self) -> int:
        return len(self.response_mask) - self.num_llm_tokens

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def kl_k1(self, teacher_logprobs: Sequence[float | None]) -> list[tuple[int, float]]:
        """(turn, sampler logprob - teacher logprob) for every student token: the k1 estimate of the
        per-token reverse KL. Tokens whose either logprob is None (unscored) are skipped."""
        return kl_k1(self.response_mask, self.logprobs, teacher_logprobs, self.turn_index)


def kl_k1(
    response_mask: Sequence[int], logprobs: Sequence[float | None], teacher_logprobs: Sequence[float | None], turn_index: Sequence[int]
) -> list[tuple[int, float]]:
    """(turn, logprob - teacher logprob) for each mask-1 token with both logprobs known: the one
    computation behind `kl/*` metrics, the store's `kl_mean` and the viewer's per-turn KL."""
    if len(teacher_logprobs) != len(response_mask):
        raise ValueError(f"teacher_logprobs has {len(teacher_logprobs)} entries, the response has {len(response_mask)} tokens")
    return [
        (k, a - b)
        for m, a, b, k in zip(response_mask, logprobs, teacher_logprobs, turn_index)
        if m and a is not None and b is not None
    ]


def mean_by_turn(pairs: Sequence[tuple[int, float]]) -> dict[int, float]:
    """The mean value per turn of (turn, value) pairs."""
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    for k, v in pairs:
        sums[k] = sums.get(k, 0.0) + v
        counts[k] = counts.get(k, 0) + 1
    return {k: sums[k] / counts[k] for k in sorted(sums)}


@dataclass
class Turn:
    """One assistant turn and what the environment answered."""

    assistant: Message
    observation: list[Message]
    reward: float = 0.0
    tool_errors: int = 0
    parse_error: bool = False
    raw_text: str = ""  # the sampled text exactly as decoded (tool calls unparsed)
    tool_calls: dict[str, int] = field(default_factory=dict)  # env step info: calls per tool name
    tool_call_errors: dict[str, int] = field(default_factory=dict)  # env step info: errors per tool name


INTERVENED = "intervened_turns"  # Episode.info key: the 0-based turns a guide replaced (agentopd.recipes.intervene)
INTERVENED_TOKENS = "intervened_tokens"  # Episode.info key: per replaced turn, the guide's tokens opening it (mask 0)


class PlayedBy(StrEnum):
    """Episode.info["played_by"] (PLAYED_BY): who played a training episode when it was not the student
    (recipe.teacher_fraction); the store and the viewer show it."""

    TEACHER = "teacher"


PLAYED_BY = "played_by"
TEMPLATE_KWARGS = "template_kwargs"  # Episode.info key: chat-template options the agent loop rendered with (enable_thinking)


@dataclass
class Episode:
    """One finished episode: the conversation, its outcome and its token stream."""

    env: str
    task_id: str
    messages: list[Message]  # initial messages, then every assistant and tool message
    tools: list[dict[str, Any]]  # the JSON tool schemas shown to the model
    turns: list[Turn]
    reward: float
    success: bool
    stop_reason: StopReason
    tokens: TokenStream | None = None
    teacher_logprobs: list[float] | None = None  # per response token, once scored
    step: int = 0
    sample_index: int = 0  # which of the n samples of this task
    policy_version: int = 0  # the student weights version that generated it
    info: dict[str, Any] = field(default_factory=dict)
    # student turns a guide replaced (agentopd.recipes.intervene), each as the stream it was sampled from: the
    # prefix as prompt, then the rejected turn (mask 1). Trained on, not stored (info["intervened_turns"] is)
    branches: list[TokenStream] = field(default_factory=list)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def tool_errors(self) -> int:
        return sum(t.tool_errors for t in self.turns)
