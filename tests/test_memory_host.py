"""The host-memory plan of CPU runs (agentopd.memory_host): the terms add up as documented, the micro-batch is
halved until the train phase fits, and a run that cannot fit is refused with one line naming the phase and the
shortfall. Shapes of the real Qwen2.5-Coder-0.5B/1.5B configs (no weights needed)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from agentopd.memory_host import (
    HEADROOM,
    MIN_ENGINE_BATCH,
    MIN_TEACHER_HEAD_CHUNK,
    MIN_TEACHER_TOKENS,
    TEACHER_HEAD_CHUNK,
    TEACHER_TOKENS,
    HostMemoryError,
    HostPhase,
    HostRun,
    available_host_gib,
    plan_host,
)
from agentopd.memory_plan import ModelShape

QWEN = dict(heads=14, kv_heads=2, head_dim=64, vocab=151_936, tied=False)
S05 = ModelShape(layers=24, hidden=896, intermediate=4864, **QWEN)
S135 = ModelShape(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49_152, tied=True)
T15 = ModelShape(layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2, head_dim=128, vocab=151_936, tied=False)


def test_the_micro_batch_shrinks_until_the_train_phase_fits():
    run = HostRun(micro_batch_tokens=8192, chunk_size=1024, activation_checkpointing=False, engine_max_batch=64)
    roomy = plan_host(run, S05, 2, [(T15, 2)], available_gib=200.0)
    assert roomy.micro_batch_tokens == 8192 and roomy.fits and not roomy.notes
    tight = plan_host(run, S05, 2, [(T15, 2)], available_gib=23.0)
    assert tight.fits and tight.micro_batch_tokens < 8192 and "trainer.micro_batch_tokens 8192 ->" in tight.notes[0]
    assert tight.peak(HostPhase.TRAIN) <= HEADROOM * 23.0
    # twice that size does not fit: planned from it, the micro-batch is halved again
    assert plan_host(HostRun(tight.micro_batch_tokens * 2, 1024, False, 64), S05, 2, [(T15, 2)], 23.0).micro_batch_tokens == tight.micro_batch_tokens
    # activation checkpointing keeps a larger micro-batch within the same memory
    ckpt = plan_host(HostRun(8192, 1024, True, 64), S05, 2, [(T15, 2)], available_gib=23.0)
    assert ckpt.fits and ckpt.micro_batch_tokens > tight.micro_batch_tokens


def test_the_terms_are_the_documented_ones():
    plan = plan_host(HostRun(1024, 1024, False, 8), S05, 2, [(T15, 2)], available_gib=1e3)
    gib = {i.what.split(" (")[0]: i.gib for i in plan.items}
    assert gib["fp32 weights + AdamW moments"] == pytest.approx(12 * S05.params / 2**30)
    assert gib["fp32 gradients"] == pytest.approx(4 * S05.params / 2**30)
    assert gib["scorer: weights"] == pytest.approx(2 * T15.params / 2**30)
    # bf16 teacher and engine: half of what fp32 copies would hold
    fp32 = plan_host(HostRun(1024, 1024, False, 8), S05, 4, [(T15, 4)], available_gib=1e3)
    assert fp32.peak(HostPhase.ROLLOUT) - plan.peak(HostPhase.ROLLOUT) == pytest.approx(2 * (S05.params + T15.params) / 2**30, rel=0.05)


def test_a_run_that_cannot_fit_is_refused_naming_phase_and_shortfall():
    plan = plan_host(HostRun(8192, 1024, False, 64), S05, 2, [(T15, 2)], available_gib=8.0)
    assert not plan.fits and plan.micro_batch_tokens == 512  # the smallest micro-batch: the rest does not fit anyway
    # every lever pulled (checkpointing, the teacher's passes, the engines' batch): the refusal names what is left, not
    # a key the plan already set (it said "change trainer.activation_checkpointing=true" with checkpointing on)
    assert plan.activation_checkpointing and plan.engine_max_batch == MIN_ENGINE_BATCH
    with pytest.raises(HostMemoryError, match=r"the train phase needs [\d.]+ GiB, 90% of the 8.0 GiB available is 7.2 \(short by "
                                              r"[\d.]+\), with trainer.micro_batch_tokens=512; change rollout.max_context") as refused:
        plan.check()
    assert "activation_checkpointing=true" not in str(refused.value).splitlines()[0]
    assert "trainer.activation_checkpointing=true" in HostMemoryError.left(replace(plan, activation_checkpointing=False), HostPhase.TRAIN)
    # the teacher's eval engine before training (eval.teacher): its own phase, and the refusal names the key
    evals = plan_host(HostRun(8192, 1024, False, 64, teacher_eval=True), S05, 2, [(T15, 2)], available_gib=20.0)
    assert evals.worst == HostPhase.EVAL and not evals.fits and evals.engine_max_batch == MIN_ENGINE_BATCH
    with pytest.raises(HostMemoryError, match="the eval phase needs .* change eval.teacher=false"):
        evals.check()
    plain = plan_host(HostRun(8192, 1024, False, 64), S05, 2, [(T15, 2)], available_gib=20.0)
    assert plain.fits and plain.engine_max_batch == 16  # halved from the 64 configured until it fit
    assert any(n.startswith("engine.max_batch_size 64 -> 16: ") for n in plain.notes)
    assert plan_host(HostRun(8192, 1024, False, 64), S05, 2, [(T15, 2)], available_gib=23.0).engine_max_batch is None
    assert available_host_gib() > 0


def test_a_cpu_run_prints_its_plan_and_one_that_cannot_fit_is_refused_in_seconds(tiny_home, tmp_path, monkeypatch):
    """`agentopd run` on a CPU: the plan's line at start; with run.host_memory_gib below what the models need, exit 2
    with one line naming the phase and the shortfall, before any model loads, and no run folder left."""
    import time

    from typer.testing import CliRunner

    from agentopd.cli import app

    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))
    monkeypatch.setenv("COLUMNS", "250")
    runner = CliRunner()
    t0 = time.perf_counter()
    result = runner.invoke(app, ["run", "--env", "sql_db", "--run-dir", str(tmp_path / "r"), "run.host_memory_gib=0.5"])
    assert result.exit_code == 2, result.output
    assert "this run does not fit this machine's memory" in result.output and "short by" in result.output
    assert not (tmp_path / "r").exists() and time.perf_counter() - t0 < 60
    ok = runner.invoke(app, ["run", "--env", "sql_db", "--run-dir", str(tmp_path / "ok"), "steps=1", "eval.every=0",
                             "eval.num_tasks=2", "rollout.tasks_per_step=2", "run.checkpoint_every=0",
                             "teacher.selftest_oracle=false"])  # fmt: skip  # the tiny_home teachers are random (conftest)
    assert ok.exit_code == 0, ok.output
    assert "memory (CPU): peak" in ok.output and "GiB available" in ok.output
    # each phase's measured resident peak beside the plan's figure (agentopd.step.phases): a real measurement of this
    # process, so at least the Python/torch runtime the plan counts, and within the plan where the plan has a figure
    import json

    rows = [json.loads(line) for line in (tmp_path / "ok" / "metrics.jsonl").read_text().splitlines()]
    mem = {k: v for row in rows for k, v in row.items() if k.startswith("mem/") and k.endswith("_host_peak_gib")}
    assert {"mem/rollout_host_peak_gib", "mem/teacher_host_peak_gib", "mem/train_host_peak_gib"} <= set(mem), sorted(mem)
    plans = {k: v for row in rows for k, v in row.items() if k.endswith("_host_plan_gib")}
    for phase in ("rollout", "teacher", "train"):
        assert 0.2 < mem[f"mem/{phase}_host_peak_gib"] <= plans[f"mem/{phase}_host_plan_gib"], (phase, mem, plans)


def test_a_phase_measures_its_own_resident_peak_not_the_one_before():
    """reset_resident_peak() makes VmHWM this process's current size: a 400 MB buffer freed before a phase does not
    count in the phase's peak, one allocated inside it does."""
    from agentopd.step.phases import reset_resident_peak, resident_peak_gib

    big = bytearray(400 * 2**20)
    del big
    reset_resident_peak()
    before = resident_peak_gib()
    inside = bytearray(400 * 2**20)
    assert resident_peak_gib() - before > 0.35
    del inside
    reset_resident_peak()
    assert resident_peak_gib() - before < 0.1


def test_the_selftests_student_scorer_is_counted_in_the_score_phase_alone():
    """teacher.selftest's pre-flight loads the student a second time (agentopd.step.selftest), after the teachers scored
    its probe, and drops it: the plan counts its weights (and its scoring work beyond the teachers') in the score phase,
    nowhere else, and only where the self-test runs (agentopd.objectives.runs_selftest)."""
    from dataclasses import replace

    from agentopd.config import load_config
    from agentopd.objectives import runs_selftest

    def on_score(run):
        return plan_host(replace(run, selftest=True), S135, 2, [(T15, 2)], 1e3).peak(HostPhase.SCORE)

    run = HostRun(1024, 1024, False, 8, teacher_eval=True)
    off = plan_host(run, S05, 2, [(T15, 2)], available_gib=1e3)
    on = plan_host(replace(run, selftest=True), S05, 2, [(T15, 2)], available_gib=1e3)
    # a 0.5B student scores with less work than its 1.5B teacher: its weights alone add
    assert on.peak(HostPhase.SCORE) - off.peak(HostPhase.SCORE) == pytest.approx(2 * S05.params / 2**30)
    assert all(on.peak(p) == off.peak(p) for p in HostPhase if p != HostPhase.SCORE)
    # a student larger than its teacher: its work beyond the teacher's adds too; with a server teacher, all of it
    big = plan_host(replace(run, selftest=True), T15, 4, [(S05, 4)], available_gib=1e3)
    (scorer,) = [i for i in big.items if i.role == "selftest"]
    assert 4 * T15.params / 2**30 < scorer.gib < plan_host(replace(run, selftest=True), T15, 4, [], 1e3).items[-1].gib
    # at a memory between the two plans' score phase, the run fits only without the self-test
    # (a SmolLM2-135M-shaped student with the 1.5B teacher and a small train phase: the score phase is the peak)
    lean = HostRun(512, 128, True, 1, teacher_tokens=MIN_TEACHER_TOKENS, teacher_head_chunk=MIN_TEACHER_HEAD_CHUNK)  # no lever left
    tight = (plan_host(lean, S135, 2, [(T15, 2)], 1e3).peak(HostPhase.SCORE) + on_score(lean)) / 2 / HEADROOM
    assert plan_host(lean, S135, 2, [(T15, 2)], tight).fits
    with pytest.raises(HostMemoryError, match="the score phase needs"):
        plan_host(replace(lean, selftest=True), S135, 2, [(T15, 2)], tight).check()
    assert runs_selftest(load_config("sql_db"))
    for off_keys in (["teacher.selftest=false"], ["run.objective=sft"], ["run.objective=grpo", "rollout.n=4"]):
        assert not runs_selftest(load_config("sql_db", overrides=off_keys)), off_keys


def test_freed_activations_go_back_to_the_kernel_after_release(tmp_path):
    """release_freed_memory() (glibc's malloc_trim): two forward and backward passes of a tiny random Llama on a CPU
    leave ~0.2 GiB resident after every tensor is freed (glibc keeps it in its arenas, as it kept a real run's
    activations); the call returns it. In a fresh process, so nothing of the test session's heap counts."""
    import subprocess
    import sys

    probe = tmp_path / "probe.py"
    probe.write_text(
        "import gc, re, torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from agentopd.heap import release_freed_memory\n"
        "def rss():\n"
        "    return int(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) / 2**20\n"
        "torch.manual_seed(0)\n"
        "m = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,\n"
        "                                 num_attention_heads=4, num_key_value_heads=4, vocab_size=8000))\n"
        "ids = torch.randint(0, 8000, (1, 1024))\n"
        "for step in range(2):\n"
        "    m(input_ids=ids).logits.mean().backward(); m.zero_grad(set_to_none=True); gc.collect()\n"
        "before = rss(); release_freed_memory(); print(before, rss())\n"
    )
    done = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    before, after = map(float, done.stdout.split())
    assert before - after > 0.1, (before, after)


def test_a_teacher_that_plays_is_counted_with_its_engine_and_one_that_only_plays_loads_no_scorer():
    """The play engine of a teacher that plays training episodes (backends.stages.Players) was not in the plan: a
    0.5B<-1.5B SFT run peaked at 20.7 GB where the plan said 18.9 GiB (benchmarks/results/real_pair.md), beside a
    scorer that pure SFT never used (it is not loaded now: backends.stages.Scorers)."""
    def plan(**kw):
        return plan_host(HostRun(1024, 1024, True, 8, **kw), S05, 2, [(T15, 2)], available_gib=1e3)

    def teacher_gib(p):
        return {i.what.split(" (")[0].split(":")[0]: i.gib for i in p.items if i.role == "teacher"}

    opd, alone, before, beside = plan(), plan(teacher_scores=False, teacher_plays="alone"), plan(teacher_plays="before"), plan(teacher_plays="beside")
    weights = 2 * T15.params / 2**30
    assert "play engine" not in teacher_gib(opd) and teacher_gib(opd)["scorer"] == pytest.approx(weights)
    assert set(teacher_gib(alone)) == {"play engine"} and teacher_gib(alone)["play engine"] > weights  # + its KV pool
    engine = teacher_gib(alone)["play engine"]
    # SFT steps first: the engine closes before the scorer loads, so the plan holds the larger of the two
    assert teacher_gib(before)["play engine, SFT steps"] == pytest.approx(engine - weights)
    assert plan(teacher_plays="before").peak(HostPhase.ROLLOUT) == pytest.approx(opd.peak(HostPhase.ROLLOUT) + engine - weights)
    assert beside.peak(HostPhase.ROLLOUT) == pytest.approx(opd.peak(HostPhase.ROLLOUT) + engine)
    assert alone.peak(HostPhase.SCORE) < opd.peak(HostPhase.SCORE)


def test_a_teacher_whose_engines_share_its_scorers_weights_adds_their_kv_pools_only():
    """On a CPU a teacher that plays and scores holds one copy of its weights (backends.teacher_weights): the mixed
    recipe's 0.5B<-1.5B plan fell from 21.9 GiB (two copies of the 1.5B, levers pulled) to 19.5."""
    def plan(**kw):
        return plan_host(HostRun(1024, 1024, True, 8, **kw), S05, 2, [(T15, 2)], available_gib=1e3)

    weights = 2 * T15.params / 2**30
    kv_only = plan(teacher_plays="before").peak(HostPhase.ROLLOUT)  # the scorer + the play engine beyond it
    for plays in ("beside", "before"):
        two, one = plan(teacher_plays=plays), plan(teacher_plays=plays, teacher_shares=True)
        assert one.peak(HostPhase.ROLLOUT) == pytest.approx(kv_only)
        assert two.peak(HostPhase.ROLLOUT) - one.peak(HostPhase.ROLLOUT) == pytest.approx(weights if plays == "beside" else 0)
    evals, shared = plan(teacher_eval=True), plan(teacher_eval=True, teacher_shares=True)
    assert evals.peak(HostPhase.EVAL) - shared.peak(HostPhase.EVAL) == pytest.approx(weights)
    # a teacher that only plays (pure SFT) has no scorer to share with: its engine holds its own
    assert plan(teacher_scores=False, teacher_plays="alone", teacher_shares=True).peak(HostPhase.ROLLOUT) == pytest.approx(
        plan(teacher_scores=False, teacher_plays="alone").peak(HostPhase.ROLLOUT))


@pytest.mark.parametrize(("overrides", "plays", "scores"), [
    ((), "", True),
    (("run.objective=sft",), "alone", False),
    (("recipe.sft_steps=3",), "before", True),
    (("recipe.auto_warm_start=true",), "before", True),
    (("recipe.teacher_fraction=0.5",), "beside", True),
    (("run.objective=grpo", "rollout.n=4"), "", False),
])
def test_the_run_config_says_how_its_teachers_play(overrides, plays, scores):
    from agentopd.config import load_config
    from agentopd.memory_host import host_run
    from agentopd.objectives import teacher_plays

    cfg = load_config("calculator", overrides=list(overrides))
    assert teacher_plays(cfg) == plays and host_run(cfg).teacher_scores is scores
    assert host_run(cfg).teacher_shares is scores  # on a CPU a scorer's weights serve its engines


@pytest.mark.parametrize(("overrides", "evals"), [
    ((), True),
    (("eval.teacher=false",), False),
    (("trainer.loss=xtok_k1",), False),  # a teacher of another tokenizer cannot play in the student's ids: skipped
    (("run.objective=grpo", "rollout.n=4"), True),  # the teacher's success is the run's reference: GRPO plays it too
])
def test_the_teachers_eval_is_one_rule_for_the_runner_and_both_plans(overrides, evals):
    """objectives.teacher_evals: the runner plays the teacher's evals where it says, and the host and GPU plans count
    its eval engine there (the host plan skipped it under GRPO, where the runner plays it)."""
    from agentopd.config import load_config
    from agentopd.memory_host import host_run
    from agentopd.memory_plan import plan_memory
    from agentopd.objectives import teacher_evals

    cfg = load_config("calculator", overrides=list(overrides))
    assert teacher_evals(cfg) is evals and host_run(cfg).teacher_eval is evals
    shapes = {"student": S05, "teacher": T15}
    gpu = plan_memory(cfg, shapes, [80.0])
    assert any("teacher's engine" in i.what for i in gpu.items) is evals


def test_where_the_micro_batch_is_not_enough_checkpointing_then_smaller_teacher_passes_make_it_fit():
    """Issue 49's small pair (SmolLM2-135M student, Qwen2.5-Coder-0.5B teacher) on an 8 GiB machine: the defaults do
    not fit; the plan turns activation checkpointing on, then halves the teacher's scoring sizes, and says so."""
    run = HostRun(micro_batch_tokens=8192, chunk_size=1024, activation_checkpointing=False, engine_max_batch=8)
    roomy = plan_host(run, S135, 2, [(S05, 2)], available_gib=22.0)
    assert roomy.fits and not roomy.activation_checkpointing and roomy.teacher_tokens == TEACHER_TOKENS
    assert not any("activation_checkpointing" in n or "teacher scoring" in n for n in roomy.notes)
    small = plan_host(run, S135, 2, [(S05, 2)], available_gib=8.0)
    assert small.fits and small.activation_checkpointing
    assert small.teacher_tokens < TEACHER_TOKENS and small.teacher_head_chunk < TEACHER_HEAD_CHUNK
    assert any(n.startswith("trainer.activation_checkpointing false -> true") for n in small.notes)
    assert any(n.startswith(f"teacher scoring {TEACHER_TOKENS} tokens / head chunks of {TEACHER_HEAD_CHUNK} rows ->") for n in small.notes)
    # each lever only where its phase does not fit: with a little more memory only the score phase is short
    score_only = plan_host(replace(run, micro_batch_tokens=1024), S135, 2, [(S05, 2)], available_gib=9.0)
    assert score_only.fits and not score_only.activation_checkpointing and score_only.teacher_head_chunk < TEACHER_HEAD_CHUNK
    # nothing left to lower: refused, the plan showing what it tried
    with pytest.raises(HostMemoryError) as refused:
        plan_host(run, S135, 2, [(S05, 2)], available_gib=6.0).check()
    assert "activation_checkpointing false -> true" in str(refused.value) and f"-> {MIN_TEACHER_TOKENS} / {MIN_TEACHER_HEAD_CHUNK}" in str(refused.value)


def test_a_run_takes_what_its_host_plan_chose(tmp_path):
    """run_parts.fit_host and run_context: the trainer gets the plan's micro-batch and activation checkpointing, the
    teachers its scoring sizes (model folders with the real configs' shapes, config.json only: no weights needed)."""
    from transformers import LlamaConfig, Qwen2Config

    from agentopd.config import load_config
    from agentopd.run_models import RunModels
    from agentopd.run_parts import fit_host, run_context
    from agentopd.policy import rollout_config, trainer_config

    student, teacher = tmp_path / "smollm2", tmp_path / "qwen05"
    LlamaConfig(vocab_size=49_152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                num_key_value_heads=3, tie_word_embeddings=True, dtype="bfloat16").save_pretrained(student)
    Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, tie_word_embeddings=False, dtype="bfloat16").save_pretrained(teacher)
    models = RunModels(student, {"teacher": teacher})
    for gib, lowered in ((40.0, False), (8.0, True)):
        cfg = load_config("math", overrides=[f"run.host_memory_gib={gib}", "trainer.loss=xtok_k1", "rollout.tasks_per_step=4",
                                             "eval.num_tasks=8", "engine.max_batch_size=8"])
        trainer_cfg, line, plan = fit_host(cfg, models, trainer_config(cfg))
        assert trainer_cfg.activation_checkpointing is lowered and trainer_cfg.micro_batch_tokens == plan.micro_batch_tokens
        ctx = run_context(cfg, None, models, trainer_cfg, rollout_config(cfg), torch.device("cpu"), torch.float32,
                          [0] * 49_152, None, host_plan=plan)
        assert (ctx.teacher_tokens < TEACHER_TOKENS) is lowered and (ctx.teacher_head_chunk < TEACHER_HEAD_CHUNK) is lowered
        assert ("activation_checkpointing false -> true" in line) is lowered
        assert ctx.engine_max_batch is None  # 8 episodes at once fit
    # issue 49's 8 GiB run as it was launched (16 episodes in flight, engine.max_batch_size 64): refused at 7.4 GiB until
    # the engines' batch became a lever; the engines take the plan's
    cfg = load_config("math", overrides=["run.host_memory_gib=8", "trainer.loss=xtok_k1", "rollout.tasks_per_step=4",
                                         "eval.num_tasks=4"])
    trainer_cfg, line, plan = fit_host(cfg, models, trainer_config(cfg))
    assert plan.fits and plan.engine_max_batch == 8 and "engine.max_batch_size 64 -> 8" in line
    ctx = run_context(cfg, None, models, trainer_cfg, rollout_config(cfg), torch.device("cpu"), torch.float32,
                      [0] * 49_152, None, host_plan=plan)
    assert ctx.engine_max_batch == 8


def test_a_teachers_play_engine_holds_a_steps_episodes_not_an_evals():
    """The teacher's play engine plays training episodes only (a step's tasks x n); the student's engine also plays
    the evals: their KV pools are sized apart (issue 51's SFT arm: 4 tasks a step, 100-task evals)."""
    def engine_gib(**kw):
        run = HostRun(1024, 1024, True, 32, in_flight=100, context=2048, teacher_scores=False, teacher_plays="alone", **kw)
        items = plan_host(run, S05, 2, [(T15, 2)], available_gib=1e3).items
        return {i.role: i.gib for i in items if "KV pool" in i.what}

    step_of_4, unknown = engine_gib(train_in_flight=4), engine_gib()
    per_token = 2 * T15.layers * T15.kv * 2 / 2**30
    assert step_of_4["teacher"] == pytest.approx(unknown["teacher"] - (32 - 4) * 2048 * per_token)
    assert step_of_4["engine"] == unknown["engine"]  # the student's: the evals' 100 episodes, 32 at once


def test_the_engines_take_the_plans_batch(tiny_home):
    """RunContext.engine_max_batch (the host plan's engine.max_batch_size, where it lowered it) is what build_engine
    gives the engine; without it, the config's."""
    import asyncio
    import dataclasses

    from transformers import AutoTokenizer

    from agentopd.backends.stages import build_engine
    from agentopd.config import load_config
    from agentopd.policy import rollout_config, trainer_config
    from agentopd.run_models import RunModels
    from agentopd.run_parts import run_context

    student = tiny_home / "models" / "sql_db" / "student"
    cfg = load_config("sql_db", overrides=["engine.max_batch_size=12"])
    base = run_context(cfg, None, RunModels(student, {}), trainer_config(cfg), rollout_config(cfg), torch.device("cpu"),
                       torch.float32, AutoTokenizer.from_pretrained(student), None)
    for ctx, want in ((base, 12), (dataclasses.replace(base, engine_max_batch=3), 3)):
        engine = build_engine(ctx, student)
        try:
            assert engine.max_batch_size == want
        finally:
            asyncio.run(engine.close())


def test_a_teacher_scoring_beside_the_rollout_is_counted_in_the_rollout_phase():
    """teacher.overlap on a CPU: the teacher's scoring work and the hidden rows it hands the loss exist while the
    rollout plays (0.5B <- 1.5B: the rollout phase grows by both; the score and train phases stay)."""
    run = HostRun(1024, 1024, True, 32, in_flight=64, context=2048, teacher_scores=True)
    plain = plan_host(run, S05, 2, [(T15, 2)], available_gib=1e3)
    beside = plan_host(replace(run, teacher_overlap=True), S05, 2, [(T15, 2)], available_gib=1e3)
    grown = sum(i.gib for i in plain.items if i.role == "teacher" and ("scoring work" in i.what or "hidden rows" in i.what))
    assert grown > 0
    assert beside.peak(HostPhase.ROLLOUT) == pytest.approx(plain.peak(HostPhase.ROLLOUT) + grown)
    for phase in (HostPhase.SCORE, HostPhase.TRAIN):
        assert beside.peak(phase) == pytest.approx(plain.peak(phase))
    from agentopd.config import load_config
    from agentopd.memory_host import host_run

    assert host_run(load_config("sql_db", overrides=["teacher.overlap=true"])).teacher_overlap
