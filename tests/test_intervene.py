"""Turn-level teacher intervention (recipe.intervene_below, agentopd.recipes.intervene) on tiny real models.

The student is the tiny built-in calculator student on the real HFEngine; the teacher scores with the
tiny built-in teacher (HFTeacher) and, where it takes over, plays the env's oracle turns (a scripted
engine), so a replaced turn is a valid tool call the env executes and the episode visibly goes on from it.
"""

import json
import sqlite3

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from agentopd import make_env
from agentopd.cli import app
from agentopd.config import load_config
from agentopd.engines.hf import HFEngine
from agentopd.engines.scripted import ScriptedEngine
from agentopd.recipes.intervene import TurnGuide, intervene_metrics, probability
from agentopd.rollout import INTERVENED, INTERVENED_TOKENS, Rollout, RolloutConfig
from agentopd.teacher import HFTeacher
from agentopd.types import Episode, Message, StopReason, Turn

CONFIG = RolloutConfig(max_turns=5, max_new_tokens=96, max_context=1024)
ALWAYS = -1e-4  # the tiny teacher gives the tiny student's tokens about -7 per token: fires on every turn
NEVER = -1e9


class OracleTeacherEngine(ScriptedEngine):
    """The teacher's engine: the env's oracle turns for each episode (its requests are `<episode id>/teacher`),
    every request and result recorded. It keeps an episode's script across the guide's per-turn release."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.calls = []

    async def generate(self, request):
        result = await super().generate(request)
        self.calls.append((request, result))
        return result

    def release(self, episode_id):
        pass


class Recorded:
    """An engine whose requests and results are kept (the student's, to compare branches with)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    async def generate(self, request):
        result = await self.engine.generate(request)
        self.calls.append((request, result))
        return result

    def release(self, episode_id):
        self.engine.release(episode_id)


@pytest.fixture(scope="module")
def models(tiny_home):
    root = tiny_home / "models" / "calculator"
    tok = AutoTokenizer.from_pretrained(root / "student")
    student = HFEngine(AutoModelForCausalLM.from_pretrained(root / "student"), device="cpu", seed=0)
    teacher = HFTeacher(root / "teacher", device="cpu")
    return tok, student, teacher


def play(models, guide, *, step=1, tasks=4, engine=None, teacher_engine=None):
    """Training episodes of the first `tasks` calculator tasks at `step` (the teacher engine scripted with their oracles)."""
    tok, student, _ = models
    env = make_env("calculator")
    specs = Rollout.specs_for([t.id for t in env.tasks[:tasks]], n=1, step=step, seed=0)
    if teacher_engine is not None:
        for spec in specs:
            teacher_engine.script(f"{spec.episode_id}/teacher", env.oracle(env.tasks[env._by_id[spec.task_id]]))
    rollout = Rollout(lambda: make_env("calculator"), engine or student, tok, CONFIG, guide=guide)
    try:
        return rollout.run_sync(specs)
    finally:
        rollout.close()


def assert_same_streams(a, b):
    """Episodes token for token; sampler logprobs to 1e-5 (the engine's batch composition moves their last bits)."""
    for x, y in zip(a, b, strict=True):
        s, t = x.tokens, y.tokens
        assert (s.token_ids, s.prompt_len, s.response_mask, s.turn_index) == (t.token_ids, t.prompt_len, t.response_mask, t.turn_index)
        assert s.logprobs == pytest.approx(t.logprobs, abs=1e-5)


def test_a_firing_guide_replaces_every_turn_and_keeps_the_students_as_branches(models):
    tok, student, teacher = models
    oracle, recorded = OracleTeacherEngine(tok), Recorded(student)
    episodes = play(models, TurnGuide(teacher, oracle, below=ALWAYS, steps=4), engine=recorded, teacher_engine=oracle)
    students = {tuple(r.token_ids): res for r, res in recorded.calls}
    teachers = {tuple(r.token_ids): res for r, res in oracle.calls}
    assert all(ep.success and ep.stop_reason is StopReason.ANSWER for ep in episodes)  # the oracle's tool calls ran
    assert max(ep.num_turns for ep in episodes) >= 2
    for ep in episodes:
        s = ep.tokens
        assert ep.info[INTERVENED] == list(range(ep.num_turns))
        assert sum(s.response_mask) == 0 and set(s.logprobs) == {0.0}  # no student token left in the main stream
        assert len(ep.branches) == ep.num_turns
        for k, branch in enumerate(ep.branches):
            prefix = branch.token_ids[: branch.prompt_len]
            assert s.token_ids[: branch.prompt_len] == prefix  # the state the student was in
            sampled = students[tuple(prefix)]  # what the student's engine sampled there
            assert branch.response_ids == sampled.token_ids and branch.logprobs == sampled.logprobs
            assert branch.response_mask == [1] * len(sampled.token_ids) and branch.turn_index == [k] * len(sampled.token_ids)
            taken = teachers[tuple(prefix)].token_ids  # what the teacher's engine generated there
            assert taken != sampled.token_ids
            assert s.token_ids[branch.prompt_len : branch.prompt_len + len(taken)] == taken
            assert ep.info[INTERVENED_TOKENS][k] == len(taken)
            assert s.turn_index[branch.prompt_len - s.prompt_len] == k
            assert tok.decode(taken, skip_special_tokens=False) == ep.turns[k].raw_text + "<|im_end|>"


def test_a_guide_that_never_fires_changes_nothing(models):
    tok, _, teacher = models
    oracle = OracleTeacherEngine(tok)
    plain = play(models, None)
    guided = play(models, TurnGuide(teacher, oracle, below=NEVER, steps=4), teacher_engine=oracle)
    assert not oracle.calls
    assert_same_streams(plain, guided)
    for a, b in zip(plain, guided, strict=True):
        assert [t.raw_text for t in a.turns] == [t.raw_text for t in b.turns]
        assert not b.branches and INTERVENED not in b.info


def test_the_probability_decays_to_zero_after_intervene_steps(models):
    assert [probability(s, 4) for s in (1, 2, 3, 4, 5, 9)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    tok, _, teacher = models
    oracle = OracleTeacherEngine(tok)
    guide = TurnGuide(teacher, oracle, below=ALWAYS, steps=4)
    plain = play(models, None, step=5)
    late = play(models, guide, step=5, teacher_engine=oracle)  # p = 0: even an always-firing threshold stays quiet
    assert not oracle.calls
    assert_same_streams(plain, late)


def test_the_draws_follow_p_and_replay_exactly(models):
    tok, _, teacher = models
    spec = Rollout.specs_for(["t"], step=3, seed=0)[0]
    guide = TurnGuide(teacher, OracleTeacherEngine(tok), below=ALWAYS, steps=4)  # p(3) = 0.5
    draws = [guide.may_intervene(s, turn) for s in Rollout.specs_for([str(i) for i in range(400)], step=3) for turn in range(3)]
    assert 0.44 < sum(draws) / len(draws) < 0.56
    assert guide.may_intervene(spec, 1) == guide.may_intervene(spec, 1)

    def intervened():
        oracle = OracleTeacherEngine(tok)
        return play(models, TurnGuide(teacher, oracle, below=ALWAYS, steps=4), step=3, tasks=8, teacher_engine=oracle)

    first, again = intervened(), intervened()
    replaced = [ep.info.get(INTERVENED, []) for ep in first]
    assert replaced == [ep.info.get(INTERVENED, []) for ep in again]  # a resumed run replays the same interventions,
    assert_same_streams(first, again)  # token for token
    assert {0 in turns for turns in replaced} == {True, False}  # at p = 0.5 some episodes' first turn is replaced, some not


def test_metrics_count_replaced_turns_per_turn():
    def ep(turns, replaced):
        e = Episode("calculator", "t", [], [], [Turn(Message("assistant", ""), []) for _ in range(turns)], 0.0, False, StopReason.ANSWER)
        if replaced:
            e.info[INTERVENED] = replaced
        return e

    m = intervene_metrics([ep(3, [0, 2]), ep(1, []), ep(2, [0])], p=0.5)
    assert m == {"intervene/p": 0.5, "intervene/rate": 3 / 6, "intervene/turn_0": 2 / 3, "intervene/turn_1": 0.0, "intervene/turn_2": 1.0}


@pytest.mark.parametrize(
    "overrides, problem",
    [
        (["run.backend=ray"], "run.backend=ray"),
        (["objective=sft"], "objective=sft"),
        (["teacher=http://127.0.0.1:8000", "eval.teacher=false"], "teacher=http://127.0.0.1:8000, a server"),
        (["teachers.a=/models/a", "teachers.b=/models/b"], "2 teachers"),
    ],
)
def test_config_refuses_runs_it_cannot_serve(overrides, problem):
    load_config("calculator", None, ["recipe.intervene_below=-2"])  # the recipe alone is fine
    with pytest.raises(ValueError, match=rf"recipe.intervene_below=-2.0 cannot run with .*{problem}"):
        load_config("calculator", None, ["recipe.intervene_below=-2", *overrides])


def test_a_run_with_intervention_trains_on_branches_and_logs_the_rates(tiny_home, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))
    run = tmp_path / "run"
    args = ["run", "--env", "calculator", "--run-dir", str(run), "steps=2", "rollout.tasks_per_step=2", "rollout.n=2",
            "rollout.max_new_tokens=24", "rollout.max_turns=3", "eval.num_tasks=2", "eval.every=0", "run.checkpoint_every=0",
            "trainer.lr=1e-3", f"recipe.intervene_below={ALWAYS}",
            "teacher.selftest_oracle=false"]  # fmt: skip  # the tiny_home teachers are random (conftest)
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    records = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2]
    first, second = records
    assert first["intervene/p"] == 1.0 and second["intervene/p"] == 0.5  # intervene_steps = run.steps = 2
    assert first["intervene/rate"] == 1.0 and first["intervene/turn_0"] == 1.0  # p = 1 and a threshold that always fires
    assert "train/skipped" not in first  # every main-stream turn is the teacher's: the step trained on the branches
    # the teacher judged every turn (guide scoring) and generated the turns it took over (agentopd.flops)
    assert first["flops/teacher_guide_score"] > 0 and first["flops/teacher_generate"] > 0
    assert first["flops/teacher"] == pytest.approx(first["flops/teacher_score"] + first["flops/teacher_generate"])
    db = sqlite3.connect(run / "trajectories.db")
    infos = [json.loads(i) for (i,) in db.execute("select info from episodes where split='train' and step=1")]
    assert infos and all(i[INTERVENED] for i in infos)
    assert not any(INTERVENED in json.loads(i or "{}") for (i,) in db.execute("select info from episodes where split='eval'"))
    # the teacher's turns are mask 0 but sampled: the drift checker checks them as a sampled span, not as template text
    checked = CliRunner().invoke(app, ["check-tokens", str(run)], catch_exceptions=False)
    assert checked.exit_code == 0, checked.output
