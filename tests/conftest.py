"""Shared pytest set-up: GPU tests skip without CUDA; browser tests skip without chromium."""

import shutil

import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    no_browser = pytest.mark.skip(reason="needs /usr/bin/chromium (apt-get install chromium)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "browser" in item.keywords and shutil.which("chromium") is None:
            item.add_marker(no_browser)


# --- plugin fixtures: the test plugin distributions installed outside the venv ----------------
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

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
