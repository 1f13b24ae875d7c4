"""Run directories as the viewer sees them: discovery, read-only SQLite, metrics, tokenizers.

    catalog = RunCatalog("runs/")            # a run directory, or a folder of run directories
    catalog.names()                          # ["sql_db-20260101-120000", ...] (re-listed each call)
    run = catalog.get("sql_db-...")          # -> Run, or raises RunNotFound (never leaves the folder)
    with run.connect() as conn: ...          # sqlite3, file:...?mode=ro + PRAGMA query_only
    run.metrics()                            # metrics.jsonl rows, re-read when the file changes
    run.decoder()                            # TokenDecoder from <run>/tokenizer or <run>/final, or None

A run directory (docs/design.md 3.5) holds `trajectories.db` and/or `metrics.jsonl`. Run names are
looked up as direct children of the served folder only: a name with a path separator, a
leading dot or a NUL byte is unknown, so `..`, `%2F`-smuggled paths and absolute paths
cannot escape it. Symlinked children are followed (a user may link runs from elsewhere).

Nothing here writes: the database is opened read-only (a WAL writer can go on), metrics
are re-read when the file's size or mtime changes, and tokenizers are loaded lazily with
`transformers.AutoTokenizer` (tokenizer files only, never a model) and cached per run.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentopd.rundir import RunDir
from agentopd.store import connect_readonly

log = logging.getLogger(__name__)



class RunNotFound(LookupError):
    """No run of that name in the served folder."""


def is_run_dir(path: Path) -> bool:
    return RunDir(path).is_run()


def finite(x: Any) -> float | None:
    """A JSON-safe number: NaN/inf and non-numbers become None."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


# ---- metrics.jsonl ----------------------------------------------------------------------------
_metrics_cache: dict[Path, tuple[tuple[int, int], list[dict[str, Any]]]] = {}
_metrics_lock = threading.Lock()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The JSON-object lines of a metrics.jsonl, each with an int `step` (the line number when
    absent). Lines that do not parse (a writer mid-line) are skipped. Cached by (mtime, size)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return []
    key = (st.st_mtime_ns, st.st_size)
    with _metrics_lock:
        hit = _metrics_cache.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if not isinstance(obj, dict):
                continue
            step = obj.get("step")
            obj["step"] = step if isinstance(step, int) and not isinstance(step, bool) else i
            rows.append(obj)
    with _metrics_lock:
        _metrics_cache[path] = (key, rows)
    return rows


# ---- tokenizers -------------------------------------------------------------------------------
@dataclass
class TokenDecoder:
    """Per-token text from a run's tokenizer; pieces cached by id (a vocabulary is finite)."""

    tokenizer: Any
    source: str
    _pieces: dict[int, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def pieces(self, ids: list[int]) -> list[str]:
        missing = sorted({i for i in ids if i not in self._pieces})
        if missing:
            texts = self.tokenizer.batch_decode(
                [[i] for i in missing], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            with self._lock:
                self._pieces.update(zip(missing, texts))
        return [self._pieces[i] for i in ids]


_tok_cache: dict[Path, tuple[int, TokenDecoder | None]] = {}
_tok_lock = threading.Lock()


def load_decoder(run_dir: Path) -> TokenDecoder | None:
    """The run's tokenizer (lazily, once per directory version), or None when there is none or
    it fails to load (logged; the viewer then shows token ids)."""
    d = RunDir(run_dir).tokenizer_dir()
    if d is None:
        return None
    version = d.stat().st_mtime_ns
    with _tok_lock:
        hit = _tok_cache.get(d)
        if hit is not None and hit[0] == version:
            return hit[1]
        try:
            from transformers import AutoTokenizer  # heavy import: only when a run has a tokenizer

            tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
            decoder: TokenDecoder | None = TokenDecoder(tok, f"{run_dir.name}/{d.name}")
            # transformers brings ~10^6 long-lived objects; a full cyclic-GC pass over them takes
            # ~0.3 s and lands inside whichever request crosses the threshold. Freeze what exists
            # now (modules, the tokenizer) so later full collections skip it.
            gc.freeze()
        except Exception as e:  # noqa: BLE001 - any broken tokenizer folder means "show ids"
            log.warning("tokenizer in %s failed to load: %s", d, e)
            decoder = None
        _tok_cache[d] = (version, decoder)
        return decoder


# ---- runs ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    name: str
    path: Path

    @property
    def dir(self) -> RunDir:
        return RunDir(self.path)

    @property
    def db_path(self) -> Path:
        return self.dir.db

    @property
    def has_db(self) -> bool:
        return self.db_path.is_file()

    @contextmanager
    def connect(self) -> Iterator[sqlite3.Connection | None]:
        """A fresh read-only connection per use (sees a live writer's latest commits), or None
        when the run has no trajectories.db (yet) or no `episodes` table (yet)."""
        if not self.has_db:
            yield None
            return
        conn = connect_readonly(self.db_path)
        try:
            ok = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'episodes'").fetchone()
            yield conn if ok else None
        finally:
            conn.close()

    def metrics(self) -> list[dict[str, Any]]:
        return read_metrics(self.dir.metrics)

    def decoder(self) -> TokenDecoder | None:
        return load_decoder(self.path)

    def config_env(self) -> str | None:
        """The env name from config.yaml (`env: name` or `env: {name: ...}`), if readable."""
        cfg = self.dir.config
        if not cfg.is_file():
            return None
        try:
            import yaml

            data = yaml.safe_load(cfg.read_text(encoding="utf-8"))
        except Exception:  # noqa: BLE001 - a broken config only hides the env column
            return None
        env = data.get("env") if isinstance(data, dict) else None
        if isinstance(env, dict):
            env = env.get("name") or env.get("id")
        return str(env) if isinstance(env, str | int) else None


class RunCatalog:
    """The runs under one served path: the path itself when it is a run directory, else its
    direct children that are run directories (re-listed on every call, so new runs appear)."""

    def __init__(self, path: str | Path):
        root = Path(path).expanduser().resolve()
        if not root.is_dir():
            raise ValueError(f"path must be a run directory or a folder of runs, got {str(path)!r}")
        self.root = root
        self.single = is_run_dir(root)

    def names(self) -> list[str]:
        if self.single:
            return [self.root.name]
        return sorted(c.name for c in self.root.iterdir() if self._valid_name(c.name) and is_run_dir(c))

    @staticmethod
    def _valid_name(name: str) -> bool:
        return bool(name) and not name.startswith(".") and "/" not in name and "\\" not in name and "\0" not in name

    def get(self, name: str) -> Run:
        if self.single:
            if name != self.root.name:
                raise RunNotFound(name)
            return Run(name, self.root)
        if not self._valid_name(name):
            raise RunNotFound(name)
        path = self.root / name
        if path.parent != self.root or not is_run_dir(path):
            raise RunNotFound(name)
        return Run(name, path)
