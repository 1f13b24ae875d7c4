"""The `agentopd` command line (DESIGN 3.4).

    agentopd envs                                   # installed environments, plugins included
    agentopd tools                                  # installed tools (a class expands to its methods)
    agentopd check-env sql_db env.max_turns=4       # the env checker; exit 1 when a check fails

Adding a command: write a function and decorate it with `@command()` (below). Typer builds
the options from the signature; `ValueError` raised anywhere inside (a bad override, an
unknown env, a malformed file: user mistakes by this project's convention) prints one red
line and exits 2, with no traceback. Keep commands thin: parse, call the library, print.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

app = typer.Typer(
    name="agentopd",
    help="On-policy distillation of multi-turn, tool-using LLM agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])
EXIT_USAGE = 2  # bad input: unknown env, bad override, missing file

Overrides = Annotated[
    list[str] | None,
    typer.Argument(help="dotted overrides on top of configs/<env>.yaml, e.g. env.max_turns=4", show_default=False),
]


def command(name: str | None = None, **kwargs: Any) -> Callable[[F], F]:
    """Register a CLI command whose ValueErrors become one-line errors with exit code 2."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kw: Any) -> Any:
            try:
                return fn(*args, **kw)
            except ValueError as e:
                err_console.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
                raise typer.Exit(EXIT_USAGE) from None

        app.command(name, **kwargs)(wrapper)
        return fn

    return decorate


def _table(title: str, *columns: str) -> Table:
    """A table whose cells fold instead of being cut short, so nothing is hidden on narrow terminals."""
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col, overflow="fold")
    return table


def _plugin_errors_table(group: str) -> Table | None:
    from agentopd import registry

    broken = [p for p in registry.errors() if p.group == group]
    if not broken:
        return None
    table = _table("[red]failed to load[/]", "name", "package", "entry point", "error")
    for p in broken:
        table.add_row(p.name, p.package, p.value, f"[red]{escape(p.error or '')}[/]")
    return table


@command("envs")
def envs_command() -> None:
    """List the installed environments (built-ins and plugins)."""
    from agentopd import registry

    table = _table("environments (entry points: agentopd.envs)", "name", "package", "entry point", "description")
    for name, p in sorted(registry.envs().items()):
        table.add_row(name, p.package, p.value, escape(registry.describe(p.obj)))
    console.print(table)
    if (broken := _plugin_errors_table(registry.ENV_GROUP)) is not None:
        console.print(broken)


@command("tools")
def tools_command() -> None:
    """List the installed tools (a class entry point lists each of its tools)."""
    from agentopd import registry

    table = _table("tools (entry points: agentopd.tools)", "name", "package", "entry point", "description")
    for t in sorted(registry.tool_entries(), key=lambda t: t.name):
        table.add_row(t.name, t.package, t.plugin.value, escape(t.description))
    console.print(table)
    if (broken := _plugin_errors_table(registry.TOOL_GROUP)) is not None:
        console.print(broken)


@command("check-env")
def check_env_command(
    name: Annotated[str, typer.Argument(help="a registered env (see `agentopd envs`)")],
    overrides: Overrides = None,
    fuzz_steps: Annotated[int, typer.Option(help="how many malformed actions to try")] = 1000,
    oracle_tasks: Annotated[int, typer.Option(help="how many tasks' oracle solutions to grade")] = 20,
) -> None:
    """Run the environment checker on one env; exit 1 when a check fails."""
    from agentopd.checker import Status, check_env
    from agentopd.config import load_config

    cfg = load_config(name, overrides=overrides or [])
    report = check_env(cfg.env.name, fuzz_steps=fuzz_steps, oracle_tasks=oracle_tasks, **cfg.env.kwargs)
    style = {Status.PASS: "green", Status.FAIL: "bold red", Status.SKIP: "yellow"}
    table = _table(f"check-env {report.env}", "check", "result", "detail")
    for c in report.checks:
        table.add_row(c.name, f"[{style[c.status]}]{c.status.value}[/]", escape(c.detail))
    console.print(table)
    if not report.ok:
        err_console.print(f"[bold red]{len(report.failed)} check(s) failed:[/] {', '.join(c.name for c in report.failed)}")
        raise typer.Exit(1)
    console.print(f"[green]{report.env}: all checks passed[/]")


def main() -> None:
    """Console-script entry point."""
    app(prog_name="agentopd")


if __name__ == "__main__":
    sys.exit(main())
