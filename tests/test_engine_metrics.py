"""The fast engine's worker timings as a step's `rollout/engine_*` metrics (backends.stages.engine_metrics): where a
rollout's time went (the device's steps or the host's scheduling and bookkeeping) and how full its decode batch
stayed — what a user reads before a profiler (issue 52: the real-size rollout ran at 40% of its bandwidth limit)."""

import json

import pytest

from agentopd.backends.stages import engine_metrics


def test_a_rollouts_share_of_the_timings():
    before = {"schedule": 1.0, "prepare": 2.0, "step": 10.0, "advance": 0.5, "steps": 100, "decode_steps": 90, "decode_rows": 900,
              "preemptions": 3}
    after = {"schedule": 1.5, "prepare": 2.5, "step": 14.0, "advance": 0.75, "steps": 150, "decode_steps": 130, "decode_rows": 2100,
             "preemptions": 7}
    m = engine_metrics(before, after)
    assert m == pytest.approx({"rollout/engine_schedule_s": 0.5, "rollout/engine_prepare_s": 0.5, "rollout/engine_step_s": 4.0,
                               "rollout/engine_advance_s": 0.25, "rollout/engine_steps": 50.0,
                               "rollout/engine_decode_steps": 40.0, "rollout/engine_rows_per_decode": 30.0,
                               "rollout/engine_preemptions": 4.0})
    assert engine_metrics({}, {}) == {}  # an engine without timings (transformers, vLLM)
    shared = engine_metrics({**before, "shared_prompt_rows": 100}, {**after, "shared_prompt_rows": 400})
    assert shared["rollout/engine_shared_prompt_share"] == pytest.approx(300 / 1200)  # of the rollout's decode rows
    assert "rollout/engine_rows_per_decode" not in engine_metrics(before, before)  # no decode step: no mean


def test_a_run_logs_its_engines_timings(cli, tmp_path):
    run = tmp_path / "run"
    result = cli("run", "--env", "calculator", "--run-dir", run, "steps=2", "rollout.tasks_per_step=4", "rollout.n=2",
                 "rollout.max_new_tokens=24", "rollout.max_turns=2", "eval.num_tasks=2", "eval.every=0", "eval.teacher=false",
                 "run.checkpoint_every=0", "engine.kind=fast", "teacher.selftest_oracle=false")  # fmt: skip
    assert result.exit_code == 0, result.output
    records = [r for line in (run / "metrics.jsonl").read_text().splitlines() if "loss" in (r := json.loads(line))]
    assert len(records) == 2
    for r in records:
        assert r["rollout/engine_step_s"] > 0 and r["rollout/engine_decode_steps"] >= 1
        assert 1 <= r["rollout/engine_rows_per_decode"] <= 8  # at most the step's 4 x 2 episodes at once
        assert r["rollout/engine_steps"] >= r["rollout/engine_decode_steps"]
