"""Text the built-in environments generate: the corpus the embedded tokenizer is trained on.

    texts = env_corpus(["sql_db", "calculator", "math"], tasks_per_env=2000)

Each text is one oracle episode rendered with the default chat template (system prompt, tool
schemas, questions, tool calls, tool results, answers), plus the markers the agent loop adds
(parse errors, truncation), so every built-in env tokenizes compactly with one tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentopd.chat import TRUNCATION_MARKER
from agentopd.chat.template import DEFAULT_CHAT_TEMPLATE
from agentopd.splits import make_env_for_split

_EXTRA = [
    TRUNCATION_MARKER.format(kept=120, total=4096),
    "Error: could not parse your tool call: tool call 1: invalid JSON. "
    'Use <tool_call>{"name": ..., "arguments": {...}}</tool_call>.',
]


def oracle_conversation(env, task_id: str) -> tuple[list[dict], list[dict]]:
    """(messages, tool schemas) of the oracle solving one task."""
    messages, info = env.reset(options={"task_id": task_id})
    task = env.task
    for action in env.oracle(task):
        obs, _, terminated, truncated, _ = env.step(action)
        messages = [*messages, action, *obs]
        if terminated or truncated:
            break
    return messages, info["tools"]


def env_corpus(env_names: Sequence[str], tasks_per_env: int = 2000) -> list[str]:
    import jinja2

    template = jinja2.Environment(trim_blocks=False, lstrip_blocks=False).from_string(DEFAULT_CHAT_TEMPLATE)
    texts = list(_EXTRA)
    for name in env_names:
        env = make_env_for_split(name, "train")  # never the held-out tasks
        for task in env.tasks[:tasks_per_env]:
            messages, tools = oracle_conversation(env, task.id)
            texts.append(template.render(messages=messages, tools=tools or None, add_generation_prompt=False))
        env.close()
    return texts
