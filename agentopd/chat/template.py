"""Chat rendering: messages + tool schemas -> text, through the tokenizer's jinja2 chat template.

The default template (`qwen3.jinja`, `DEFAULT_CHAT_TEMPLATE`) is Qwen3-style with hermes tool
calls, so what runs on the embedded default runs the same way on a real Qwen3 checkpoint:

    <|im_start|>system\\n{system}\\n\\n# Tools ... <tools>\\n{schema json}\\n</tools> ...<|im_end|>\\n
    <|im_start|>user\\n{question}<|im_end|>\\n
    <|im_start|>assistant\\n{content}\\n<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response>\\n<tool_response>...</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n                      <- add_generation_prompt

Thinking: assistant content is rendered verbatim in every turn, `<think>` blocks included
(Qwen3's own template strips thinking from earlier turns; re-rendering then no longer equals
what the model saw). A tokenizer that ships its own chat template is rendered with that one;
ours is the fallback and the template of the embedded tokenizer.

    text = render(tokenizer, messages, tools, add_generation_prompt=True)
    ids = encode(tokenizer, text)
    ids = prompt_ids(tokenizer, messages, tools, **template_kwargs)   # both, with the generation prompt; cached
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from importlib.resources import files
from typing import Any

from transformers import PreTrainedTokenizerBase

from agentopd.types import Message

DEFAULT_CHAT_TEMPLATE: str = files("agentopd.chat").joinpath("qwen3.jinja").read_text(encoding="utf-8")

MessageLike = Message | dict[str, Any]


def to_template_messages(messages: Sequence[MessageLike]) -> list[dict[str, Any]]:
    """Messages as the plain dicts a chat template reads (`Message` objects converted). Each tool call carries its
    name and arguments both flat and under `function` (OpenAI's shape): templates read one or the other (Llama 3.x's
    only `tool_call.function`)."""
    out = []
    for m in messages:
        if isinstance(m, Message):
            m = m.to_dict()
        elif not isinstance(m, dict):
            raise ValueError(f"a message must be a dict or agentopd.types.Message, got {type(m).__name__}")
        if "role" not in m:
            raise ValueError(f"message without a 'role': {m!r}")
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [_with_function(c) for c in m["tool_calls"]]}
        out.append(m)
    return out


def _with_function(call: Any) -> Any:
    if not isinstance(call, dict) or "function" in call or "name" not in call:
        return call
    return {"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}, **call}


def chat_template_of(tokenizer: PreTrainedTokenizerBase) -> str:
    """The template used for `tokenizer`: its own when it ships one, else the default."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one, as transformers does
        template = template.get("default")
    return template or DEFAULT_CHAT_TEMPLATE


def tool_block(tools: Sequence[dict[str, Any]]) -> str:
    """The tool schemas as a hermes system-prompt block (the one `qwen3.jinja` renders): for a chat template that renders
    no tools of its own (`ignores_tools`)."""
    schemas = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" + schemas + "\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
            'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')  # fmt: skip


_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_7f3a", "description": "d", "parameters": {"type": "object", "properties": {}}}}
_IGNORES_TOOLS: dict[int, bool] = {}  # hash of a template -> it renders the same text with tools as without


def ignores_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template leaves tool schemas out (SmolLM2-Instruct's renders only each message's
    role and content): a model given such a prompt never sees the tools it is told to use."""
    template = chat_template_of(tokenizer)
    key = hash(template)
    if key not in _IGNORES_TOOLS:
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        kwargs = {"tokenize": False, "chat_template": template, "add_generation_prompt": True}
        try:
            _IGNORES_TOOLS[key] = (tokenizer.apply_chat_template(probe, tools=[_PROBE_TOOL], **kwargs)
                                   == tokenizer.apply_chat_template(probe, tools=None, **kwargs))  # fmt: skip
        except Exception:  # a template that refuses this probe: the real render says what it refuses
            _IGNORES_TOOLS[key] = False
    return _IGNORES_TOOLS[key]


def _with_tool_block(messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with the tool block at the end of the system prompt (a system message of its own where there is none
    or its content is not text)."""
    block = tool_block(tools)
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + block}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[MessageLike],
    tools: Sequence[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = False,
    **template_kwargs: Any,
) -> str:
    """Render `messages` (and the tool schemas) to text with the tokenizer's chat template. A template that renders no
    tools (`ignores_tools`) gets them as a hermes block at the end of the system prompt (`tool_block`)."""
    msgs = to_template_messages(messages)
    if tools and ignores_tools(tokenizer):
        msgs, tools = _with_tool_block(msgs, tools), None
    return tokenizer.apply_chat_template(
        msgs,
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        chat_template=chat_template_of(tokenizer),
        **template_kwargs,
    )


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of rendered text: special tokens in the text map to their ids, none are added."""
    return tokenizer.encode(text, add_special_tokens=False)


PROMPT_CACHE_SIZE = 4096  # prompts per tokenizer; the cache empties when full
_prompts: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, dict[str, tuple[int, ...]]] = weakref.WeakKeyDictionary()


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[MessageLike], tools: Sequence[dict[str, Any]] | None = None,
               **template_kwargs: Any) -> list[int]:
    """`encode(render(..., add_generation_prompt=True))`, the same prompt rendered and encoded once per tokenizer: an
    episode's start waits for it, and the n samples of a task (and every episode of an env with one system prompt and
    no per-task text) share it. With Qwen3's template and BPE a 375-token sql_db prompt took ~0.6 ms on our CPU, ~2 ms
    on a GPU machine's host (benchmarks/results/rollout_loop.md); the key (messages, tools and options as JSON) ~0.01 ms."""
    msgs = to_template_messages(messages)
    template = chat_template_of(tokenizer)  # a template or vocabulary changed on the same object is another prompt
    key = json.dumps([hash(template), len(tokenizer), msgs, list(tools) if tools else None, template_kwargs], sort_keys=True,
                     default=repr)
    cache = _prompts.setdefault(tokenizer, {})
    ids = cache.get(key)
    if ids is None:
        if len(cache) >= PROMPT_CACHE_SIZE:
            cache.clear()
        ids = cache[key] = tuple(encode(tokenizer, render(tokenizer, msgs, tools, add_generation_prompt=True, **template_kwargs)))
    return list(ids)

