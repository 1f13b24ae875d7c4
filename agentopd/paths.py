"""Where agentopd keeps what it builds (the generated database, the embedded models):
`$AGENTOPD_HOME`, by default `~/.cache/agentopd`."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def agentopd_home() -> Path:
    return Path(os.environ.get("AGENTOPD_HOME") or "~/.cache/agentopd").expanduser()


def atomic_dir(final: Path, build: Callable[[Path], None]) -> None:
    """Build into a temp folder beside `final`, then rename: a crash never leaves half a folder behind."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is a normal folder
    try:
        build(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
