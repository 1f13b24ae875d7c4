"""Plugins from separate distributions (docs/design.md 3.3), through the real `agentopd` console script.

tests/fixtures/plugin_pkg (an env + a tool) and tests/fixtures/broken_plugin_pkg (a module
that raises at import, and an env that loads but breaks the contract) are pip-installed
into a private folder (`--target`, see conftest.py); the CLI runs in a subprocess with that
folder on PYTHONPATH, so the venv itself is never changed.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentopd import registry

AGENTOPD = Path(sys.executable).parent / "agentopd"  # the console script `pip install -e .` wrote


@pytest.fixture(scope="module")
def agentopd(plugin_site):
    assert AGENTOPD.exists(), f"{AGENTOPD} missing: install the package (pip install -e .)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(plugin_site), os.environ.get("PYTHONPATH")])),
           "COLUMNS": "250", "NO_COLOR": "1"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(AGENTOPD), *args], capture_output=True, text=True, env=env, timeout=300)

    return run


def _row(output: str, name: str) -> str:
    rows = [ln for ln in output.splitlines() if f" {name} " in ln]
    assert rows, f"{name} not listed:\n{output}"
    return rows[0]


def test_installed_plugin_and_broken_plugin_in_envs(agentopd):
    out = agentopd("envs")
    assert out.returncode == 0, out.stderr
    assert "agentopd-demo-plugin" in _row(out.stdout, "reverse_words")
    assert "Reverse a word using the reverse_text tool" in _row(out.stdout, "reverse_words")
    listed, broken = out.stdout.split("failed to load")
    broken_row = _row(broken, "broken_env")
    assert "agentopd-broken-plugin" in broken_row and "RuntimeError: agentopd_broken_plugin is broken on purpose" in broken_row
    for name, plugin in registry.envs().items():  # the built-ins still load and are listed
        assert plugin.package in _row(listed, name)


def test_installed_plugin_and_broken_plugin_in_tools(agentopd):
    out = agentopd("tools")
    assert out.returncode == 0, out.stderr
    listed, broken = out.stdout.split("failed to load")
    assert "agentopd-demo-plugin" in _row(listed, "reverse_text")
    assert "Reverse a piece of text" in _row(listed, "reverse_text")
    assert "broken on purpose" in _row(broken, "broken_tool")
    for t in registry.tool_entries():
        assert t.package in _row(listed, t.name)


def test_check_env_on_the_plugin_env(agentopd):
    out = agentopd("check-env", "reverse_words", "env.word_length=4")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "reverse_words: all checks passed" in out.stdout
    assert "1000 bad actions" in out.stdout


def test_a_broken_plugin_fails_only_itself(agentopd):
    out = agentopd("check-env", "broken_env")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "error: env 'broken_env' from package agentopd-broken-plugin failed to load: "
        "RuntimeError: agentopd_broken_plugin is broken on purpose"
    )
    sloppy = agentopd("check-env", "sloppy_env", "--fuzz-steps", "20")
    assert sloppy.returncode == 1
    assert "check(s) failed: oracle, fuzz" in sloppy.stderr
