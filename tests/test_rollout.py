"""The agent loop end to end: exact token streams over hundreds of episodes on both tool envs.

Uses a tokenizer built locally from the envs' own text, a tiny random-weight Qwen3 model
served by the real HFEngine, and the ScriptedEngine replaying oracle / malformed turns.
"""

import asyncio

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from agentopd import make_env
from agentopd.chat import check_stored_episode
from agentopd.corpus import env_corpus
from agentopd.chat import build_tokenizer
from agentopd.engines import make_engine
from agentopd.engines.hf import HFEngine
from agentopd.engines.scripted import ScriptedEngine
from agentopd.rollout import PARSE_ERROR_TOOL, EnvPool, Rollout, RolloutConfig
from agentopd.types import StopReason


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(env_corpus(["sql_db", "calculator", "math"], 150), vocab_size=800)


@pytest.fixture(scope="module")
def tiny_model(tok):
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen3ForCausalLM(cfg).eval()


def assert_exact(tok, ep):
    """docs/design.md 3.1 invariants plus what only the loop can check: spans equal the sampled text,
    tool results sit in mask-0 tokens, and the drift checker finds nothing."""
    s = ep.tokens
    assert len(s.response_mask) == len(s.token_ids) - s.prompt_len == len(s.logprobs) == len(s.turn_index)
    resp = s.response_ids
    spans, cur = [], []
    for i, m in enumerate(s.response_mask):
        if m:
            cur.append(resp[i])
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    raws = [t.raw_text for t in ep.turns if t.raw_text or True]
    assert len(spans) <= len(raws)
    for span, raw in zip(spans, raws):
        text = tok.decode(span, skip_special_tokens=False)
        assert text.removesuffix("<|im_end|>") == raw
    tool_text = tok.decode([t for t, m in zip(resp, s.response_mask) if m == 0], skip_special_tokens=False)
    for turn in ep.turns:
        for obs in turn.observation:
            assert obs.content in tool_text
    assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.response_mask) if m == 0)
    report = check_stored_episode(tok, ep)
    assert not report.drift, report.findings


@pytest.mark.parametrize("env_name", ["sql_db", "calculator", "math"])
def test_oracle_episodes_are_exact_and_succeed(tok, env_name):
    env = make_env(env_name)
    specs = Rollout.specs_for([t.id for t in env.tasks[:60]], n=1)
    engine = ScriptedEngine(tok)
    for spec in specs:
        engine.script(spec.episode_id, env.oracle(env.tasks[env._by_id[spec.task_id]]))
    rollout = Rollout(lambda: make_env(env_name), engine, tok, RolloutConfig(max_context=4096))
    episodes = rollout.run_sync(specs)
    assert all(e.success and e.stop_reason is StopReason.ANSWER for e in episodes)
    assert max(e.num_turns for e in episodes) >= (1 if env_name == "math" else 2)
    for ep in episodes:
        assert_exact(tok, ep)


@pytest.mark.parametrize("kind", ["hf", "fast"])
@pytest.mark.parametrize("env_name", ["sql_db", "calculator"])
def test_random_model_episodes_are_exact(tok, tiny_model, env_name, kind):
    engine = make_engine(kind, tiny_model, max_batch_size=64, seed=0)
    env = make_env(env_name)
    specs = Rollout.specs_for([t.id for t in env.tasks[:50]], n=2)
    cfg = RolloutConfig(max_context=900, max_new_tokens=24, max_turns=3, temperature=1.0)
    episodes = Rollout(lambda: make_env(env_name), engine, tok, cfg).run_sync(specs)
    assert len(episodes) == 100
    for ep in episodes:
        assert ep.stop_reason in {StopReason.ANSWER, StopReason.MAX_TURNS, StopReason.LENGTH}
        assert_exact(tok, ep)
    # random text has no stop token within 24 tokens: most turns end on max_tokens and
    # get the closing inserted with mask 0; multi-turn episodes exist through parse errors.
    assert any(ep.num_turns > 1 for ep in episodes)


def test_malformed_generations_are_handled_and_counted(tok):
    env_name = "sql_db"
    env = make_env(env_name)
    task = env.tasks[0]
    cases = {
        "unclosed": ['<tool_call>\n{"name": "sql_query", "arguments": {"query": "SELECT 1"}', "1"],
        "bad_json": ["<tool_call>\n{name: sql_query}\n</tool_call>", "1"],
        "unknown_tool": ['<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', "1"],
        "empty": ["", "1"],
        "bad_args": ['<tool_call>\n{"name": "sql_query", "arguments": {"query": 5}}\n</tool_call>', "1"],
    }
    engine = ScriptedEngine(tok)
    specs = Rollout.specs_for([task.id] * len(cases), n=1)
    for spec, texts in zip(specs, cases.values()):
        engine.script_texts(spec.episode_id, texts)
    eps = dict(zip(cases, Rollout(lambda: make_env(env_name), engine, tok, RolloutConfig(max_context=4096)).run_sync(specs)))
    for name in ("unclosed", "bad_json", "empty"):
        assert eps[name].turns[0].parse_error, name
        assert eps[name].turns[0].observation[0].name == PARSE_ERROR_TOOL
        assert eps[name].turns[0].observation[0].content.startswith("Error:")
        assert eps[name].num_turns == 2
    for name in ("unknown_tool", "bad_args"):
        assert not eps[name].turns[0].parse_error and eps[name].turns[0].tool_errors == 1, name
    for ep in eps.values():
        assert_exact(tok, ep)


def test_turn_cut_by_max_tokens_mid_call(tok):
    env = make_env("sql_db")
    engine = ScriptedEngine(tok)
    [spec] = Rollout.specs_for([env.tasks[0].id], n=1)
    long_call = '<tool_call>\n{"name": "sql_query", "arguments": {"query": "SELECT ' + "name, " * 40 + 'id FROM customers"}}\n</tool_call>'
    engine.script_texts(spec.episode_id, [long_call, "3"], stop=False)
    ep = Rollout(lambda: make_env("sql_db"), engine, tok, RolloutConfig(max_new_tokens=20, max_context=4096)).run_sync([spec])[0]
    assert ep.turns[0].parse_error and "unclosed" in ep.turns[0].observation[0].content
    assert_exact(tok, ep)


def test_context_limit_stops_with_length(tok):
    env = make_env("sql_db")
    engine = ScriptedEngine(tok)
    [spec] = Rollout.specs_for([env.tasks[0].id], n=1)
    engine.script(spec.episode_id, env.oracle(env.tasks[0]))
    ro = Rollout(lambda: make_env("sql_db"), engine, tok, RolloutConfig(max_context=4096))
    full = ro.run_sync([spec])[0]
    n = len(full.tokens.token_ids)
    engine.script(spec.episode_id, env.oracle(env.tasks[0]))
    short = Rollout(lambda: make_env("sql_db"), engine, tok, RolloutConfig(max_context=n - 5)).run_sync([spec])[0]
    assert short.stop_reason is StopReason.LENGTH and not short.success
    assert len(short.tokens.token_ids) <= n - 5
    assert_exact(tok, short)


def test_episode_timeout_is_recorded(tok, tiny_model):
    class Stalled(HFEngine):
        async def generate(self, request):
            await asyncio.sleep(10)

    env = make_env("calculator")
    specs = Rollout.specs_for([env.tasks[0].id, env.tasks[1].id], n=1)
    cfg = RolloutConfig(episode_timeout_s=0.2)
    eps = Rollout(lambda: make_env("calculator"), Stalled(tiny_model), tok, cfg).run_sync(specs)
    assert [e.stop_reason for e in eps] == [StopReason.TIMEOUT] * 2
    assert eps[0].tokens.prompt_len == len(eps[0].tokens.token_ids)


def test_specs_are_stable_and_distinct():
    a = Rollout.specs_for(["t1", "t2"], n=2, step=3, seed=7)
    b = Rollout.specs_for(["t1", "t2"], n=2, step=3, seed=7)
    assert a == b and len({s.episode_id for s in a}) == 4 and len({s.seed for s in a}) == 4


def test_tool_format_and_enable_thinking_are_config_keys(tok):
    """rollout.enable_thinking=false reaches every render and the episode's info (check-tokens re-renders with it);
    rollout.tool_format overrides the format detected from the template: hermes calls read as qwen_xml are parse
    errors, answered with the XML format's hint; a format that does not exist is refused naming the choices."""
    from agentopd.chat.formats import ToolFormat
    from agentopd.config import load_config

    cfg = load_config("sql_db", overrides=["rollout.enable_thinking=false", "rollout.tool_format=qwen_xml"]).rollout.build()
    assert cfg.enable_thinking is False and cfg.tool_format is ToolFormat.QWEN_XML
    env = make_env("sql_db")
    task = env.tasks[0]
    engine = ScriptedEngine(tok)
    rollout = Rollout(lambda: make_env("sql_db"), engine, tok, RolloutConfig(**{**cfg.__dict__, "max_context": 4096, "max_turns": 2}))
    assert rollout.template_kwargs == {"enable_thinking": False}
    (spec,) = rollout.specs_for([task.id])
    engine.script(spec.episode_id, env.oracle(task)[:1] * 2)
    (ep,) = rollout.run_sync([spec])
    assert ep.info["template_kwargs"] == {"enable_thinking": False}
    assert ep.turns[0].parse_error and "<function=NAME>" in ep.turns[0].observation[0].content
    assert check_stored_episode(tok, ep).ok
    assert Rollout(lambda: make_env("sql_db"), engine, tok).tool_format is ToolFormat.HERMES  # detected from the template
    with pytest.raises(ValueError, match="tool_format"):
        load_config("sql_db", overrides=["rollout.tool_format=mistral"])  # not built


def test_an_env_pool_outlives_its_rollouts(tok):
    """Players keeps one EnvPool per source across phases: the second phase makes no env, and closing a rollout
    leaves the pool's envs open (the rollout does not own them)."""
    made = []

    def factory():
        made.append(make_env("calculator"))
        return made[-1]

    pool = EnvPool(factory)
    env = make_env("calculator")
    specs = Rollout.specs_for([t.id for t in env.tasks[:8]], n=1)
    for phase in range(2):
        engine = ScriptedEngine(tok)
        for spec in specs:
            engine.script(spec.episode_id, env.oracle(env.tasks[env._by_id[spec.task_id]]))
        rollout = Rollout(pool, engine, tok, RolloutConfig(max_context=4096, concurrency=4))
        assert all(e.success for e in rollout.run_sync(specs))
        rollout.close()
        assert 1 <= len(made) <= 4, f"phase {phase}: {len(made)} envs made for 4 episodes in flight"
    assert pool.take() in made  # still idle in the pool, open
    pool.close()
