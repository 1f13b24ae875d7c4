"""What a run shows on the terminal: rich progress bars per phase and one line per step.

    progress = RunProgress()
    with progress.phase("rollout", total=64) as advance:
        ... advance() per finished episode ...
    progress.step_line(3, 30, metrics)      # step 3/30  loss 0.41  kl 0.22  success 38%  1.2k tok/s
    progress.note("eval @ step 5: ...")
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


class RunProgress:
    """Live bars on a terminal; plain lines (each printed whole and flushed at once) when the output is
    a pipe or a log file, where bars would show nothing until the end (and rich would break a line at
    80 columns)."""

    PLAIN_EVERY = 0.1  # plain mode: a bootstrap line per tenth of each phase

    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.plain = not self.console.is_terminal
        self._bars = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=self.console, transient=True,
        )  # fmt: skip
        self._started = False
        self._bootstrap_task = None
        self._plain_last: tuple[str, float] | None = None

    def _start(self) -> None:
        if not self._started and not self.plain:
            self._bars.start()
            self._started = True

    @contextmanager
    def phase(self, name: str, total: int | None) -> Iterator[Callable[[], None]]:
        if self.plain:  # the step line after the phases says what they did
            yield lambda: None
            return
        self._start()
        task = self._bars.add_task(name, total=total)
        try:
            yield lambda: self._bars.advance(task)
        finally:
            self._bars.remove_task(task)

    def bootstrap_callback(self, phase: str, fraction: float, info: dict[str, Any]) -> None:
        """Progress of the embedded default's build (agentopd.bootstrap's `progress`)."""
        if self.plain:
            last = self._plain_last
            if last is None or last[0] != phase or fraction >= min(last[1] + self.PLAIN_EVERY, 1.0):
                loss = f", loss {info['loss']:.3f}" if "loss" in info else ""
                self.note(f"bootstrap: {phase} {fraction:.0%}{loss}")
                self._plain_last = (phase, fraction)
            return
        self._start()
        desc = f"bootstrap: {phase}" + (f" loss {info['loss']:.3f}" if "loss" in info else "")
        if self._bootstrap_task is None:
            self._bootstrap_task = self._bars.add_task(desc, total=100)
        self._bars.update(self._bootstrap_task, description=desc, completed=int(fraction * 100))
        if phase.startswith("student") and fraction >= 1.0:
            self._bars.remove_task(self._bootstrap_task)
            self._bootstrap_task = None

    def note(self, text: str) -> None:
        self.console.print(text, soft_wrap=self.plain)
        self.console.file.flush()

    def step_line(self, step: int, steps: int, m: dict[str, Any]) -> None:
        def f(key: str, fmt: str) -> str:
            v = m.get(key)
            return format(v, fmt) if isinstance(v, (int, float)) else "-"

        self.note(
            f"step {step}/{steps}  loss {f('loss', '.4f')}  kl {f('kl/mean', '.4f')}  "
            f"success {f('success_rate', '.0%')}  rollout {f('perf/rollout_tokens_per_s', ',.0f')} tok/s  "
            f"train {f('perf/train_tokens_per_s', ',.0f')} tok/s"
        )

    def close(self) -> None:
        if self._started:
            self._bars.stop()
            self._started = False
