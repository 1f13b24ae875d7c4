"""benchmarks/quality.py's reading of curves at equal teacher FLOPs, and its reuse of results written before FLOPs
were logged (an interrupted or older sweep under --work)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("quality", Path(__file__).parents[1] / "benchmarks" / "quality.py")
quality = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quality)

CURVE = [{"step": 0, "tokens": 0, "teacher_flops": 0.0, "success": 0.1},
         {"step": 10, "tokens": 100, "teacher_flops": 4.0, "success": 0.3},
         {"step": 20, "tokens": 200, "teacher_flops": 8.0, "success": 0.5}]  # fmt: skip


def test_success_at_a_budget_reads_linearly_between_evals():
    assert quality.success_at(CURVE, "teacher_flops", 0.0) == pytest.approx(0.1)
    assert quality.success_at(CURVE, "teacher_flops", 2.0) == pytest.approx(0.2)
    assert quality.success_at(CURVE, "teacher_flops", 8.0) == pytest.approx(0.5)
    assert quality.success_at(CURVE, "teacher_flops", 9.0) is None  # past the run's last eval
    old = [{k: v for k, v in p.items() if k != "teacher_flops"} for p in CURVE]  # a result from before FLOPs were logged
    assert quality.success_at(old, "teacher_flops", 2.0) is None


def test_teacher_budget_is_the_smallest_spend_among_runs_that_spent_a_comparable_amount():
    grpo = {"curve": [{**p, "teacher_flops": 0.0} for p in CURVE]}
    old = {"curve": [{k: v for k, v in p.items() if k != "teacher_flops"} for p in CURVE]}
    cheaper = {"curve": [*CURVE[:2]]}
    assert quality.teacher_budget([{"curve": CURVE}, cheaper, grpo, old]) == 4.0
    assert quality.teacher_budget([grpo, old]) is None
    # a teacher far cheaper than the rest (a student scoring itself) does not set the budget of the others
    self_teacher = {"curve": [{**p, "teacher_flops": p["teacher_flops"] / 10} for p in CURVE]}
    assert quality.teacher_budget([{"curve": CURVE}, cheaper, self_teacher]) == 4.0
    assert quality.teacher_budget([self_teacher]) == pytest.approx(0.8)
