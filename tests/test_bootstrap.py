"""The embedded default's builder (agentopd.bootstrap) at toy sizes: what it writes, that it
reuses its cache, rebuilds on --force or when the preset's env changes, and refuses non-built-in envs."""

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentopd.bootstrap import TINY_SPEC, bootstrap


def test_builds_caches_and_rebuilds(tmp_path, monkeypatch):
    models = bootstrap("calculator", spec=TINY_SPEC, home=tmp_path)
    for role, folder in (("teacher", models.teacher_dir), ("student", models.student_dir)):
        AutoModelForCausalLM.from_pretrained(folder)
        assert (folder / "chat_template.jinja").exists()
        assert 0.0 <= models.report[role]["success"] <= 1.0 and models.report[role]["parameters"] > 0
    tok = AutoTokenizer.from_pretrained(models.student_dir)
    shared = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    assert tok.get_vocab() == shared.get_vocab()  # one tokenizer for every built-in env
    report = json.loads((models.teacher_dir.parent / "report.json").read_text())
    assert report["env_kwargs"] and report["demonstrations"] == TINY_SPEC.demonstrations

    stamp = (models.teacher_dir / "model.safetensors").stat().st_mtime_ns
    bootstrap("calculator", spec=TINY_SPEC, home=tmp_path)  # cached: nothing rebuilt
    assert (models.teacher_dir / "model.safetensors").stat().st_mtime_ns == stamp
    bootstrap("calculator", spec=TINY_SPEC, home=tmp_path, force=True)
    assert (models.teacher_dir / "model.safetensors").stat().st_mtime_ns != stamp

    import agentopd.bootstrap as b

    stamp = (models.teacher_dir / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(b, "preset_env_kwargs", lambda env: {"num_tasks": 50})  # the preset's env changed
    bootstrap("calculator", spec=TINY_SPEC, home=tmp_path)
    assert (models.teacher_dir / "model.safetensors").stat().st_mtime_ns != stamp

    stamp = (models.teacher_dir / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(b, "RECIPE", b.RECIPE + 1)  # a newer default recipe: an older cache is rebuilt
    bootstrap("calculator", spec=TINY_SPEC, home=tmp_path)
    assert (models.teacher_dir / "model.safetensors").stat().st_mtime_ns != stamp


def test_only_builtin_envs():
    with pytest.raises(ValueError, match="no built-in models for env 'reverse_words'"):
        bootstrap("reverse_words")


def test_student_process_builds_the_same_models(tmp_path, monkeypatch):
    """With two cores the student trains in a second process: the same models, bit for bit, as one process."""
    import torch

    built = {}
    for procs in ("1", "2"):
        monkeypatch.setenv("AGENTOPD_BOOTSTRAP_PROCESSES", procs)
        built[procs] = bootstrap("calculator", spec=TINY_SPEC, home=tmp_path / procs)
    for role in ("teacher_dir", "student_dir"):
        one, two = (AutoModelForCausalLM.from_pretrained(getattr(built[p], role)).state_dict() for p in ("1", "2"))
        assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    assert built["1"].report["student"]["success"] == built["2"].report["student"]["success"]


def test_student_process_failure_is_reported(tmp_path, monkeypatch):
    from dataclasses import replace

    monkeypatch.setenv("AGENTOPD_BOOTSTRAP_PROCESSES", "2")
    bad = replace(TINY_SPEC, student=replace(TINY_SPEC.student, lr=-1.0))
    with pytest.raises(RuntimeError, match=r"(?s)built-in student failed.*lr"):
        bootstrap("calculator", spec=bad, home=tmp_path)
    assert not (tmp_path / "models" / "calculator" / "report.json").exists()  # nothing cached as built


def test_progress_keeps_one_bar_per_bootstrap_phase():
    """The teacher and the student report progress at once (two processes): each phase has its own bar,
    removed when that phase reports it is done."""
    import io

    from rich.console import Console

    from agentopd.progress import RunProgress

    progress = RunProgress(Console(file=io.StringIO()))
    progress.bootstrap_callback("teacher", 0.1, {"loss": 2.0})
    progress.bootstrap_callback("student", 0.2, {"loss": 2.5})
    progress.bootstrap_callback("teacher", 0.3, {"loss": 1.5})
    bars = {t.description: t.completed for t in progress._bars.tasks}
    assert bars == {"bootstrap: teacher loss 1.500": 30, "bootstrap: student loss 2.500": 20}
    progress.bootstrap_callback("student", 1.0, {"loss": 0.4})
    assert [t.description for t in progress._bars.tasks] == ["bootstrap: teacher loss 1.500"]
    progress.close()
