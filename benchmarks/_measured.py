"""The commit a benchmark measured, for its report: AGENTOPD_COMMIT where set (a device machine's copy of the tree
carries no .git, or a stale one), else the checkout's short HEAD, else a note saying how to name it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def commit_measured() -> str:
    if os.environ.get("AGENTOPD_COMMIT"):
        return os.environ["AGENTOPD_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    except OSError:  # no git on the machine
        return "unknown (set AGENTOPD_COMMIT)"
    return done.stdout.strip() if done.returncode == 0 else "unknown (set AGENTOPD_COMMIT)"


def tree_env(tree: Path) -> dict[str, str]:
    """This process's environment with `tree` first on PYTHONPATH: a child process of it imports that checkout's
    agentopd (an --against run of another commit)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
