"""The embedded default's builder (agentopd.bootstrap) at toy sizes: what it writes, that it
reuses its cache, rebuilds on --force or when the preset's env changes, and refuses non-built-in envs."""

import json
from dataclasses import asdict, replace

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentopd.bootstrap import TINY_SPEC, bootstrap

# the cache's rules, not the models: TINY_SPEC's teacher with 2 steps and no mid-training eval, 2 eval tasks (each of
# the test's seven builds took ~14 s at TINY_SPEC, most of it the evals of a barely trained model that writes to its limit)
FAST = replace(TINY_SPEC, teacher=replace(TINY_SPEC.teacher, max_steps=2, eval_every=100), eval_tasks=2)


def test_builds_caches_and_rebuilds(tmp_path, monkeypatch):
    models = bootstrap("calculator", spec=FAST, home=tmp_path)
    for role, folder in (("teacher", models.teacher_dir), ("student", models.student_dir)):
        AutoModelForCausalLM.from_pretrained(folder)
        assert (folder / "chat_template.jinja").exists()
        assert 0.0 <= models.report[role]["success"] <= 1.0 and models.report[role]["parameters"] > 0
    tok = AutoTokenizer.from_pretrained(models.student_dir)
    shared = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    assert tok.get_vocab() == shared.get_vocab()  # one tokenizer for every built-in env
    report = json.loads((models.teacher_dir.parent / "report.json").read_text())
    assert report["env_kwargs"] and report["demonstrations"] == FAST.demonstrations

    stamp = (models.teacher_dir / "model.safetensors").stat().st_mtime_ns
    bootstrap("calculator", spec=FAST, home=tmp_path)  # cached: nothing rebuilt
    assert (models.teacher_dir / "model.safetensors").stat().st_mtime_ns == stamp
    bootstrap("calculator", spec=FAST, home=tmp_path, force=True)
    assert (models.teacher_dir / "model.safetensors").stat().st_mtime_ns != stamp

    import agentopd.bootstrap as b

    stamp = (models.teacher_dir / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(b, "preset_env_kwargs", lambda env: {"num_tasks": 50})  # the preset's env changed
    bootstrap("calculator", spec=FAST, home=tmp_path)
    assert (models.teacher_dir / "model.safetensors").stat().st_mtime_ns != stamp

    stamp = (models.teacher_dir / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(b, "RECIPE", b.RECIPE + 1)  # a newer default recipe: an older cache is rebuilt
    bootstrap("calculator", spec=FAST, home=tmp_path)
    assert (models.teacher_dir / "model.safetensors").stat().st_mtime_ns != stamp

    stamp = (models.teacher_dir / "model.safetensors").stat().st_mtime_ns
    newer = b.SPEC_VERSIONS.get("calculator", 1) + 1
    monkeypatch.setattr(b, "SPEC_VERSIONS", {"calculator": newer})  # this preset's spec changed: its cache alone is rebuilt
    bootstrap("calculator", spec=FAST, home=tmp_path)
    assert (models.teacher_dir / "model.safetensors").stat().st_mtime_ns != stamp
    assert json.loads((models.teacher_dir.parent / "report.json").read_text())["spec_version"] == newer

    teacher_stamp = (models.teacher_dir / "model.safetensors").stat().st_mtime_ns
    student_stamp = (models.student_dir / "model.safetensors").stat().st_mtime_ns
    before = json.loads((models.teacher_dir.parent / "report.json").read_text())
    longer = replace(FAST, student=replace(FAST.student, max_steps=3))
    monkeypatch.setattr(b, "SPEC_VERSIONS", {"calculator": newer + 1})  # a new spec that changes the student's plan only
    bootstrap("calculator", spec=longer, home=tmp_path)
    assert (models.teacher_dir / "model.safetensors").stat().st_mtime_ns == teacher_stamp  # the teacher is kept
    assert (models.student_dir / "model.safetensors").stat().st_mtime_ns != student_stamp
    after = json.loads((models.teacher_dir.parent / "report.json").read_text())
    assert after["spec"]["student"]["max_steps"] == 3 and after["teacher"] == before["teacher"]
    assert after["student"]["steps"] == 3 and after["spec_version"] == newer + 1
    bootstrap("calculator", spec=longer, home=tmp_path)  # and that is the cache now
    assert json.loads((models.teacher_dir.parent / "report.json").read_text()) == after
    monkeypatch.setattr(b, "SPEC_VERSIONS", {"calculator": newer + 2})  # one that changes the teacher's: both rebuilt
    bootstrap("calculator", spec=replace(longer, teacher=replace(longer.teacher, max_steps=3)), home=tmp_path)
    assert (models.teacher_dir / "model.safetensors").stat().st_mtime_ns != teacher_stamp


def test_an_env_that_is_not_installed_is_named():
    """Any installed env with an oracle has an embedded default (tests/test_plugin_env.py); a name
    that is not installed says so."""
    with pytest.raises(ValueError, match="unknown env 'no_such_env'; installed: "):
        bootstrap("no_such_env")


def test_the_students_format_gate_trains_on_until_the_format_is_learnt(tmp_path):
    """The student is checked for the format after its SFT steps (issue 54: a plugin env's student at 27% malformed
    calls was distilled from there, 1% -> 20%): under the gate it stops at max_steps, the model the spec alone gives;
    at or over it, eval_every more steps at a time up to format_gate_steps, each check in the report."""
    from agentopd.bootstrap import BootstrapSpec

    student = BootstrapSpec().student
    assert (student.format_gate, student.format_gate_steps, student.eval_every) == (0.1, 300, 10)
    plain = bootstrap("calculator", spec=FAST, home=tmp_path / "plain").report["student"]
    assert "format_gate" not in plain and plain["steps"] == FAST.student.max_steps

    open_gate = replace(FAST, student=replace(FAST.student, format_gate=1.01, format_gate_steps=4, eval_every=2))
    passed = bootstrap("calculator", spec=open_gate, home=tmp_path / "open").report["student"]
    assert passed["steps"] == FAST.student.max_steps and passed["success"] == plain["success"]
    assert passed["format_gate"]["passed"] and [c["step"] for c in passed["format_gate"]["checks"]] == [2]

    # a gate no model passes (no malformed calls at all is not under 0): it trains to its cap, checked every 2 steps
    shut = replace(FAST, student=replace(FAST.student, format_gate=0.0, format_gate_steps=5, eval_every=2))
    capped = bootstrap("calculator", spec=shut, home=tmp_path / "shut").report["student"]
    assert capped["steps"] == 2 + 5 and not capped["format_gate"]["passed"]
    checks = capped["format_gate"]["checks"]
    assert [c["step"] for c in checks] == [2, 4, 6, 7]
    assert all(0.0 <= c["parse_error_rate"] <= 1.0 and 0.0 <= c["success"] <= 1.0 for c in checks)
    assert capped["success"] == checks[-1]["success"]


def test_a_cache_built_before_a_spec_field_existed_is_kept():
    """A field added to SFTSpec (format_gate) at its default rebuilds no cache: the gpu size compares whole specs."""
    import agentopd.bootstrap as b

    spec = json.loads(json.dumps(asdict(replace(b.BootstrapSpec(), teacher=b.GPU_TEACHER, student=b.GPU_STUDENT))))
    old = {**spec, **{r: {k: v for k, v in spec[r].items() if not k.startswith("format_gate")} for r in ("teacher", "student")}}
    assert old != spec and b._with_new_fields(old) == spec
    assert b._with_new_fields(None) is None
