"""The Engine protocol: async, token-in/token-out generation (what the agent loop needs).

A request carries token ids, sampling parameters and the episode id (so an engine may keep
that episode's KV cache between turns); the result carries the sampled token ids, the
sampler's log-probability of each, and why generation stopped. Engines never see text.

Logprob convention, one rule for every engine (the trainer's importance ratios depend on it):
the reported logprob of a sampled token is `log_softmax(logits / T)[token]` over the full
vocabulary (the tokenizer's ids, see below), T the request's temperature (T = 1 when temperature
== 0, i.e. greedy), computed before any top-k/top-p truncation; the truncation only narrows the set sampled from and is
never renormalised into the logprob. The trainer computes the same quantity
(`log_softmax(logits / T)` of the student, T from `logprob_temperature`), so the ratio is 1 at
the sampler's own weights and corrects only for weight staleness. With top_p=1 and top_k=0 this
is exactly the distribution sampled from; with truncation on, the episodes come from the
truncated policy and the loss does not correct for that. vLLM reports renormalised logprobs by
itself; engines/vllm.py makes it follow this rule (tests/test_vllm_real.py checks it against a
teacher-forced forward under top-k and top-p).

A stop token that ends generation is part of `token_ids` (it was sampled, mask 1).

The vocabulary is the tokenizer's: an engine built with `vocab_size` (every engine takes it; the run passes
`len(tokenizer)`) samples from, and normalises its logprobs over, the first `vocab_size` logits only. Real
checkpoints have more embedding rows than token ids (Qwen3: 151,936 rows, 151,669 ids); the rows past the
tokenizer are padding that no tokenizer decodes, so an engine never samples them, and the teacher and the
trainer (agentopd.teacher.HFTeacher, agentopd.trainer.Trainer, same `vocab_size`) normalise over the same ids,
which keeps the sampler/trainer ratio exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from agentopd.kinds import sampled_vocab  # noqa: F401  (re-exported: the engines' import of it)


class FinishReason(StrEnum):
    STOP = "stop"  # a stop token was sampled (it is included in token_ids)
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled


def logprob_temperature(temperature: float) -> float:
    """The T of the logprob convention above: the sampler's temperature, 1 for greedy (0)."""
    return temperature if temperature > 0 else 1.0


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class GenerateRequest:
    token_ids: list[int]
    params: SamplingParams
    episode_id: str = ""


@dataclass(frozen=True)
class GenerateResult:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert len(self.token_ids) == len(self.logprobs), (len(self.token_ids), len(self.logprobs))


@runtime_checkable
class Engine(Protocol):
    """What every rollout engine provides."""

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    def release(self, episode_id: str) -> None:
        """Forget any state (KV cache) kept for an episode that has ended."""

    async def update_weights(self, state_dict: dict[str, Any]) -> None:
        """Load new student weights (names as in the HF model's state_dict)."""

    async def close(self) -> None: ...
