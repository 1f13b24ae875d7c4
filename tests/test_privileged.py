"""Privileged self-distillation (agentopd.privileged, `teacher.privileged`): the teacher's stream is the privileged
prompt + the student's response, its scores land on the student's tokens; the envs' privileged context; the config's
refusals; short runs on the tiny models (conftest `tiny_home`)."""

import json
import sqlite3

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentopd import make_env
from agentopd.config import load_config
from agentopd.engines.hf import HFEngine
from agentopd.env import Privileged, ToolEnv
from agentopd.flops import ModelShape
from agentopd.plan import Mixture
from agentopd.privileged import HEADER, PrivilegedView, privileged_messages, privileged_stream
from agentopd.rollout import Rollout, RolloutConfig
from agentopd.teacher import HFTeacher

SHORT = [
    "rollout.tasks_per_step=3", "rollout.n=1", "rollout.max_new_tokens=24", "rollout.max_turns=3",
    "eval.num_tasks=2", "eval.every=0", "eval.teacher=false", "run.checkpoint_every=0", "trainer.lr=1e-3",
    "teacher.selftest_oracle=false",  # the tiny_home teachers are random: no better than the student on the oracle (conftest)
]  # fmt: skip


@pytest.fixture(scope="module")
def played(tiny_home):
    """Two calculator training episodes the tiny student played (multi-turn: tool results in their streams)."""
    root = tiny_home / "models" / "calculator"
    tok = AutoTokenizer.from_pretrained(root / "student")
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(root / "student"), device="cpu", seed=0)
    env = make_env("calculator")
    specs = Rollout.specs_for([t.id for t in env.tasks[:2]], n=1, step=1, seed=0)
    rollout = Rollout(lambda: make_env("calculator"), engine, tok, RolloutConfig(max_turns=3, max_new_tokens=32, max_context=1024))
    try:
        episodes = rollout.run_sync(specs)
    finally:
        rollout.close()
    return root, tok, specs, episodes


def test_privileged_stream_keeps_the_students_response(played):
    _, tok, _, episodes = played
    for ep in episodes:
        s = ep.tokens
        p = privileged_stream(tok, ep, "1. calculate(...)\n2. answer: 42")
        assert p.prompt_len > s.prompt_len
        assert p.token_ids[p.prompt_len :] == s.token_ids[s.prompt_len :]
        assert (p.response_mask, p.logprobs, p.turn_index) == (s.response_mask, s.logprobs, s.turn_index)
        assert HEADER in tok.decode(p.token_ids[: p.prompt_len]) and "answer: 42" in tok.decode(p.token_ids[: p.prompt_len])


def test_teacher_logprobs_on_the_students_tokens_equal_a_forward_of_the_privileged_stream(played):
    root, tok, _, episodes = played
    model = AutoModelForCausalLM.from_pretrained(root / "student").eval()  # teacher=self: the student's own weights
    teacher = HFTeacher(root / "student", device="cpu", temperature=1.0)
    streams = [privileged_stream(tok, ep, "the solution is 42") for ep in episodes]
    scores = teacher.score(streams)
    for ep, stream, sc in zip(episodes, streams, scores, strict=True):
        with torch.no_grad():
            logp_TV = model(torch.tensor([stream.token_ids])).logits[0].float().log_softmax(-1)
        assert len(sc.logprobs) == len(ep.tokens.response_mask)  # one per student response token
        for i, (token, mask) in enumerate(zip(ep.tokens.token_ids[ep.tokens.prompt_len :], ep.tokens.response_mask)):
            expected = logp_TV[stream.prompt_len + i - 1, token].item() if mask else 0.0
            assert sc.logprobs[i] == pytest.approx(expected, abs=1e-4)
    # and the context matters: without it the same weights score the same tokens differently
    plain = teacher.score([ep.tokens for ep in episodes])
    assert any(a != pytest.approx(b, abs=1e-4) for x, y in zip(plain, scores) for a, b in zip(x.logprobs, y.logprobs))


def test_privileged_messages_append_to_the_last_user_message():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    out = privileged_messages(messages, "T")
    assert out == [{"role": "system", "content": "S"}, {"role": "user", "content": f"Q\n\n{HEADER}\nT"}]
    assert messages[1]["content"] == "Q"  # not changed in place


@pytest.mark.parametrize(
    "name, kwargs, kind, needle",
    [
        ("sql_db", {}, Privileged.SOLUTION, "sql_query("),
        ("sql_db", {}, Privileged.SCHEMA, "Tables: "),
        ("sql_db", {"difficulty": ["explore"]}, Privileged.SCHEMA, "customers("),
        ("sql_db", {"difficulty": ["explore"]}, Privileged.SOLUTION, "describe_table("),
        ("calculator", {}, Privileged.SOLUTION, "calculate("),
        ("math", {}, Privileged.SOLUTION, "\\boxed"),
    ],
)
def test_envs_give_privileged_context(name, kwargs, kind, needle):
    env = make_env(name, **kwargs).unwrapped
    try:
        text = env.privileged_context(env.tasks[0], kind)
        assert needle in text
        if kind == Privileged.SOLUTION:
            assert env.tasks[0].answer in text  # every solution ends with the answer
    finally:
        env.close()


def test_an_env_without_the_context_is_refused_by_name():
    assert ToolEnv.privileged_context(None, None, Privileged.SOLUTION) is None  # the default: none
    view = PrivilegedView(Mixture.from_config(load_config("calculator")), tokenizer=None, kind="schema")
    with pytest.raises(ValueError, match=r"teacher.privileged=schema: env 'calculator' \(source 'calculator'\) gives no schema"):
        view.check()
    view.close()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["teacher.privileged=answer"], "teacher.privileged"),
        (["teacher.privileged=solution", "objective=sft"], "teacher.privileged=solution cannot run with objective=sft"),
        (["teacher.privileged=solution", "recipe.teacher_fraction=0.5"], "recipe.teacher_fraction"),
        (["teacher.privileged=solution", "trainer.loss=xtok_k1"], "trainer.loss=xtok_k1"),
    ],
)
def test_bad_privileged_configs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config("calculator", overrides=overrides)


@pytest.mark.parametrize("env, kind", [("calculator", "solution"), ("sql_db", "schema")])
def test_a_privileged_self_distillation_run_scores_longer_streams(cli, tmp_path, tiny_home, env, kind):
    run = tmp_path / "run"
    result = cli("run", "--env", env, "--run-dir", run, "steps=2", "teacher=self", f"teacher.privileged={kind}", *SHORT)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert [r["step"] for r in records] == [1, 2] and all("kl/mean" in r for r in records)
    shape = ModelShape.from_ref(tiny_home / "models" / env / "student")  # teacher=self: the student's shape
    db = sqlite3.connect(run / "trajectories.db")
    for r in records:
        rows = db.execute("select token_ids, teacher_logprobs from episodes where split='train' and step=?", (r["step"],)).fetchall()
        assert rows and all(tlp is not None for _, tlp in rows)
        plain = sum(shape.forward(len(json.loads(ids))) for ids, _ in rows)
        assert r["flops/teacher_score"] > plain  # the privileged prompts are longer than the student's
