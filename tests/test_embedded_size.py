"""`embedded.size` (agentopd.bootstrap.sized_spec): the gpu pair's parameter counts from its config (not built), the
test size built on the CPU and cached apart from the tiny default (which it leaves alone), `agentopd run` and
`agentopd bootstrap` picking the sized pair, and the refusal of the gpu size on the CPU."""

import json
from dataclasses import asdict, replace

import pytest
import torch
from _tiny import one_thread  # noqa: F401  (tiny models on 2 cores: one torch thread)
from transformers import Qwen3ForCausalLM

from agentopd.bootstrap import (
    BUILTIN_ENVS,
    TINY_SPEC,
    bootstrap,
    build_device,
    default_spec,
    ensure_tokenizer,
    models_root,
    sized_spec,
)
from agentopd.config import EmbeddedSize, load_config


def _parameters(size, vocab: int) -> int:
    """A ModelSize's parameter count from its config: the model made on the meta device (nothing allocated)."""

    class Tok:  # what ModelSize.config reads of a tokenizer
        eos_token_id, pad_token_id = 1, 0

        def __len__(self) -> int:
            return vocab

    with torch.device("meta"):
        return sum(p.numel() for p in Qwen3ForCausalLM(size.config(Tok())).parameters())


@pytest.mark.parametrize("preset", [*BUILTIN_ENVS, "sql_db_explore"])
def test_the_gpu_pair_is_in_range_and_keeps_the_env_recipe(preset):
    spec, gpu = default_spec(preset), sized_spec(default_spec(preset), EmbeddedSize.GPU)
    vocab = spec.tokenizer_vocab  # the shared tokenizer: its size, and the tiny pair's
    assert 10e6 <= _parameters(gpu.student.size, vocab) <= 50e6
    assert 100e6 <= _parameters(gpu.teacher.size, vocab) <= 300e6
    # the env's data and mistakes as the tiny recipe has them; the tiny size is the recipe itself
    assert (gpu.mistakes, gpu.eval_tasks, gpu.max_context, gpu.tokenizer_vocab) == (spec.mistakes, spec.eval_tasks, spec.max_context, vocab)
    assert gpu.demonstrations >= spec.demonstrations and gpu.student.schedule == "constant" and gpu.teacher.target_success
    assert sized_spec(spec, EmbeddedSize.TINY) is spec


def test_where_each_size_is_built_and_cached(tmp_path):
    assert models_root(tmp_path, EmbeddedSize.TINY) == tmp_path / "models"  # the default's paths, as ever
    assert models_root(tmp_path, EmbeddedSize.GPU) == tmp_path / "models" / "gpu"
    assert build_device(EmbeddedSize.TINY, "cuda") == torch.device("cpu")  # tiny: on the CPU whatever the run's device
    assert build_device(EmbeddedSize.TEST) == torch.device("cpu") and build_device(EmbeddedSize.GPU, "cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="embedded.size=gpu: no CUDA device.*embedded.allow_cpu=true"):
            build_device(EmbeddedSize.GPU)


def test_the_gpu_size_on_the_cpu_is_refused_unless_allowed():
    with pytest.raises(ValueError, match=r"embedded.size=gpu on the CPU \(run.device=cpu\).*embedded.allow_cpu=true"):
        load_config("sql_db", overrides=["embedded.size=gpu", "run.device=cpu"])
    cfg = load_config("sql_db", overrides=["embedded.size=gpu", "run.device=cpu", "embedded.allow_cpu=true"])
    assert cfg.embedded.size == EmbeddedSize.GPU
    with pytest.raises(ValueError, match="bad value for embedded.size: 'huge'"):
        load_config("sql_db", overrides=["embedded.size=huge"])
    assert load_config("sql_db").embedded.size == EmbeddedSize.TINY


def _stamps(folder):
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_the_test_size_builds_on_cpu_cached_apart_from_the_default(tmp_path):
    ensure_tokenizer(TINY_SPEC, home=tmp_path)  # the shared tokenizer, at test size (both sizes use it)
    tiny = bootstrap("calculator", spec=TINY_SPEC, home=tmp_path)
    default = _stamps(tiny.teacher_dir.parent)

    models = bootstrap("calculator", size=EmbeddedSize.TEST, home=tmp_path)
    assert models.teacher_dir == tmp_path / "models" / "test" / "calculator" / "teacher"
    assert models.student_dir == tmp_path / "models" / "test" / "calculator" / "student"
    assert _stamps(tiny.teacher_dir.parent) == default  # the default's cache untouched
    wanted = sized_spec(default_spec("calculator"), EmbeddedSize.TEST)
    report = json.loads((models.teacher_dir.parent / "report.json").read_text())
    assert report["spec"] == json.loads(json.dumps(asdict(wanted))) and (report["size"], report["device"]) == ("test", "cpu")
    assert report["teacher"]["steps"] <= wanted.teacher.max_steps and report["demonstrations"] == wanted.demonstrations

    built = _stamps(models.teacher_dir.parent)
    assert bootstrap("calculator", size="test", home=tmp_path).report == models.report  # cached: nothing rebuilt
    assert _stamps(models.teacher_dir.parent) == built
    # a sized cache is keyed by its spec: a new student plan retrains the student alone
    longer = replace(wanted, student=replace(wanted.student, max_steps=3))
    again = bootstrap("calculator", spec=longer, size=EmbeddedSize.TEST, home=tmp_path)
    assert again.report["student"]["steps"] == 3 and again.report["teacher"] == models.report["teacher"]
    assert (models.teacher_dir / "model.safetensors").stat().st_mtime_ns == built["teacher/model.safetensors"]
    assert _stamps(tiny.teacher_dir.parent) == default


def test_run_and_bootstrap_pick_the_sized_pair(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from agentopd.cli import app

    ensure_tokenizer(TINY_SPEC, home=tmp_path)
    monkeypatch.setenv("AGENTOPD_HOME", str(tmp_path))
    runner = CliRunner()

    def cli(*args):
        return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)

    refused = cli("run", "--env", "sql_db", "embedded.size=gpu", "run.device=cpu")
    assert refused.exit_code == 2 and "embedded.size=gpu on the CPU" in refused.output
    assert "embedded.allow_cpu=true" in refused.output and not (tmp_path / "models").exists()

    run = tmp_path / "run"
    short = ["steps=1", "rollout.tasks_per_step=2", "rollout.max_new_tokens=16", "rollout.max_turns=2", "eval.num_tasks=2",
             "eval.every=0", "run.checkpoint_every=0", "log.tensorboard=false",
             "teacher.selftest=false"]  # fmt: skip  # the test-size teacher is barely trained: near uniform, refused
    result = cli("run", "--env", "calculator", "--run-dir", run, "embedded.size=test", *short)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "models" / "test" / "calculator" / "report.json").exists()
    assert not (tmp_path / "models" / "calculator").exists()  # the tiny default was not built
    assert "size: test" in (run / "config.yaml").read_text()

    shown = cli("bootstrap", "--env", "calculator", "embedded.size=test")  # found in the cache, shown
    assert shown.exit_code == 0, shown.output
    assert "size test" in shown.output and not (tmp_path / "models" / "calculator").exists()


@pytest.mark.gpu
def test_a_sized_pair_builds_on_the_gpu(tmp_path):
    """sft() on CUDA: bf16 autocast over fp32 weights, varlen attention in the steps, the built attention for the
    evals during training and for the saved model."""
    from transformers import AutoModelForCausalLM

    ensure_tokenizer(TINY_SPEC, home=tmp_path)
    models = bootstrap("sql_db", size=EmbeddedSize.TEST, device="cuda", home=tmp_path)
    assert models.report["device"] == "cuda" and models.report["teacher"]["history"]  # evaluated while training
    for folder in (models.teacher_dir, models.student_dir):
        assert "varlen" not in (folder / "config.json").read_text()
        AutoModelForCausalLM.from_pretrained(folder)
