"""The CLI in-process (typer's CliRunner): listings, check-env, one-line errors with exit code 2."""

import pytest
from typer.testing import CliRunner

from agentopd import registry
from agentopd.cli import app


@pytest.fixture
def cli(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # wide tables: every cell on one line
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(app, list(args))

    return invoke


def test_envs_lists_every_loaded_env(cli):
    result = cli("envs")
    assert result.exit_code == 0, result.output
    for name, plugin in registry.envs().items():
        line = next(ln for ln in result.output.splitlines() if f" {name} " in ln)
        assert plugin.package in line and plugin.value in line


def test_tools_expands_classes_to_their_methods(cli):
    result = cli("tools")
    assert result.exit_code == 0, result.output
    entries = registry.tool_entries()
    for t in entries:
        assert f" {t.name} " in result.output
    assert all(registry.tool_functions(p.obj) for p in registry.tools().values())


def test_tool_functions_of_a_class():
    class Toolbox:
        def __init__(self, path: str):
            self.path = path

        def lookup(self, key: str) -> str:
            """Look a key up."""
            return key

        def helper(self):  # no docstring: not a tool
            return None

        def _private(self) -> str:
            """Private."""
            return ""

    def plain(x: int) -> int:
        """A function tool."""
        return x

    assert [f.__name__ for f in registry.tool_functions(Toolbox)] == ["lookup"]
    assert registry.tool_functions(plain) == [plain]

    class Named(Toolbox):
        TOOLS = ("helper",)  # an explicit list wins over the docstring rule

    assert [f.__name__ for f in registry.tool_functions(Named)] == ["helper"]
    Named.TOOLS = ("helper", "nope")
    with pytest.raises(ValueError, match=r"TOOLS names methods it does not have: \['nope'\]"):
        registry.tool_functions(Named)


def test_plugins_in_process(cli, demo_plugin):
    envs = cli("envs")
    assert envs.exit_code == 0
    assert "reverse_words" in envs.output and "agentopd-demo-plugin" in envs.output
    assert "failed to load" in envs.output and "broken_env" in envs.output and "broken on purpose" in envs.output
    tools = cli("tools")
    assert tools.exit_code == 0 and "reverse_text" in tools.output and "broken_tool" in tools.output


def test_check_env_passes_and_fails(cli, demo_plugin):
    ok = cli("check-env", "reverse_words", "env.max_turns=2", "--fuzz-steps", "200")
    assert ok.exit_code == 0, ok.output
    assert "all checks passed" in ok.output and "200 bad actions" in ok.output
    bad = cli("check-env", "sloppy_env", "--fuzz-steps", "50")
    assert bad.exit_code == 1, bad.output
    assert "check(s) failed: oracle, fuzz" in bad.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["check-env", "no_such_env"], "error: unknown env 'no_such_env'"),
        (["check-env", "reverse_words", "env.bogus=1"], "error: unknown key env.bogus (value 1); ReverseEnv accepts"),
        (["check-env", "reverse_words", "env.max_turns=lots"], "error: bad value for env.max_turns: 'lots'"),
        (["check-env", "reverse_words", "max_turns"], "error: override 'max_turns' is not of the form key=value"),
        (["check-env", "broken_env"], "error: env 'broken_env' from package agentopd-broken-plugin failed to load: RuntimeError"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(cli, demo_plugin, args, message):
    result = cli(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.parametrize(
    "override, message",
    [("student=/nonexistent", "student='/nonexistent': no such file or folder"), ("env.db_path=missing.sqlite", "no SQLite file at 'missing.sqlite'")],
)
def test_a_refused_run_leaves_no_run_directory(tmp_path, monkeypatch, override, message):
    """Issue 27, defect 4: a run refused at validation left an empty runs/<name>/ behind."""
    import json
    import sqlite3

    monkeypatch.chdir(tmp_path)
    with sqlite3.connect("mine.sqlite") as conn:
        conn.executescript("CREATE TABLE t (x INTEGER); INSERT INTO t VALUES (1), (2);")
    conn.close()
    lines = [json.dumps({"id": f"q{i}", "question": f"Rows above {i}?", "sql": f"SELECT COUNT(*) FROM t WHERE x > {i}"}) for i in range(5)]
    (tmp_path / "mine.jsonl").write_text("\n".join(lines) + "\n")
    args = ["run", "--env", "sql_db", "env.db_path=mine.sqlite", "env.tasks=mine.jsonl", override]
    result = CliRunner().invoke(app, [*args, "--run-dir", str(tmp_path / "runs" / "x")])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "runs").exists()


def test_presets_taken_as_env_names_are_listed(cli):
    """Issue 55, item 7: `--env sql_db_explore` works, but the name appeared neither in `agentopd envs` nor in the
    list an unknown env name is answered with."""
    result = cli("envs")
    assert result.exit_code == 0, result.output
    line = next(ln for ln in result.output.splitlines() if " sql_db_explore " in ln)
    assert "configs/sql_db_explore.yaml" in line and "a preset of sql_db (env.difficulty=[explore])" in line, line
    result = cli("run", "--env", "sql_db_explor")
    assert result.exit_code == 2 and "presets: sql_db_explore (a preset of sql_db)" in result.output, result.output


def test_export_of_a_missing_folder_says_it_is_missing(cli, tmp_path):
    """Issue 55, item 7: a checkpoint path that does not exist was blamed on a missing "DONE marker"; the error says
    the folder is missing and lists the finished checkpoints beside it."""
    result = cli("export", str(tmp_path / "runs" / "x" / "checkpoints" / "step_000020"), str(tmp_path / "out"))
    assert result.exit_code == 2 and "step_000020: no such folder" in result.output and "DONE" not in result.output, result.output
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "step_000050").mkdir(parents=True)
    (ckpts / "step_000050" / "DONE").write_text("50")
    result = cli("export", str(ckpts / "step_000020"), str(tmp_path / "out"))
    assert result.exit_code == 2 and "(the finished checkpoints there: step_000050)" in result.output, result.output


def test_the_consoles_read_columns_when_they_print(monkeypatch):
    """The module's consoles are made at import; a COLUMNS set later (a test's, a wrapper's) still sets their width
    (rich fixes the width it finds at creation: with pytest -n 2 the CLI was first imported under another test's
    COLUMNS=80, and every table of this file came out cut)."""
    from agentopd.cli import _Console

    monkeypatch.setenv("COLUMNS", "80")
    console = _Console()
    monkeypatch.setenv("COLUMNS", "250")
    assert console.width == 250
    assert _Console(width=100).width == 100  # a width given is kept
