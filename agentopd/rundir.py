"""A run directory (docs/design.md 3.5): every path in it, in one place.

    rd = RunDir("runs/sql_db-20261126-1200")
    rd.db, rd.metrics, rd.config, rd.tb, rd.tokenizer, rd.final      # the contract's files
    rd.checkpoint(20)                   # checkpoints/step_000020
    rd.latest_checkpoint()              # the newest finished checkpoint (DONE marker), or None
    RunDir.mark_done(path, step)        # what makes a checkpoint finished (both backends)
    rd.tokenizer_dir()                  # tokenizer/, else final/ (what readers load text with)
    rd.discard_if_unstarted()           # a failed run's folder that holds no finished step: removed

Code that reads or writes a run (runner, backends, CLI, drift checker, metrics log, viewer) takes
its paths from here, so the layout is stated once.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

DB = "trajectories.db"
METRICS = "metrics.jsonl"
CONFIG = "config.yaml"
TB = "tb"
TOKENIZER = "tokenizer"
CHECKPOINTS = "checkpoints"
FINAL = "final"
DONE = "DONE"  # inside a checkpoint folder: written last, holds the step
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def db(self) -> Path:
        return self.root / DB

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def tb(self) -> Path:
        return self.root / TB

    @property
    def tokenizer(self) -> Path:
        return self.root / TOKENIZER

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def final(self) -> Path:
        return self.root / FINAL

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:06d}"

    def latest_checkpoint(self) -> Path | None:
        done = sorted(p for p in self.checkpoints.glob("step_*") if is_done(p))
        return done[-1] if done else None

    def is_run(self) -> bool:
        """Has the files a viewer shows (a store or a metrics log)."""
        return self.root.is_dir() and (self.db.is_file() or self.metrics.is_file())

    def has_steps(self) -> bool:
        """Holds a logged step or a finished checkpoint: something a failed run leaves worth keeping."""
        logged = self.metrics.is_file() and self.metrics.stat().st_size > 0
        return logged or self.latest_checkpoint() is not None

    def discard_if_unstarted(self) -> bool:
        """Remove the folder when it holds no step (a run that failed in its set-up or first step: its tokenizer copy,
        an empty store, TensorBoard's first file); True when removed."""
        if not self.root.is_dir() or self.has_steps():
            return False
        shutil.rmtree(self.root)
        return True

    def tokenizer_dir(self) -> Path | None:
        """`tokenizer/`, else `final/`: the first that holds tokenizer files."""
        for d in (self.tokenizer, self.final):
            if any((d / f).is_file() for f in TOKENIZER_FILES):
                return d
        return None

    @staticmethod
    def of_checkpoint(checkpoint: str | Path) -> RunDir:
        """The run a checkpoint folder (`<run>/checkpoints/step_N`) belongs to."""
        return RunDir(Path(checkpoint).parent.parent)

    @staticmethod
    def mark_done(checkpoint: Path, step: int) -> None:
        """Mark a checkpoint finished: called once every rank has written its part."""
        (checkpoint / DONE).write_text(str(step))


def is_done(checkpoint: Path) -> bool:
    return (checkpoint / DONE).is_file()
