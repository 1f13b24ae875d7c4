"""Lenient reading of tool calls in the hermes family (agentopd.chat.bare_calls): the turns real Qwen2.5-Coder models
wrote on our envs (2026-11-28), and hostile variants of them. The tokens are never touched: the agent loop with a
scripted engine that writes bare calls stays at zero drift under check-tokens' own check."""

from __future__ import annotations

import pytest

from test_stream import tok  # noqa: F401  (a fixture: the tiny tokenizer with agentopd's hermes template)

from agentopd.chat.formats import ToolFormat, parse_turn

TOOLS = {"calculate", "sql_query"}
# exactly as written, greedy, by Qwen2.5-Coder-1.5B-Instruct and -0.5B-Instruct (the finding 3)
BARE_15B = '{"name": "calculate", "arguments": {"expression": "(31 * 14) + (9 * 14 * 1.5)"}}'
FENCED_05B = '```json\n{\n  "name": "calculate",\n  "arguments": {\n    "expression": "(31 * 14) + (9 * 1.5 * 14)"\n  }\n}\n```'


def lenient(text: str):
    return parse_turn(text, ToolFormat.HERMES, bare_tools=TOOLS)


@pytest.mark.parametrize("text, expression", [(BARE_15B, "(31 * 14) + (9 * 14 * 1.5)"), (FENCED_05B, "(31 * 14) + (9 * 1.5 * 14)")])
def test_the_real_models_turns_are_calls(text, expression):
    turn = lenient(text)
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [("calculate", {"expression": expression})]
    assert turn.content == "" and turn.errors == []
    strict = parse_turn(text, ToolFormat.HERMES)  # what the loop read before: a final answer
    assert strict.tool_calls == [] and strict.content == text.strip()


def test_prose_around_a_fenced_call_is_content_and_other_code_stays():
    turn = lenient("I will query it.\n```sql\nSELECT 1\n```\n```json\n" + BARE_15B + "\n```\nDone.")
    assert [c.name for c in turn.tool_calls] == ["calculate"] and not turn.errors
    assert turn.content == "I will query it.\n```sql\nSELECT 1\n```\n\nDone."


@pytest.mark.parametrize("text", [
    '{"name": "search", "q": "x"}',                         # names no offered tool, not a call's shape
    '{"name": "search", "arguments": "x"}',                 # arguments that are no object
    '{"answer": 42}', "[1, 2, 3]", "42", '"Paris"',          # an answer that happens to be JSON
    '{"name": "Amanda Campbell", "total": 100}',             # a row, not a call
    "```sql\nSELECT name FROM products\n```",                # fenced code that is no call
    "The total is 623.",
])  # fmt: skip
def test_json_that_is_not_a_call_stays_an_answer(text):
    turn = lenient(text)
    assert turn.tool_calls == [] and turn.errors == [] and turn.content == text.strip()


def test_two_objects_are_two_calls_and_a_stray_value_beside_a_call_is_reported():
    two = lenient(BARE_15B + "\n" + BARE_15B.replace("calculate", "sql_query").replace("expression", "query"))
    assert [c.name for c in two.tool_calls] == ["calculate", "sql_query"] and not two.errors
    mixed = lenient(BARE_15B + ' {"note": 1}')
    assert [c.name for c in mixed.tool_calls] == ["calculate"]
    assert mixed.errors == ["tool call 2: a JSON value beside the tool call that is not a call of an offered tool"]


@pytest.mark.parametrize("text, error", [
    (BARE_15B[:40], "tool call 1: invalid JSON"),                       # cut off by max_new_tokens
    (FENCED_05B[:50], "tool call 1: unclosed ``` fence"),
    ("```json\n" + BARE_15B[:45] + "\n```", "tool call 1: invalid JSON"),
    ('{"name": "calculate", "arguments": [1]}', 'tool call 1 (calculate): "arguments" must be a JSON object'),
])  # fmt: skip
def test_a_broken_call_of_an_offered_tool_is_an_error_not_an_answer(text, error):
    turn = lenient(text)
    assert turn.tool_calls == [] and turn.content == ""
    assert len(turn.errors) == 1 and turn.errors[0].startswith(error), turn.errors


def test_tagged_turns_thinking_and_strict_mode_are_unchanged():
    tagged = "<tool_call>\n" + BARE_15B + "\n</tool_call>"
    assert lenient(tagged) == parse_turn(tagged, ToolFormat.HERMES)
    thought = lenient("<think>use the tool</think>" + BARE_15B)
    assert thought.thinking == "use the tool" and [c.name for c in thought.tool_calls] == ["calculate"]
    assert parse_turn(BARE_15B, ToolFormat.HERMES, bare_tools=()).tool_calls == []
    # only hermes reads bare calls this way: llama3_json has its own rules
    assert parse_turn(BARE_15B, ToolFormat.LLAMA3_JSON, bare_tools=TOOLS).tool_calls[0].name == "calculate"


def test_the_agent_loop_executes_bare_calls_and_keeps_the_sampled_tokens(tok):  # noqa: F811
    """A scripted engine writes the 0.5B's fenced call, then the answer: the env runs the call (lenient, the default),
    the stream holds the sampled text verbatim (check-tokens: zero drift); strict reads the call as a wrong answer."""
    from agentopd import make_env
    from agentopd.chat import check_stored_episode
    from agentopd.engines.scripted import ScriptedEngine
    from agentopd.rollout import Rollout, RolloutConfig

    env = make_env("calculator", split="eval")
    task = env.unwrapped.tasks[0]
    env.close()
    call = '```json\n{"name": "calculate", "arguments": {"expression": "2 + 3"}}\n```'

    def play(parsing: str):
        engine = ScriptedEngine(tok)
        rollout = Rollout(lambda: make_env("calculator", split="eval"), engine, tok, RolloutConfig(max_turns=4, tool_parsing=parsing))
        (spec,) = rollout.specs_for([task.id])
        engine.script_texts(spec.episode_id, [call, str(task.answer)])
        try:
            return rollout.run_sync([spec])[0]
        finally:
            rollout.close()

    ep = play("lenient")
    assert ep.turns[0].tool_calls == {"calculate": 1}
    assert [m.role for m in ep.messages[2:]] == ["assistant", "tool", "assistant"] and ep.messages[3].content == "5"
    assert ep.success and ep.turns[0].raw_text == call
    assert check_stored_episode(tok, ep).ok
    strict = play("strict")
    assert len(strict.turns) == 1 and not strict.success and strict.messages[-1].content == call


def test_a_call_in_doubled_braces_as_its_template_shows_it_is_read():
    """Qwen2.5-Coder-1.5B-Instruct's GGUF template shows `{{"name": <function-name>, ...}}` (an escaped brace left
    in), and the model writes exactly that on sql_db (2026-11-29, greedy)."""
    written = """{{"name": "sql_query", "arguments": {"query": "SELECT role FROM employees WHERE name = 'Elizabeth Johnson';"}}}"""
    turn = lenient(written)
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [
        ("sql_query", {"query": "SELECT role FROM employees WHERE name = 'Elizabeth Johnson';"})]
    assert lenient('{{"name": "sql_query", "arguments": {"query": "SEL').errors[0].startswith("tool call 1: invalid JSON")
    assert lenient('{{"a": 1}}').tool_calls == [] and lenient('{{"a": 1}}').content == '{{"a": 1}}'


@pytest.mark.parametrize("text", [
    # written by Qwen2.5-Coder-1.5B-Instruct on sql_db, greedy, schema in the prompt (2026-11-29): a table for the tool
    """{"name": "employees", "arguments": {"query": "SELECT role FROM employees WHERE name = 'Elizabeth Johnson'"}}""",
    """```json\n{"name": "orders", "parameters": {"query": "SELECT 1"}}\n```""",
])  # fmt: skip
def test_a_call_of_a_tool_not_offered_is_an_error_the_model_reads(text):
    turn = lenient(text)
    assert turn.tool_calls == [] and turn.content == ""
    name = "employees" if "employees" in text else "orders"
    assert turn.errors == [f"tool call 1: no tool is named {name!r}; the tools are calculate, sql_query"]


def test_doubled_braces_closed_with_one_two_or_three_braces():
    inner = '{"name": "sql_query", "arguments": {"query": "SELECT 1"}}'
    for closing in ("", "}", "}}"):
        turn = lenient("{" + inner + closing)
        assert [(c.name, c.arguments) for c in turn.tool_calls] == [("sql_query", {"query": "SELECT 1"})], closing
    assert lenient("{" + inner + "}}}").tool_calls == []  # three more: not the escaped example any more
