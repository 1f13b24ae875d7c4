"""Recoverable mistakes in demonstrations (agentopd.recovery): the env really rejects them, the
demonstration still succeeds, the mistaken turn is out of the loss and the correction is in, the
episode is token-exact through the real agent loop, and the explore preset's embedded models use them."""

from __future__ import annotations

import collections
import json
import random
from dataclasses import replace

import pytest

from agentopd.bootstrap import TINY_SPEC, bootstrap, demonstrations, ensure_tokenizer
from agentopd.chat import check_stored_episode
from agentopd.engines.scripted import ScriptedEngine, action_text
from agentopd.recovery import MistakeKind, mask_turns, recovery_eval, recovery_cases, rejected, with_mistake
from agentopd.rollout import Rollout, RolloutConfig
from agentopd.batch import TrainSample
from envs.sql_db import SqlDbEnv

EXPLORE = {"difficulty": ["explore"], "max_turns": 8}


@pytest.fixture(scope="module")
def home(private_home):
    return private_home


@pytest.fixture(scope="module")
def tok(home):
    return ensure_tokenizer(TINY_SPEC, home=home)


def test_mistakes_are_rejected_by_the_env_and_then_recovered(home):
    env = SqlDbEnv(split="train", **EXPLORE)
    rng = random.Random(0)
    kinds = collections.Counter()
    try:
        for task in env.tasks[::25]:
            oracle = env.oracle(task)
            demo = with_mistake(env, task, oracle, rng)
            assert demo is not None, task.id
            (k,) = demo.mistake_turns
            assert demo.actions[:k] == oracle[:k] and demo.actions[k + 1 :] == oracle[k:]
            assert rejected(demo.reply)
            kinds[demo.kind] += 1
            env.reset(options={"task_id": task.id})
            replies = []
            for action in demo.actions:
                obs, reward, terminated, truncated, _ = env.step(action)
                replies.append("\n".join(m["content"] for m in obs))
            assert terminated and reward == 1.0  # the correction solves the task
            assert [rejected(r) for r in replies[:-1]] == [i == k for i in range(len(replies) - 1)]
            assert replies[k] == demo.reply
    finally:
        env.close()
    assert set(kinds) == set(MistakeKind), kinds


def test_no_mistake_where_none_applies(home):
    env = SqlDbEnv(split="train", difficulty=["count"], max_turns=2)
    try:
        task = env.tasks[0]
        assert with_mistake(env, task, env.oracle(task), random.Random(0)) is None  # no turn to spare
        answer_only = [{"role": "assistant", "content": task.answer, "tool_calls": []}]
        assert with_mistake(env, task, answer_only, random.Random(0)) is None  # no tool call to spoil
    finally:
        env.close()


def test_demonstrations_mask_the_mistaken_turn_and_keep_the_correction(home, tok):
    clean = demonstrations("sql_db", tok, 24, 2048, env_kwargs=EXPLORE)
    mixed = demonstrations("sql_db", tok, 24, 2048, env_kwargs=EXPLORE, mistakes=0.5)
    changed = 0
    for a, b in zip(clean, mixed, strict=True):
        if a.token_ids == b.token_ids:  # no mistake here: the very same sample as without mistakes
            assert a.response_mask == b.response_mask
            continue
        changed += 1
        turns = sorted(set(b.turn_index))
        learned = {k for k, m in zip(b.turn_index, b.response_mask, strict=True) if m}
        assert len(set(turns) - learned) == 1  # exactly one assistant turn has no loss token: the mistake
        assert b.num_student_tokens == a.num_student_tokens  # the correction and the rest: as in the clean demo
        assert len(b.token_ids) > len(a.token_ids)  # the mistake and the env's reply stay in the context
    assert 6 <= changed <= 18


def test_recovered_episode_is_token_exact_through_the_agent_loop(home, tok):
    env = SqlDbEnv(split="train", **EXPLORE)
    task = next(t for t in env.tasks if t.data["template"] == "x_buyer_email")
    demo = with_mistake(env, task, env.oracle(task), random.Random(3))
    env.close()
    assert demo is not None
    engine = ScriptedEngine(tok)
    specs = Rollout.specs_for([task.id], n=1, split="demo")
    engine.script(specs[0].episode_id, demo.actions)
    rollout = Rollout(lambda: SqlDbEnv(split="train", **EXPLORE), engine, tok, RolloutConfig(max_context=2048, max_new_tokens=2048))
    (episode,) = rollout.run_sync(specs)
    rollout.close()
    assert episode.success and episode.num_turns == len(demo.actions)
    report = check_stored_episode(tok, episode)
    assert report.ok, report.info
    sample = mask_turns(TrainSample.from_stream(episode.tokens), demo.mistake_turns)
    (k,) = demo.mistake_turns

    def turn_text(i: int, mask: list[int]) -> str:
        ids = [t for t, m, j in zip(episode.tokens.token_ids[episode.tokens.prompt_len :], mask, sample.turn_index, strict=True) if j == i and m]
        return tok.decode(ids)

    bad, fix = demo.actions[k], demo.actions[k + 1]
    assert turn_text(k, episode.tokens.response_mask).startswith(action_text(bad))  # sampled, then ...
    assert turn_text(k, sample.response_mask) == ""  # ... out of the loss
    assert turn_text(k + 1, sample.response_mask).startswith(action_text(fix))  # the correction is learned
    assert episode.messages[2 + 2 * k + 1].content == demo.reply  # the env's real error is in the context


def test_explore_preset_gets_its_own_recovering_models(tmp_path, monkeypatch):
    import agentopd.bootstrap as b

    monkeypatch.setenv("AGENTOPD_HOME", str(tmp_path))
    seen = {}
    real_sft = b.sft
    monkeypatch.setattr(b, "sft", lambda model, samples, plan, **kw: seen.setdefault(kw["name"], samples) and real_sft(model, samples, plan, **kw))
    spec = replace(TINY_SPEC, mistakes=0.5, demonstrations=32, eval_tasks=4)
    models = bootstrap("sql_db", spec=spec, home=tmp_path, env_kwargs={"difficulty": ["explore"], "max_turns": 8})
    assert models.teacher_dir == tmp_path / "models" / "sql_db_explore" / "teacher"
    report = json.loads((models.teacher_dir.parent / "report.json").read_text())
    assert report["env_kwargs"]["difficulty"] == ["explore"] and report["spec"]["mistakes"] == 0.5
    assert 0.0 <= report["teacher"]["recovery_success"] <= 1.0 and "recovery_success" in report["student"]
    assert set(report["teacher"]["recovery_by_kind"]) <= set(MistakeKind)
    assert 8 <= report["demonstrations_with_mistake"] <= 24  # about half of the teacher's 32; the student's are clean

    def with_masked_turn(samples) -> int:
        return sum(bool(set(x.turn_index) - {k for k, m in zip(x.turn_index, x.response_mask, strict=True) if m}) for x in samples)

    assert with_masked_turn(seen["teacher"]) == report["demonstrations_with_mistake"] and with_masked_turn(seen["student"]) == 0
    assert not (tmp_path / "models" / "sql_db").exists()  # the classic preset's models are another cache
    stamp = (models.teacher_dir / "model.safetensors").stat().st_mtime_ns
    again = bootstrap("sql_db_explore", spec=spec, home=tmp_path)  # the preset's name (agentopd bootstrap --env ...): cached
    assert again.teacher_dir == models.teacher_dir and (models.teacher_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_recovery_eval_plays_the_mistake_then_the_model(home, tok):
    """The episode starts with the oracle's turns up to an injected mistake; what follows is the engine's:
    an engine that continues as the oracle recovers every time, one that gives up never does."""
    cases = recovery_cases("sql_db", EXPLORE, split="eval", num_tasks=12)
    assert len(cases) == 12
    fixer, quitter = ScriptedEngine(tok), ScriptedEngine(tok)
    for spec, demo in cases:
        (k,) = demo.mistake_turns
        fixer.script(spec.episode_id, demo.actions[k + 1 :])
        quitter.script(spec.episode_id, [{"role": "assistant", "content": "I do not know", "tool_calls": []}])
    good = recovery_eval(None, tok, "sql_db", env_kwargs=EXPLORE, num_tasks=12, engine=fixer)
    assert good.success_rate == 1.0 and good.eval.num_tasks == 12 and good.eval.split == "eval+mistake"
    assert set(good.by_kind) <= set(MistakeKind) and all(v == 1.0 for v in good.by_kind.values())
    for episode, (_, demo) in zip(good.eval.episodes, cases, strict=True):
        (k,) = demo.mistake_turns
        assert episode.messages[2 + 2 * k + 1].content == demo.reply and episode.num_turns == len(demo.actions)
    bad = recovery_eval(None, tok, "sql_db", env_kwargs=EXPLORE, num_tasks=12, engine=quitter)
    assert bad.success_rate == 0.0 and all(v == 0.0 for v in bad.by_kind.values())
