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


def test_plain_lines_are_whole_lines_at_any_length(monkeypatch):
    """Issue 27, defect 3: piped into a file, every step line broke in two at rich's 80 columns."""
    monkeypatch.setenv("COLUMNS", "80")  # what rich assumes without a terminal
    log = _Log()
    progress = RunProgress(Console(file=log))
    assert progress.plain
    metrics = {"loss": 0.4123, "kl/mean": 0.2211, "success_rate": 0.38,
               "perf/rollout_tokens_per_s": 2788.0, "perf/train_tokens_per_s": 26331.0}  # fmt: skip
    progress.step_line(120, 300, metrics)
    progress.note("eval @ step 120: success 38% (teacher 90%), mean turns 2.41, tool errors 3.1%, 100 tasks " * 2)
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].endswith("train 26,331 tok/s") and len(lines[1]) > 160, lines


def test_the_cli_prints_whole_lines_into_a_pipe(monkeypatch, tmp_path):
    """The same for the CLI's own lines (the final "view:" hint) when stdout is a file."""
    import contextlib

    from agentopd import cli

    monkeypatch.setenv("COLUMNS", "80")
    run_dir = tmp_path / "runs" / "sql_db-20260101-120000"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.console.print(f"final student: {run_dir / 'final'}   view: agentopd view {run_dir}")
    assert out.getvalue() == f"final student: {run_dir / 'final'}   view: agentopd view {run_dir}\n"
