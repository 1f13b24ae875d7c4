"""Recipes beyond plain OPD (config `recipe`): GKD's teacher share, the SFT warm start and per-turn
reliability weights — units on hand-made streams, then short runs through the CLI on tiny models."""

import json
import math
import sqlite3

import pytest

from agentopd.batch import TrainSample, pack
from agentopd.config import load_config
from agentopd.recipes.turn_weights import (
    turn_support,
    turn_weight_metrics,
    turn_weights,
)
from agentopd.types import TokenStream

SHORT = [
    "rollout.tasks_per_step=4", "rollout.n=1", "rollout.max_new_tokens=24", "rollout.max_turns=3",
    "eval.num_tasks=2", "eval.every=0", "eval.teacher=false", "run.checkpoint_every=0", "trainer.lr=1e-3",
    "teacher.selftest_oracle=false",  # the tiny_home teachers are random: no better than the student on the oracle (conftest)
]  # fmt: skip


def _stream():
    # prompt of 2 tokens; turn 0: 2 student tokens, 1 tool token; turn 1: 2 student tokens
    return TokenStream(token_ids=[1, 2, 3, 4, 5, 6, 7], prompt_len=2, response_mask=[1, 1, 0, 1, 1],
                       logprobs=[-0.1] * 5, turn_index=[0, 0, 0, 1, 1])  # fmt: skip


def test_turn_support_and_weights():
    teacher = [math.log(0.9), math.log(0.7), 0.0, math.log(0.1), math.log(0.05)]
    support = turn_support(_stream(), teacher)
    assert support == pytest.approx({0: 0.8, 1: 0.075})
    weights, _ = turn_weights(_stream(), teacher, below=0.3, floor=0.1)
    assert weights == pytest.approx([1.0, 1.0, 1.0, 0.25, 0.25])  # turn 1: 0.075 / 0.3
    weights, _ = turn_weights(_stream(), teacher, below=0.3, floor=0.5)
    assert weights[3:] == pytest.approx([0.5, 0.5])  # the floor
    metrics = turn_weight_metrics([support], below=0.3, floor=0.1)
    assert metrics["turn_weight/downweighted"] == 0.5 and metrics["turn_weight/turn_1"] == pytest.approx(0.25)
    assert metrics["turn_support/turn_0"] == pytest.approx(0.8)
    with pytest.raises(ValueError, match="5 response tokens"):
        turn_weights(_stream(), teacher[:4], below=0.3, floor=0.1)


def test_token_weights_reach_the_loss_rows():
    s = _stream()
    sample = TrainSample.from_stream(s, weight=2.0, token_weights=[1.0, 0.5, 1.0, 0.25, 0.25])
    (mb,) = pack([sample], 64)
    assert mb.weights_N.tolist() == [2.0, 1.0, 0.5, 0.5]  # student tokens only, episode weight x token weight
    with pytest.raises(ValueError, match="token_weights has length 2"):
        TrainSample.from_stream(s, token_weights=[1.0, 1.0])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["recipe.sft_steps=5", "steps=5"], "leaves none of run.steps=5"),
        (["recipe.teacher_fraction=0.5", "objective=grpo"], "recipe.teacher_fraction=0.5 needs objective=opd"),
        (["recipe.teacher_fraction=1.5"], "teacher_fraction"),
        (["recipe.sft_steps=2", "async.enabled=true", "backend=ray"], "rollouts submitted ahead"),
    ],
)
def test_bad_recipes_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config("calculator", overrides=overrides)


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "loss" in line]


def test_teacher_fraction_plays_that_share_with_the_teacher(cli, tmp_path):
    run = tmp_path / "run"
    result = cli("run", "--env", "calculator", "--run-dir", run, "steps=2", "recipe.teacher_fraction=0.5", *SHORT)
    assert result.exit_code == 0, result.output
    records = _records(run)
    assert [r["recipe/teacher_episodes"] for r in records] == [2.0, 2.0]
    assert all(r["teacher/generated_tokens"] > 0 and r["teacher/scored_tokens"] > r["teacher/generated_tokens"] for r in records)
    db = sqlite3.connect(run / "trajectories.db")
    rows = db.execute("select id, info, teacher_logprobs from episodes where split='train' order by id").fetchall()
    by_teacher = [i for i, info, _ in rows if json.loads(info or "{}").get("played_by") == "teacher"]
    assert len(rows) == 8 and len(by_teacher) == 4
    assert all(tlp is not None for *_, tlp in rows)  # the teacher's episodes are scored and trained on too


def test_sft_warm_start_switches_to_opd(cli, tmp_path):
    run = tmp_path / "run"
    result = cli("run", "--env", "calculator", "--run-dir", run, "steps=3", "recipe.sft_steps=2", *SHORT)
    assert result.exit_code == 0, result.output
    records = _records(run)
    assert [("train/distill_loss" in r) for r in records] == [False, False, True]  # cross-entropy, then the KL
    db = sqlite3.connect(run / "trajectories.db")
    scored = db.execute("select step, count(teacher_logprobs), count(*) from episodes where split='train' group by step").fetchall()
    assert scored == [(1, 0, 4), (2, 0, 4), (3, 4, 4)]  # the teacher played the warm start (not scored), then scored the student
    assert [r["teacher/scored_tokens"] > 0 for r in records] == [False, False, True]


@pytest.mark.parametrize(("overrides", "want"), [
    (("run.objective=sft",), []),  # the teacher only plays: no scorer is ever loaded
    # the scorer loads after the SFT steps, on the play engine's weights (backends.teacher_weights): nothing dropped
    (("recipe.sft_steps=2",), ["build teacher on the engine's weights"]),
])
def test_a_teachers_scorer_loads_only_when_something_scores(cli, tmp_path, monkeypatch, overrides, want):
    """A 0.5B<-1.5B SFT run held the 1.5B twice (a scorer it never used beside the play engine) and peaked above its
    host plan (benchmarks/results/real_pair.md): the local backend's scorers load on first use (stages.Scorers)."""
    from agentopd.backends import local, stages

    events = []
    build, drop = local.build_teacher, stages.Players.drop
    monkeypatch.setattr(local, "build_teacher", lambda ctx, name, model=None: events.append(
        f"build {name}" + (" on the engine's weights" if model is not None else "")) or build(ctx, name, model))

    def dropping(self, who):
        if who != stages.STUDENT and who in self.engines:
            events.append(f"drop {who}")
        return drop(self, who)

    monkeypatch.setattr(stages.Players, "drop", dropping)
    result = cli("run", "--env", "calculator", "--run-dir", tmp_path / "run", "steps=3", *overrides, *SHORT)
    assert result.exit_code == 0, result.output
    assert events == want


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_a_teacher_that_plays_and_scores_holds_one_copy_of_its_weights(tiny_home, monkeypatch, tmp_path):
    """recipe.teacher_fraction on a CPU: the teacher's engine runs on its scorer's weights (backends.teacher_weights);
    the 0.5B<-1.5B mixed recipe held the 1.5B twice and its plan did not fit 22 GiB without shrinking everything."""
    from agentopd.runner import Runner

    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))
    runner = Runner(load_config("calculator", overrides=[*SHORT, "steps=1", "recipe.teacher_fraction=0.5"]), tmp_path / "run")
    runner._setup(resume_after=None)
    backend = runner.backend
    try:
        runner._step(1)
        (name,) = backend.teachers
        engine, scorer = backend.players.engines[name], backend.teachers.built()[name]
        assert _storages(engine.runner.params.values()) == _storages(scorer.model.parameters())
        # the student's engine is the trainer's copy, never shared
        student = backend.players.engines["student"]
        assert not _storages(student.runner.params.values()) & _storages(backend.trainer.hf.parameters())
    finally:
        backend.close()


def test_turn_weights_are_logged_and_change_the_loss(cli, tmp_path):
    losses = {}
    for below in (None, 1.0):
        run = tmp_path / f"run{below}"
        extra = [f"recipe.turn_support_below={below}", "recipe.turn_weight_floor=0.0"] if below else []
        result = cli("run", "--env", "calculator", "--run-dir", run, "steps=1", *SHORT, *extra)
        assert result.exit_code == 0, result.output
        (record,) = _records(run)
        losses[below] = record["loss"]
        if below:
            assert 0 < record["turn_weight/mean"] < 1 and record["turn_weight/downweighted"] == 1.0
            assert "turn_support/turn_0" in record
    assert losses[1.0] < losses[None]  # every weight is support / 1.0 < 1: the same episodes, a smaller loss


def test_horizon_steps_from_start_to_end_in_equal_shares():
    from agentopd.recipes.horizon import horizon

    assert [horizon(s, steps=8, start=1, end=4) for s in range(1, 9)] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert [horizon(s, steps=3, start=2, end=2) for s in range(1, 4)] == [2, 2, 2]
    assert horizon(1, steps=1, start=1, end=5) == 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["recipe.horizon_turns=[3,2]"], r"recipe.horizon_turns must be \[start, end\] with 1 <= start <= end"),
        (["recipe.horizon_turns=[0,2]"], "1 <= start"),
        (["recipe.horizon_turns=[1,9]", "rollout.max_turns=4"], "ends past rollout.max_turns=4"),
    ],
)
def test_bad_horizons_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config("calculator", overrides=overrides)


def test_horizon_trains_only_on_turns_below_k(cli, tmp_path, monkeypatch):
    """recipe.horizon_turns=[1,3] over 3 steps: k = 1, 2, 3. The training samples (what the loss masks with) hold
    student tokens of turns < k only, and the episodes stop at k turns; evals play whole episodes."""
    import agentopd.step.train as samples_stage

    seen: list[list] = []
    real = samples_stage.train_samples

    def recording(*args, **kwargs):
        samples = real(*args, **kwargs)
        seen.append(samples)
        return samples

    monkeypatch.setattr(samples_stage, "train_samples", recording)
    run = tmp_path / "run"
    short = [o for o in SHORT if not o.startswith("rollout.max_turns")]
    result = cli("run", "--env", "calculator", "--run-dir", run, "steps=3", "recipe.horizon_turns=[1,3]", "rollout.max_turns=3",
                 "rollout.temperature=1.0", *short)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert [r["horizon/turns"] for r in _records(run)] == [1.0, 2.0, 3.0]
    for k, samples in zip((1, 2, 3), seen, strict=True):
        trained = {t for s in samples for m, t in zip(s.response_mask, s.turn_index) if m}
        assert trained and max(trained) < k
    db = sqlite3.connect(run / "trajectories.db")
    turns = dict(db.execute("select step, max(num_turns) from episodes where split='train' group by step").fetchall())
    assert all(turns[step] <= k for step, k in ((1, 1), (2, 2), (3, 3)))
    assert turns[1] == 1 and turns[2] == 2  # the horizon binds: the student plays on when not cut


def test_a_recipe_plugs_into_the_stages_it_names_alone(tiny_home, tmp_path, monkeypatch):
    """The recipe interface (agentopd.recipes.base): a recipe of the play and report stages, added to a set-up run's
    list, changes how the training episodes play (one token a turn) and adds a metric of its own; no runner method
    knows of it."""
    from dataclasses import replace

    from agentopd.recipes.base import Recipe, Stage
    from agentopd.runner import Runner

    class OneToken(Recipe):
        name = "one_token"
        stages = frozenset({Stage.PLAY, Stage.REPORT})

        def rollout(self, step, config):
            return replace(config, max_new_tokens=1)

        def report(self, played):
            return {"one_token/episodes": float(len(played.episodes))}

    assert Recipe().rollout(1, "config") == "config" and Recipe().report(None) == {} == Recipe().played(None, None)  # the base changes nothing
    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))
    runner = Runner(load_config("calculator", overrides=[*SHORT, "steps=2"]), tmp_path / "run")
    runner._setup(resume_after=None)
    assert [r.name for r in runner.recipes] == ["selftest"]  # no recipe.* key set: the plain chain and the teacher self-test
    try:
        plain = runner._step(1)
        runner.recipes.append(OneToken())  # the list the stages read (StepParts.recipes)
        metrics = runner._step(2)
    finally:
        runner.backend.close()
    assert "one_token/episodes" not in plain and plain["tool_mask/llm_tokens"] > 4 * 3
    assert metrics["one_token/episodes"] == 4.0
    assert metrics["tool_mask/llm_tokens"] <= 4 * 3  # 4 episodes of at most 3 turns of one sampled token
