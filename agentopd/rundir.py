"""A run directory (docs/design.md 3.5): every path in it, in one place.

    rd = RunDir("runs/sql_db-20261126-1200")
    rd.db, rd.metrics, rd.config, rd.tb, rd.tokenizer, rd.final      # the contract's files
    rd.checkpoint(20)                   # checkpoints/step_000020
    rd.latest_checkpoint()              # the newest finished checkpoint (DONE marker), or None
    write_checkpoint(path, step, write) # write(tmp) fills a hidden folder; DONE, then one rename makes it `path`
    rd.prune_checkpoints(keep=2)        # the newest 2 finished checkpoints kept, the rest (and partial ones) removed
    rd.tokenizer_dir()                  # tokenizer/, else final/ (what readers load text with)
    rd.discard_if_unstarted()           # a failed run's folder that holds no finished step: removed

Code that reads or writes a run (runner, backends, CLI, drift checker, metrics log, viewer) takes
its paths from here, so the layout is stated once.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
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
WRITING = ".writing-"  # a checkpoint being written: checkpoints/.writing-step_NNNNNN until it is complete
REPLACED = ".replaced-"  # a finished checkpoint of the same step moved aside while its successor is renamed in
STEP_FOLDER = re.compile(r"step_\d+")
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

    def finished_checkpoints(self) -> list[Path]:
        """The finished checkpoints, oldest first: folders named step_N holding a DONE marker (a write in progress or
        one that was killed is a hidden folder and never counts)."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(p for p in self.checkpoints.iterdir() if STEP_FOLDER.fullmatch(p.name) and is_done(p))

    def latest_checkpoint(self) -> Path | None:
        done = self.finished_checkpoints()
        return done[-1] if done else None

    def prune_checkpoints(self, keep: int) -> list[Path]:
        """Remove what a killed write left (hidden partial folders; a finished checkpoint it had moved aside goes back
        under its name) and, with `keep` > 0, the finished checkpoints older than the newest `keep`; the folders removed."""
        hidden = sorted(self.checkpoints.glob(".*")) if self.checkpoints.is_dir() else []
        for p in hidden:  # killed between moving a finished checkpoint aside and renaming its successor in: it goes back
            if p.name.startswith(REPLACED) and not (self.checkpoints / p.name[len(REPLACED):]).exists():
                os.replace(p, self.checkpoints / p.name[len(REPLACED):])
        gone = [p for p in hidden if p.name.startswith((WRITING, REPLACED)) and p.exists()]
        if keep > 0:
            gone += self.finished_checkpoints()[:-keep]
        for p in gone:
            shutil.rmtree(p, ignore_errors=True)
        return gone

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



def is_done(checkpoint: Path) -> bool:
    return (checkpoint / DONE).is_file()


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written (a full disk, an I/O error): one line saying what failed and which
    checkpoint a resume takes (agentopd.runner)."""


def write_checkpoint(path: Path, step: int, write: Callable[[Path], None]) -> None:
    """Write the checkpoint `path` (checkpoints/step_N) so that a folder of that name is always complete:
    `write(tmp)` fills checkpoints/.writing-step_N (every rank's part: both backends call it with their writer),
    then the DONE marker is written and synced, then one rename gives the folder its name. A finished checkpoint
    already under that name stays valid until the rename (it is moved aside, then removed). A write that raises
    leaves nothing behind (its folder removed, the error raised again); one that is killed leaves only the hidden
    folder, which no resume takes and the next write removes (RunDir.prune_checkpoints)."""
    tmp, old = path.parent / f"{WRITING}{path.name}", path.parent / f"{REPLACED}{path.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        with open(tmp / DONE, "w") as f:
            f.write(str(step))
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():  # the rename in failed: the finished one takes its name back
            os.replace(old, path)
        raise


def _fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (a crash after it finds the new name)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
