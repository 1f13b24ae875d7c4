"""Where agentopd keeps what it builds (the generated database, the embedded models):
`$AGENTOPD_HOME`, by default `~/.cache/agentopd`."""

from __future__ import annotations

import os
from pathlib import Path


def agentopd_home() -> Path:
    return Path(os.environ.get("AGENTOPD_HOME") or "~/.cache/agentopd").expanduser()
