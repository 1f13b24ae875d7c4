"""ScriptedEngine: plays fixed assistant turns (e.g. an env's oracle) through the Engine protocol.

Demonstrations for supervised fine-tuning (the embedded default's bootstrap, `objective=sft`
on reference solutions) go through the very same agent loop and token-stream assembly as
sampled episodes: this engine answers each request of an episode with that episode's next
scripted turn, tokenized as the canonical text (in the template's tool-call format) plus the stop token (harmony's
`<|call|>` after a call, `<|return|>` after an answer), logprob 0.0.

    engine = ScriptedEngine(tokenizer)
    engine.script("train-000000-00000", oracle_actions)      # list of assistant action dicts
    episodes = Rollout(env_factory, engine, tokenizer).run_sync(specs)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from agentopd.chat import chat_template_of, encode
from agentopd.chat.formats import ToolFormat, detect_format, harmony_stop, turn_text
from agentopd.engines.base import FinishReason, GenerateRequest, GenerateResult


def action_text(action: dict[str, Any], fmt: ToolFormat = ToolFormat.HERMES) -> str:
    """The canonical text of an assistant action in tool-call format `fmt` (hermes: content, then one block per call)."""
    return turn_text(fmt, action.get("content") or "", action.get("tool_calls") or [])


class ScriptedEngine:
    """Returns pre-set turns per episode id; an episode without a script is an error. Turns are written in the tool-call
    format of the tokenizer's template and ended by its stop token (`<|im_end|>` where the template has it, else eos)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_token: str | None = None):
        self.tokenizer = tokenizer
        template = chat_template_of(tokenizer)
        self.tool_format = detect_format(template)
        if stop_token is None:
            stop_token = "<|im_end|>" if "<|im_end|>" in template or tokenizer.eos_token is None else tokenizer.eos_token
        stop = tokenizer.convert_tokens_to_ids(stop_token)
        if not isinstance(stop, int) or stop == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no stop token {stop_token!r}")
        self.stop_id = stop
        self._scripts: dict[str, deque[list[int]]] = {}

    def script(self, episode_id: str, actions: Sequence[dict[str, Any]]) -> None:
        """Script assistant actions (dicts) as canonical text, each ended by the stop token."""
        self._scripts[episode_id] = deque(self._ids(action_text(a, self.tool_format)) for a in actions)

    def script_texts(self, episode_id: str, texts: Sequence[str], stop: bool = True) -> None:
        """Script raw sampled texts (malformed ones included); `stop=False` leaves turns unterminated."""
        self._scripts[episode_id] = deque(self._ids(t, stop) for t in texts)

    def _ids(self, text: str, stop: bool = True) -> list[int]:
        """The text's ids and its stop id (harmony: `<|call|>` after a call, `<|return|>` otherwise)."""
        if not stop:
            return encode(self.tokenizer, text)
        if self.tool_format is ToolFormat.HARMONY:
            return encode(self.tokenizer, text) + [self.tokenizer.convert_tokens_to_ids(harmony_stop(text))]
        return encode(self.tokenizer, text) + [self.stop_id]

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        turns = self._scripts.get(request.episode_id)
        if not turns:
            raise RuntimeError(f"no scripted turn left for episode {request.episode_id!r}")
        ids = turns.popleft()
        finish = FinishReason.STOP
        if len(ids) > request.params.max_tokens:
            ids, finish = ids[: request.params.max_tokens], FinishReason.LENGTH
        return GenerateResult(ids, [0.0] * len(ids), finish)

    def release(self, episode_id: str) -> None:
        self._scripts.pop(episode_id, None)

    async def update_weights(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError("a scripted engine has no weights")

    async def close(self) -> None:
        self._scripts.clear()
