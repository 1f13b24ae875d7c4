"""What a run prints when its output is not a terminal (a pipe, a log file): plain lines written and
flushed as they happen, the bootstrap's progress included (a live bar there printed nothing for minutes)."""

import io

from rich.console import Console

from agentopd.progress import RunProgress


class _Log(io.StringIO):
    flushes = 0

    def flush(self):
        self.flushes += 1
        super().flush()


def test_plain_lines_when_not_a_terminal():
    log = _Log()
    progress = RunProgress(Console(file=log, force_terminal=False, width=200))
    assert progress.plain
    for i in range(101):
        progress.bootstrap_callback("teacher", i / 100, {"loss": 1.0 / (i + 1)})
    progress.bootstrap_callback("student", 0.0, {})
    with progress.phase("rollout", total=4) as advance:
        advance()
    progress.step_line(1, 10, {"loss": 0.5, "kl/mean": 0.25, "success_rate": 0.5})
    progress.close()
    lines = log.getvalue().splitlines()
    teacher = [x for x in lines if x.startswith("bootstrap: teacher")]
    assert 10 <= len(teacher) <= 12, lines  # about one line per tenth, not one per call
    assert teacher[0] == "bootstrap: teacher 0%, loss 1.000" and teacher[-1].startswith("bootstrap: teacher 100%")
    assert "bootstrap: student 0%" in lines
    assert any(x.startswith("step 1/10  loss 0.5000") for x in lines)
    assert log.flushes >= len(lines)  # each line is flushed as it is printed


def test_bars_on_a_terminal():
    progress = RunProgress(Console(file=io.StringIO(), force_terminal=True))
    assert not progress.plain
