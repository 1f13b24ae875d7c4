"""`agentopd check-tokens RUN_DIR`: the drift checker (agentopd.chat.drift) over every stored episode.

    report = check_run("runs/sql_db-20261126-101500")
    report.checked, report.drifted, report.lines     # drifted episodes are listed with positions and context

The run's tokenizer is the one saved in `<run>/tokenizer/` when the run started. An episode drifts when a
token the trainer or teacher sees is not what the sampler produced or the template makes; history rewrites
that the chat template performs by design (Qwen3 re-rendering reasoning) are counted by name, not as drift.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from agentopd.chat import check_stored_episode, format_report
from agentopd.rundir import RunDir
from agentopd.store import Store


@dataclass
class RunDriftReport:
    checked: int = 0
    drifted: int = 0
    info: int = 0
    rewrites: Counter = field(default_factory=Counter)  # history-rewrite kind -> episodes with it (not drift)
    lines: list[str] = field(default_factory=list)


def run_tokenizer(run_dir: RunDir):
    path = run_dir.tokenizer_dir()
    if path is None:
        raise ValueError(f"{run_dir.root} has no tokenizer/ (or final/) folder: is it a run directory?")
    return AutoTokenizer.from_pretrained(path)


def check_run(run_dir: str | Path, *, limit: int | None = None, console: Any = None) -> RunDriftReport:
    rd = RunDir(run_dir)
    if not rd.db.exists():
        raise ValueError(f"{rd.root} has no {rd.db.name}")
    tok = run_tokenizer(rd)
    store = Store(rd.db, readonly=True)
    report = RunDriftReport()
    for episode_id, ep in store.iter_episodes():
        if limit is not None and report.checked >= limit:
            break
        r = check_stored_episode(tok, ep)
        report.checked += 1
        report.info += len(r.info)
        report.rewrites.update({f.kind.value for f in r.rewrites})
        if r.drift:
            report.drifted += 1
            text = format_report(r, name=episode_id)
            report.lines.append(text)
            if console is not None:
                console.print(text, markup=False)
    store.close()
    summary = f"{report.checked} episodes checked: {report.drifted} drifted, {report.info} info findings"
    if report.rewrites:  # named, never counted as drift: the stream holds what was sampled
        kinds = ", ".join(f"{kind} in {n} episode{'s' * (n != 1)}" for kind, n in sorted(report.rewrites.items()))
        summary += f"; history rewrites by the chat template (by design, not drift): {kinds}"
    report.lines.append(summary)
    if console is not None:
        console.print(summary)
    return report
