"""Privileged self-distillation: the teacher reads the student's episode with context the student's prompt lacked.

    priv = PrivilegedView(mixture, tokenizer, Privileged.SCHEMA)     # teacher.privileged=schema
    priv.check()                                    # every source's env gives that context (before the run)
    streams = priv.streams(planned, episodes)       # what the teacher scores instead of the episodes' streams

The teacher (any teacher with the student's tokenizer: `teacher=self`, a frozen copy of the student's starting
weights, or the built-in teacher) scores exactly the tokens the student sampled, in a stream whose prompt is the
privileged one: the episode's initial messages with the env's privileged text (`ToolEnv.privileged_context(task,
kind)`: the oracle's solution, the hidden schema) appended to the last user message, rendered by the same chat
template with the same tools and options, then the student's stream after its prompt, token for token:

    student  [ prompt (P ids)        | r_0 r_1 ... r_{R-1} ]    prompt_len = P
    teacher  [ privileged prompt (P')| r_0 r_1 ... r_{R-1} ]    prompt_len = P'

The response part (its ids, response_mask, sampler logprobs, turn_index) is the student's unchanged, so the
teacher's per-response-token scores (agentopd.teacher.base's index convention: response token i is predicted by
position prompt_len + i - 1) land on the student's response positions with no re-alignment: row i of the teacher's
scores is the student's token i, which the student's own forward predicts from position P + i - 1. Nothing is
re-tokenized: the student's prompt is rendered again only to check that it is the stream's prompt (the prefix
property), and the privileged prompt is rendered from messages, never decoded from ids.

Why a `teacher.privileged` key and not a teacher name (`teacher=self:privileged`): which weights the teacher has and
what it is told are independent choices. The key composes with every teacher that shares the student's tokenizer
(`teacher=self`, `teacher=builtin`, a folder), the name keeps meaning only the model. Config refuses it where the
teacher would play (objective=sft, recipe.teacher_fraction / sft_steps / intervene_below: the teacher's own turns
would need the context too) and with a cross-tokenizer loss (another tokenizer reads its own rendering).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from agentopd.chat.template import prompt_ids
from agentopd.env import Privileged, ToolEnv
from agentopd.recipes.base import Recipe, Stage
from agentopd.types import TEMPLATE_KWARGS, Episode, TokenStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentopd.plan import Mixture, Planned

HEADER = "Privileged context (the student does not see this):"


def privileged_messages(messages: Sequence[dict], text: str) -> list[dict]:
    """The initial messages with `text` appended, under HEADER, to the last user message."""
    out = [dict(m) for m in messages]
    last = max((i for i, m in enumerate(out) if m["role"] == "user"), default=None)
    assert last is not None, "an episode's initial messages hold a user message"
    out[last]["content"] = f"{out[last]['content']}\n\n{HEADER}\n{text}"
    return out


def privileged_stream(tokenizer: PreTrainedTokenizerBase, episode: Episode, text: str) -> TokenStream:
    """The stream the privileged teacher scores: the privileged prompt, then the student's response (module docstring)."""
    stream = episode.tokens
    assert stream is not None
    first = next((i for i, m in enumerate(episode.messages) if m.role == "assistant"), len(episode.messages))
    initial = [m.to_dict() for m in episode.messages[:first]]
    tools = episode.tools or None
    options = episode.info.get(TEMPLATE_KWARGS, {})
    prompt = prompt_ids(tokenizer, initial, tools, **options)
    assert prompt == stream.token_ids[: stream.prompt_len], "the episode's prompt is not its initial messages rendered"
    ids = prompt_ids(tokenizer, privileged_messages(initial, text), tools, **options)
    out = TokenStream(ids + stream.token_ids[stream.prompt_len :], len(ids), list(stream.response_mask),
                      list(stream.logprobs), list(stream.turn_index))  # fmt: skip
    out.validate()
    return out


class PrivilegedView:
    """The privileged streams of a run's episodes: one env instance per source answers `privileged_context`."""

    def __init__(self, mixture: Mixture, tokenizer: PreTrainedTokenizerBase, kind: Privileged | str):
        self.mixture = mixture
        self.tokenizer = tokenizer
        self.kind = Privileged(kind)
        self._envs: dict[str, ToolEnv] = {}

    def _env(self, source: str) -> ToolEnv:
        """The source's env serving its training tasks (only training episodes are scored)."""
        if source not in self._envs:
            self._envs[source] = self.mixture.sources[source].factory("train")()
        return self._envs[source].unwrapped

    def text(self, source: str, task_id: str) -> str:
        env = self._env(source)
        if not isinstance(env, ToolEnv):
            raise ValueError(f"teacher.privileged={self.kind}: env {type(env).__name__} (source {source!r}) is not an "
                             "agentopd ToolEnv: it has no privileged_context(task, kind)")  # fmt: skip
        task = env.tasks[env.task_index(options={"task_id": task_id})]
        text = env.privileged_context(task, self.kind)
        if text is None:
            raise ValueError(f"teacher.privileged={self.kind}: env {env.name!r} (source {source!r}) gives no {self.kind} "
                             f"context for task {task.id!r} (ToolEnv.privileged_context returned None)")  # fmt: skip
        return text

    def check(self) -> None:
        """Every source's env gives the context for its first training task: a ValueError before the run otherwise."""
        for source in self.mixture.sources:
            self.text(source, self.mixture.tasks(source)[0].id)

    def streams(self, planned: Sequence[Planned], episodes: Sequence[Episode]) -> list[TokenStream]:
        return [privileged_stream(self.tokenizer, ep, self.text(p.source, p.spec.task_id)) for p, ep in zip(planned, episodes, strict=True)]

    def close(self) -> None:
        for env in self._envs.values():
            env.close()
        self._envs.clear()


class PrivilegedContext(Recipe):
    """`teacher.privileged` as a recipe of the score stage: the teacher reads the privileged streams of the view."""

    name = "privileged"
    stages = frozenset({Stage.SCORE})
    scores_played_streams = False

    def __init__(self, view: PrivilegedView):
        self.view = view

    def streams(self, planned: Sequence[Planned], episodes: Sequence[Episode]) -> list[TokenStream]:
        return self.view.streams(planned, episodes)

    def close(self) -> None:
        self.view.close()
