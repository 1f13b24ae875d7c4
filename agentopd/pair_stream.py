"""check-pair's token_stream check, the playing half: a conversation played through the agent loop as a model
speaking the tokenizer's template (and its tool-call format) would sample it.

    episode = play_conversation(tok, messages, tools, {"enable_thinking": False})   # an agentopd.types.Episode

The conversation becomes an environment (`_Replay`: reset gives what precedes the first assistant turn, each step
what follows the next one); its assistant turns are scripted (agentopd.engines.scripted), or the last one sampled by
an engine (`_ScriptedThen`). agentopd.pair checks the stored episode as `agentopd check-tokens` would.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from agentopd.chat import chat_template_of


class _Replay:
    """A conversation as an environment: `reset` gives its messages before the first assistant turn, each `step`
    the messages after the next one (tool results); the last assistant turn ends it."""

    name = "replay"

    def __init__(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]):
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        self.opening, self.tools = messages[:first], tools
        self.after: list[list[dict[str, Any]]] = []  # per assistant turn: what follows it
        for m in messages[first:]:
            if m["role"] == "assistant":
                self.after.append([])
            else:
                self.after[-1].append(m)
        self.unwrapped, self.turn = self, 0

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[list[dict[str, Any]], dict]:
        self.turn = 0
        return [dict(m) for m in self.opening], {"tools": self.tools, "task_id": "replay"}

    def step(self, action: dict[str, Any]) -> tuple[list[dict[str, Any]], float, bool, bool, dict]:
        obs, self.turn = self.after[self.turn], self.turn + 1
        done = self.turn == len(self.after)
        return [dict(m) for m in obs], float(done), done, False, {"success": done}

    def close(self) -> None:
        pass


class _ScriptedThen:
    """Scripted turns first, then `engine` samples (the student's own tokens, as in a run)."""

    def __init__(self, scripted: Any, engine: Any, scripted_turns: int):
        self.scripted, self.engine, self.left = scripted, engine, scripted_turns

    async def generate(self, request: Any) -> Any:
        if self.left > 0 or self.engine is None:
            self.left -= 1
            return await self.scripted.generate(request)
        return await self.engine.generate(request)

    def release(self, episode_id: str) -> None:
        self.scripted.release(episode_id)
        if self.engine is not None:
            self.engine.release(episode_id)


def play_conversation(tok: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                      template_kwargs: dict[str, Any] | None = None, *, reasoning: bool = True, engine: Any = None):  # fmt: skip
    """The conversation's assistant turns played through the agent loop as a model speaking `tok`'s template would
    sample them (with `reasoning`, a reasoning block first when the template has `<think>`): an
    agentopd.types.Episode. With an `engine`, it samples the last turn instead (at T=1, up to 32 tokens)."""
    from agentopd.chat.drift import opened_reasoning
    from agentopd.chat.formats import detect_format
    from agentopd.engines.scripted import ScriptedEngine, action_text
    from agentopd.rollout import Rollout, RolloutConfig

    kw = dict(template_kwargs or {})
    opened = opened_reasoning(tok, kw)  # what the generation prompt opens the turn with
    think = reasoning and "<think>" in chat_template_of(tok)
    texts = []
    for k, m in enumerate(m for m in messages if m["role"] == "assistant"):
        thought = f"Turn {k + 1}: I will {'call the tool' if m.get('tool_calls') else 'answer'}.\n</think>\n\n"
        prefix = "" if not think or opened.endswith("</think>\n\n") else thought if opened else "<think>\n" + thought
        texts.append(prefix + action_text(m, detect_format(chat_template_of(tok))))
    scripted = ScriptedEngine(tok)
    player = _ScriptedThen(scripted, engine, len(texts) - 1 if engine is not None else len(texts))
    config = RolloutConfig(max_turns=len(texts), max_context=1 << 20, max_new_tokens=32 if engine is not None else 1 << 16,
                           max_tool_tokens=1 << 16, temperature=1.0)  # fmt: skip
    rollout = Rollout(lambda: _Replay(messages, tools), player, tok, config, template_kwargs=kw)
    (spec,) = rollout.specs_for(["replay"])
    scripted.script_texts(spec.episode_id, texts)
    try:
        (episode,) = rollout.run_sync([spec])
    finally:
        rollout.close()
    return episode
