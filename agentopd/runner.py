"""The OPD loop: set-up, then each step, eval and checkpoint, on either backend.

    runner = Runner(cfg, run_dir)          # cfg: agentopd.config.Config (resolved, validated)
    summary = runner.run(resume=False)     # summary.before / after / teacher eval results

Set-up (`_setup`) builds the run's parts, refusing a run that cannot work before any model loads: the plan of each
step's tasks (agentopd.plan), the teacher router (agentopd.routing), the backend (agentopd.backends), the bootstrap
stage (agentopd.run_models: the embedded models built on first use), the pair checks, the recipes
(agentopd.step.recipes, the teacher self-test among them), the memory plan, the store and the metrics log. A step (`_step`) is the chain of stages of
agentopd/step/: play -> score -> samples -> train -> sync -> report, each returning a typed value with its metrics
(docs/design.md 9 follows one step file by file). The runner keeps what lives across steps: the parts, the clocks
(phases, FLOPs totals) and the resume state. Every `eval.every` steps: greedy success on held-out tasks (and the
teacher's, before training). Every `run.checkpoint_every` steps and on Ctrl-C: a resumable checkpoint labelled with
the last step the trainer took; a stage that stops the run (`StopRun`: the teacher self-test's re-check) gets the same
checkpoint. At the end: `final/` (a Hugging Face folder) and the before/after evals.

Resume (`run(resume=True)`) continues after the newest finished checkpoint: the store and the
metrics (metrics.jsonl and TensorBoard) forget later steps, and since every episode's sampling
seeds derive from (run seed, step, slot, turn), the replayed steps play token for token what an
uninterrupted run plays. A Ray trainer group that lost a rank and restarted from its last checkpoint
(`TrainerRestarted`) is rewound the same way mid-run.

Memory: on CUDA the run's memory plan (agentopd.memory_plan) is made from the models' config.json
before any model loads; a run that cannot fit is refused there (MemoryPlanError, a ValueError), and the
plan sizes the fast engine's KV pool and decides engine.sleep. A CUDA out-of-memory later ends the run
with `OutOfMemory`: one line naming the phase (rollout, teacher, train, sync, eval), the plan, and a
checkpoint of the last step the trainer took where one can still be written.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoTokenizer

from agentopd.backends import make_backend
from agentopd.backends.base import BackendKind, TrainerRestarted
from agentopd.backends.stages import STUDENT
from agentopd.disk_plan import DiskPlan, checkpoint_failed, plan_disk
from agentopd.evaluate import EvalResult
from agentopd.interrupts import catch_ctrl_c, writes_uninterrupted
from agentopd.memory_plan import MemoryPlan, OutOfMemory, run_plan
from agentopd.metrics_log import MetricsLog
from agentopd.models import pick_device
from agentopd.objectives import Objective, teacher_evals, teacher_mode
from agentopd.plan import Mixture
from agentopd.policy import loss_temperature, rollout_config, score_temperature, trainer_config
from agentopd.progress import RunProgress
from agentopd.recipes.schedule import SftWarmStart
from agentopd.routing import Router
from agentopd.run_models import resolve_models
from agentopd.run_parts import check_pairs, cross_scorer, fit_memory, own_tokenizer_teachers, privileged_view, run_context
from agentopd.rundir import DONE, CheckpointError, RunDir
from agentopd.shape import ModelShape
from agentopd.step.evals import Evals
from agentopd.step.phases import Phases
from agentopd.step.play import Play, StudentEngines
from agentopd.step.recipes import run_recipes
from agentopd.step.report import FlopsMeter, report
from agentopd.step.score import score
from agentopd.step.selftest import TeacherSelfTest
from agentopd.step.train import prepare, sync, train
from agentopd.step.values import StepParts, StopRun
from agentopd.store import Store
from agentopd.teacher.base import is_server
from agentopd.trainer.config import LossKind
from agentopd.warm_start import choose_warm_start

if TYPE_CHECKING:
    from rich.console import Console

    from agentopd.config import Config
    from agentopd.recipes.base import Recipe


@dataclass
class RunSummary:
    run_dir: Path
    steps: int
    before: EvalResult | None = None
    after: EvalResult | None = None
    teacher: EvalResult | None = None
    interrupted: bool = False
    seconds: float = 0.0
    evals: list[dict[str, Any]] = field(default_factory=list)


def checkpoint_step(checkpoint: Path) -> int:
    """The step a finished checkpoint holds (its DONE marker)."""
    return int((checkpoint / DONE).read_text())


class Runner:
    """The run: its parts (models, backend, store, log), its clocks and its resume state; one step is the chain of
    stages of agentopd/step/ (`_step`)."""

    def __init__(self, cfg: Config, run_dir: str | Path, *, console: Console | None = None):
        self.cfg = cfg
        self.rd = RunDir(run_dir)
        self.run_dir = self.rd.root
        self.progress = RunProgress(console)
        self.phases = Phases(self.progress)  # the phase running now (what a CUDA out-of-memory names) and its memory
        self.memory_plan: MemoryPlan | None = None  # on CUDA: what each role holds per GPU and phase (agentopd.memory_plan)
        self.disk_plan: DiskPlan | None = None  # what the checkpoints and final/ take on disk (agentopd.disk_plan)
        self.recipes: list[Recipe] = []
        # the resume state: what a checkpoint, a rewind or an interruption needs
        self._trained_through = 0  # the last step whose optimizer step was taken (what a checkpoint holds)
        self._unlogged: tuple[int, dict[str, float]] | None = None  # a trained step's metrics not yet written
        self._stop_requested = False
        self._checkpointed = -1  # the step of the last checkpoint this process wrote

    # ---- set-up ---------------------------------------------------------------------------
    def _setup(self, resume_after: int | None) -> None:
        cfg = self.cfg
        world = os.environ.get("WORLD_SIZE", "1")
        if cfg.run.backend == BackendKind.LOCAL and world.isdigit() and int(world) > 1:
            raise ValueError(f"agentopd run under torchrun (WORLD_SIZE={world}): run.backend=local trains on one GPU, "
                             f"so each of the {world} processes would play its own run; for several GPUs launch it once "
                             "with run.backend=ray (configs/examples/qwen3-2gpu.yaml), which starts its trainer ranks itself")  # fmt: skip
        device, dtype = pick_device(cfg.run.device)
        torch.manual_seed(cfg.run.seed)
        random.seed(cfg.run.seed)
        mixture = Mixture.from_config(cfg)
        self.router = Router.from_config(cfg, mixture)  # a task without a teacher fails here, before any model
        self.backend = make_backend(cfg)
        self.backend.connect(cfg, self.router.refs)  # a run the backend cannot hold fails here, before any model
        self.trainer_cfg = trainer_config(cfg)
        with self.progress.phase("bootstrap", total=None):  # the bootstrap stage: embedded models built on first use
            models = resolve_models(cfg, mixture, self.router, progress=self.progress.bootstrap_callback, device=device)
        self.tokenizer = AutoTokenizer.from_pretrained(models.student)
        own = own_tokenizer_teachers(cfg, models, self.trainer_cfg.loss)  # SFT episodes of a teacher of another vocabulary
        if own:
            self.progress.note(f"teacher {', '.join(sorted(own))}: another tokenizer; it plays with its own, each episode "
                               "re-rendered in the student's template and tokens for SFT (agentopd.crosstok.retokenize)")
        check_pairs(cfg, models, cross=self.trainer_cfg.loss.is_cross_tokenizer or bool(own))  # before any model loads
        scorer = cross_scorer(cfg, models, self.tokenizer, self.trainer_cfg.loss)  # a recipe's refusal: before any model too
        view = privileged_view(cfg, mixture, self.tokenizer)
        self.memory_plan = run_plan(cfg, device, models.student, models.teachers)  # a run that cannot fit stops here
        # the trainer settings it fitted; on a CPU the same against this machine's memory (agentopd.memory_host)
        self.trainer_cfg, line, host_plan = fit_memory(cfg, models, device, self.memory_plan, self.trainer_cfg)
        if line:
            self.progress.note(line)
        shapes = {STUDENT: ModelShape.from_ref(models.student)} | {
            name: None if is_server(ref) else ModelShape.from_ref(ref) for name, ref in models.teachers.items()}
        self.rd.prune_checkpoints(keep=0)  # what a killed checkpoint write left (hidden folders) is not free space
        self.disk_plan = plan_disk(cfg, shapes[STUDENT], self.rd, start=resume_after or 0)
        self.disk_plan.check()  # checkpoints that cannot fit the disk: refused here, not when the first one is written
        if self.disk_plan.need_gib >= 1.0:
            self.progress.note(self.disk_plan.line())
        self.run_dir.mkdir(parents=True, exist_ok=True)  # only now: a run refused above leaves no directory behind
        self.progress.note(f"run directory: {self.run_dir}")  # printed once it exists (agentopd run removes it if no step ends)
        self.tokenizer.save_pretrained(self.rd.tokenizer)  # for the viewer, check-tokens and export
        rollout_cfg = rollout_config(cfg)
        ctx = run_context(cfg, mixture, models, self.trainer_cfg, rollout_cfg, device, dtype, self.tokenizer,
                               self.memory_plan, own_tokenizer=own, host_plan=host_plan)  # fmt: skip
        self.backend.setup(ctx, self.tokenizer)
        if self.memory_plan is not None and not (cfg.run.backend != BackendKind.LOCAL and cfg.async_.enabled):
            self.phases.measure_memory(self.backend, self.memory_plan, per_gpu=cfg.run.backend != BackendKind.LOCAL)
        selftest = TeacherSelfTest.for_run(cfg, self.tokenizer, models.student, device, ctx.inference_dtype(models.student),
                                           score_temperature(cfg), self.trainer_cfg.temperature)  # fmt: skip
        self.recipes = run_recipes(cfg, cross_scorer=scorer, privileged=view, selftest=selftest)
        if host_plan is not None and cfg.run.backend == BackendKind.LOCAL and not cfg.async_.enabled:
            self.phases.measure_host(host_plan)  # this process holds every model: its resident peak per phase
        self.store = Store(self.rd.db)
        self.flops = FlopsMeter(shapes)
        self.log = self._open_log(resume_after)
        self.parts = StepParts(cfg, self.backend, mixture, self.router, self.store, self.phases, self.recipes,
                               Objective(cfg.run.objective), teacher_mode(self.trainer_cfg.loss), rollout_cfg, shapes)  # fmt: skip
        self.engines = StudentEngines(self.parts)
        self.play = Play(self.parts, self.engines)
        self.evals = Evals(self.parts, self.engines, replace(rollout_cfg, temperature=cfg.eval.temperature), cfg.env.name)

    # ---- the loop -------------------------------------------------------------------------
    def run(self, resume: bool = False) -> RunSummary:
        t0 = time.perf_counter()
        ckpt = self._resume_point() if resume else None
        start = checkpoint_step(ckpt) if ckpt is not None else 0
        try:
            self._setup(resume_after=start if ckpt is not None else None)
        except torch.OutOfMemoryError as e:  # loading the models: nothing to checkpoint yet
            raise OutOfMemory(f"CUDA out of memory in the setup phase (loading the models): {_first_line(e)}{self._plan_table()}") from None
        self.cfg.to_yaml(self.rd.config)
        summary = RunSummary(self.run_dir, steps=self.cfg.run.steps)
        if ckpt is not None:
            extra = self.backend.load_checkpoint(ckpt)
            summary.evals = extra.get("evals", [])
            self.store.delete_after(start)
            self.backend.sync_weights()
            self._trained_through = start
            self.progress.note(f"resumed from {ckpt.name}: continuing at step {start + 1}")
        interrupted = False
        oom: OutOfMemory | None = None
        stopped: StopRun | None = None
        failed: CheckpointError | None = None
        restore = self._catch_ctrl_c()
        try:
            if start == 0:
                summary.before = self._eval(0, with_teacher=teacher_evals(self.cfg), summary=summary)
                summary.teacher = self.evals.teacher
                self._warm_start(summary)
            step = start + 1
            while step <= self.cfg.run.steps:
                try:
                    metrics = self._step(step)
                    if self.cfg.eval.every and step % self.cfg.eval.every == 0 and step != self.cfg.run.steps:
                        self._eval(step, with_teacher=False, summary=summary, metrics=metrics)
                    if step == self.cfg.run.steps:
                        summary.after = self._eval(step, with_teacher=False, summary=summary, metrics=metrics)
                    self._write(step, metrics)
                    self.progress.step_line(step, self.cfg.run.steps, metrics)
                    if self._stop_requested and step < self.cfg.run.steps:
                        self._checkpoint(step, summary)
                        self.progress.note(f"stopped: checkpoint at step {step}; continue with --resume")
                        interrupted = True
                        break
                    if self.cfg.run.checkpoint_every and step % self.cfg.run.checkpoint_every == 0:
                        self._checkpoint(step, summary)
                except TrainerRestarted as restart:  # Ray: a trainer rank died, its group restarted from a checkpoint
                    step = self._rewind(restart, summary)
                    continue
                step += 1
        except KeyboardInterrupt:  # a second Ctrl-C: stop now, keep what the trainer has
            interrupted = True
            try:
                last, _ = self._save_trained(start, summary)
                self.progress.note(f"interrupted: checkpoint at step {last}; continue with --resume")
            except CheckpointError as e:
                failed = e
        except CheckpointError as e:  # a checkpoint the disk could not take: the run stops, the last good one stays
            interrupted, failed = True, e
        except torch.OutOfMemoryError as e:
            interrupted, oom = True, self._out_of_memory(e, start, summary)
        except StopRun as e:  # a stage stopped the run (the self-test's re-check): a checkpoint of what the trainer has
            interrupted, stopped = True, type(e)(f"{e}{self._stop_checkpoint(start, summary)}")
        except BaseException:  # any other error (a refused teacher, a bug): engines, workers and recipes close first
            self._close(summary, interrupted=True, t0=t0)
            raise
        finally:
            restore()
            self.log.close()
        try:
            if not interrupted:
                if self._checkpointed != self.cfg.run.steps:  # run.checkpoint_every may have written the last step already
                    self._checkpoint(self.cfg.run.steps, summary)
                self.backend.export(self.rd.final, self.tokenizer)
        finally:
            self._close(summary, interrupted=interrupted, t0=t0)
        if oom is not None:
            raise oom
        if stopped is not None:
            raise stopped
        if failed is not None:
            raise failed
        return summary

    def _close(self, summary: RunSummary, *, interrupted: bool, t0: float) -> None:
        summary.interrupted = interrupted
        summary.seconds = time.perf_counter() - t0
        self.progress.close()
        self.backend.close()
        for recipe in self.recipes:
            recipe.close()

    def _step(self, step: int) -> dict[str, float]:
        """One step: play -> score -> samples -> train -> sync -> report (agentopd/step/, docs/design.md 9)."""
        played = self.play(step)
        scored = score(played, self.parts)
        samples = prepare(played, scored, self.parts)
        trained = train(samples, self.parts)
        self._trained_through, self._unlogged = step, (step, trained.metrics)  # a checkpoint now holds this step
        synced = sync(played, self.parts, self.engines)
        metrics = report(played, scored, samples, trained, synced, self.parts, self.flops)
        self._unlogged = (step, metrics)
        return metrics

    def _warm_start(self, summary: RunSummary) -> None:
        """recipe.auto_warm_start (agentopd.warm_start): from the step-0 evals, SFT steps first for a cold student. The
        choice is printed; a warm start goes into the run's config.yaml (recipe.sft_steps), which a resume reads."""
        choice = choose_warm_start(self.cfg, summary.before, summary.teacher)
        if choice is None:
            return
        self.progress.note(choice.line())
        if choice.steps:
            self.cfg.recipe.sft_steps = choice.steps
            self.parts.recipes.insert(0, SftWarmStart(choice.steps, self.parts.objective, loss_temperature(self.cfg, LossKind.SFT)))
            self.cfg.to_yaml(self.rd.config)

    def _eval(self, step: int, *, with_teacher: bool, summary: RunSummary, metrics: dict[str, float] | None = None) -> EvalResult:
        """An eval step (agentopd.step.evals): its record joins the step's metrics (with the eval's mem/*), or is
        written alone before training."""
        result, record = self.evals(step, with_teacher=with_teacher)
        summary.evals.append({"step": step, **record})
        if metrics is not None:
            metrics.update(record | self.phases.take_memory())
        else:
            self.log.write(step, record)
        teacher = self.evals.teacher if with_teacher else None
        self.progress.note(f"eval @ step {step}: student success {result.success_rate:.0%}"
                           + (f", teacher {teacher.success_rate:.0%}" if teacher else ""))  # fmt: skip
        for who, r in (("student", result), ("teacher", teacher)):
            if r is not None and (note := r.timeout_note(self.evals.rollout_cfg)) is not None:
                self.progress.note(f"warning: the {who}'s eval: {note}")
        return result

    # ---- resume, rewind, checkpoints, interruptions -----------------------------------------
    def _resume_point(self) -> Path:
        ckpt = self.rd.latest_checkpoint()
        if ckpt is None:
            raise ValueError(f"--resume: no finished checkpoint under {self.rd.checkpoints}")
        if checkpoint_step(ckpt) >= self.cfg.run.steps:
            raise ValueError(f"--resume: {self.run_dir} already finished its {self.cfg.run.steps} steps (raise steps= to train on)")
        return ckpt

    def _rewind(self, restart: TrainerRestarted, summary: RunSummary) -> int:
        """The trainer went back to the checkpoint of `restart.step`: forget later steps (store, metrics,
        evals, rollouts submitted ahead), give the engines those weights; the step to play next."""
        while True:
            step = restart.step
            self.progress.note(f"{restart}: continuing at step {step + 1}")
            self.store.delete_after(step)
            self.log.close()
            self.log = self._open_log(resume_after=step)
            self.play.forget()
            summary.evals = [e for e in summary.evals if e["step"] <= step]
            self._trained_through, self._unlogged = step, None
            try:
                self.backend.sync_weights()
                return step + 1
            except TrainerRestarted as again:
                restart = again

    def _open_log(self, resume_after: int | None) -> MetricsLog:
        """The metrics log, after `resume_after` when resuming (later steps forgotten); the cumulative FLOPs of the
        steps it keeps are read back from it."""
        log = self.cfg.log
        metrics = MetricsLog(self.rd, tensorboard=log.tensorboard, wandb=log.wandb, mlflow=log.mlflow, resume_after=resume_after)
        self.flops.resume(metrics.read() if resume_after is not None else ())
        return metrics

    def _write(self, step: int, metrics: dict[str, float]) -> None:
        self.log.write(step, metrics)
        self._unlogged = None

    def _checkpoint(self, step: int, summary: RunSummary) -> None:
        """Save the trainer's state as step `step`; a Ctrl-C meanwhile waits until the files are on disk. A write that
        fails leaves no part of it (agentopd.rundir.write_checkpoint) and raises CheckpointError, one line; once it is
        complete, the finished checkpoints beyond run.keep_checkpoints are removed."""
        with writes_uninterrupted(lambda: self.progress.note("Ctrl-C: finishing the checkpoint first")):
            try:
                self.backend.save_checkpoint(self.rd.checkpoint(step), {"step": step, "evals": summary.evals})
            except (TrainerRestarted, KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # a full disk, an I/O error, a rank that failed to write: said in one line (DCP's
                raise checkpoint_failed(self.rd, step, e, self.disk_plan) from e  # CheckpointException is a BaseException)
        self._checkpointed = step
        self.rd.prune_checkpoints(self.cfg.run.keep_checkpoints)

    def _catch_ctrl_c(self) -> Callable[[], None]:
        """First Ctrl-C: finish the running step, checkpoint it, stop. A second one stops at once
        (KeyboardInterrupt: the trainer's last step is checkpointed). Returns the undo."""

        def on_first() -> None:
            self._stop_requested = True
            self.progress.note("Ctrl-C: stopping after this step (Ctrl-C again to stop now)")

        return catch_ctrl_c(on_first)

    def _out_of_memory(self, error: BaseException, start: int, summary: RunSummary) -> OutOfMemory:
        """The one-line error of a CUDA out-of-memory, after a checkpoint of the last trained step where possible."""
        phase, last = self.phases.now, self._trained_through
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        saved = ""
        if last > start and self._checkpointed != last:
            try:
                self._checkpoint(last, summary)
                saved = f"; checkpoint at step {last} (continue with --resume)"
            except Exception as again:  # noqa: BLE001 - the checkpoint is a courtesy; the OOM is the error
                saved = f"; {again}" if isinstance(again, CheckpointError) else f"; no checkpoint ({type(again).__name__})"
        elif self._checkpointed >= 0:
            saved = f"; last checkpoint at step {self._checkpointed}"
        when = f"the eval after step {last}" if phase == "eval" else f"step {last + 1}"
        return OutOfMemory(f"CUDA out of memory in the {phase} phase ({when}){saved}: {_first_line(error)}{self._plan_table()}")

    def _save_trained(self, start: int, summary: RunSummary) -> tuple[int, bool]:
        """A run stopping mid-way: the last step's metrics logged and a checkpoint of the last step the trainer took (its
        update is in the weights, so it must not be replayed; a step stopped before its optimizer step is replayed on
        resume), unless this process trained nothing or it is written already. (that step, whether it was written now)"""
        last = self._trained_through
        if self._unlogged is not None:
            self._write(*self._unlogged)
        if last > start and self._checkpointed != last:
            self._checkpoint(last, summary)
            return last, True
        return last, False

    def _stop_checkpoint(self, start: int, summary: RunSummary) -> str:
        """A checkpoint of the last step the trainer took, where there is one to write; what to say about it."""
        last, written = self._save_trained(start, summary)
        if written:
            return f"; checkpoint at step {last} (continue with --resume once the teacher is fixed)"
        return f"; last checkpoint at step {self._checkpointed}" if self._checkpointed >= 0 else "; no step was trained"

    def _plan_table(self) -> str:
        return f"\n{self.memory_plan.table()}" if self.memory_plan is not None else ""


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path) -> None:
    """A checkpoint of a run (`<run>/checkpoints/step_N`) as a Hugging Face folder with the run's tokenizer."""
    from agentopd.rundir import is_done
    from agentopd.trainer import export_checkpoint as export_trainer_checkpoint

    ckpt = Path(checkpoint_dir)
    if not ckpt.is_dir():
        there = sorted(p.name for p in ckpt.parent.glob("step_*") if is_done(p)) if ckpt.parent.is_dir() else []
        raise ValueError(f"{ckpt}: no such folder" + (f" (the finished checkpoints there: {', '.join(there)})" if there else ""))
    if not is_done(ckpt):
        raise ValueError(f"{ckpt} is not a finished checkpoint of a run (no {DONE} marker)")
    run = RunDir.of_checkpoint(ckpt)
    if not (run.tokenizer / "tokenizer_config.json").exists():
        raise ValueError(f"{run.root} has no tokenizer/ folder: is {ckpt} inside a run directory?")
    export_trainer_checkpoint(ckpt, out_dir, AutoTokenizer.from_pretrained(run.tokenizer))
