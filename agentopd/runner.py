"""The OPD loop: plan -> play -> score -> train -> sync -> eval -> checkpoint, on either backend.

    runner = Runner(cfg, run_dir)          # cfg: agentopd.config.Config (resolved, validated)
    summary = runner.run(resume=False)     # summary.before / after / teacher eval results

Every step: the plan (agentopd.plan) picks `rollout.tasks_per_step` training tasks, a pure function
of seed and step, so a resumed run sees the same data; the backend (agentopd.backends) plays
`rollout.n` episodes of each with the student's engine — or the teacher's, when the objective
says the teacher plays (agentopd.objectives) — and each episode is written to `trajectories.db`
as it finishes; the teachers the router (agentopd.routing) picks score them; the trainer takes one
optimizer step; the new weights go to the engines; the docs/design.md 3.6 metrics are logged. Every
`eval.every` steps: greedy success on held-out tasks (and the teacher's, before training). Every
`run.checkpoint_every` steps and on Ctrl-C: a resumable checkpoint labelled with the last step
the trainer took. At the end: `final/` (a Hugging Face folder) and the before/after evals.

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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoTokenizer

from agentopd.backends import make_backend
from agentopd.backends.base import BackendKind, RolloutHandle, TrainerRestarted
from agentopd.backends.stages import STUDENT, OnEpisode, RunContext, score_episodes
from agentopd.config.schema import Stale
from agentopd.diagnostics import phase_metrics, step_metrics, teacher_work
from agentopd.evaluate import EvalResult, summarise
from agentopd.flops import ModelShape, played_flops, step_flops
from agentopd.interrupts import catch_ctrl_c, writes_uninterrupted
from agentopd.memory_plan import MemoryPlan, OutOfMemory, Phase, run_plan
from agentopd.metrics_log import MetricsLog
from agentopd.models import pick_device, resolve_student
from agentopd.objectives import Objective, teacher_mode
from agentopd.pair import RUN_CHECKS, require_pair
from agentopd.plan import Mixture, Planned
from agentopd.policy import loss_temperature, rollout_config, trainer_config
from agentopd.privileged import PrivilegedView
from agentopd.progress import RunProgress
from agentopd.recipes.horizon import horizon, horizon_rollout
from agentopd.recipes.turn_weights import step_turn_weights
from agentopd.routing import Router
from agentopd.rundir import DONE, RunDir
from agentopd.samples import train_samples
from agentopd.store import Store
from agentopd.teacher.base import is_server
from agentopd.types import PLAYED_BY, Episode, PlayedBy

if TYPE_CHECKING:
    from rich.console import Console

    from agentopd.config import Config
    from agentopd.crosstok.score import CrossScorer
    from agentopd.rollout import RolloutConfig
    from agentopd.teacher import TeacherScores


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
    def __init__(self, cfg: Config, run_dir: str | Path, *, console: Console | None = None):
        self.cfg = cfg
        self.rd = RunDir(run_dir)
        self.run_dir = self.rd.root
        self.objective = Objective(cfg.run.objective)
        self.progress = RunProgress(console)
        self.env_name = cfg.env.name  # the run's label: one env, or the sources of a mixed run joined by commas
        self._pending: dict[int, list[RolloutHandle]] = {}  # async mode: step -> rollouts already submitted
        self._engine_stale = False  # the teacher played this step (objective=sft): sync before the student plays
        self._teacher_played: dict[int, set[str]] = {}  # step -> its episodes the teacher played (recipe.teacher_fraction)
        self._trained_through = 0  # the last step whose optimizer step was taken (what a checkpoint holds)
        self._unlogged: tuple[int, dict[str, Any]] | None = None  # a trained step's metrics not yet written
        self._stop_requested = False
        self._checkpointed = -1  # the step of the last checkpoint this process wrote
        self._teacher_result: EvalResult | None = None
        self.phase = "setup"  # the phase running now (what a CUDA out-of-memory names)
        self.plan: MemoryPlan | None = None  # on CUDA: the memory plan (agentopd.memory_plan)
        self._mem: dict[str, float] = {}  # measured peaks per phase since the last step's metrics (_in_phase)
        self._cross_metrics: dict[str, float] = {}  # the step's alignment metrics (a cross-tokenizer loss)
        self.cross_scorer: CrossScorer | None = None  # a cross-tokenizer loss: teacher scoring through the alignment
        self.privileged: PrivilegedView | None = None  # teacher.privileged: the streams the teacher scores instead
        self.shapes: dict[str, ModelShape | None] = {}  # student and teachers by name: their FLOPs per token (None: a server)
        self._scored: list[tuple[str, int]] = []  # the step's scored streams: (teacher, length), for flops/teacher_score
        self._scored_ahead = 0.0  # the share of the step's scores the backend started ahead (async.score_ahead)
        self._flops_cum = {"teacher": 0.0, "student": 0.0}  # flops/teacher_cum, flops/student_cum so far

    # ---- set-up ---------------------------------------------------------------------------
    def _setup(self, resume_after: int | None) -> None:
        cfg = self.cfg
        world = os.environ.get("WORLD_SIZE", "1")
        if cfg.run.backend == BackendKind.LOCAL and world.isdigit() and int(world) > 1:
            raise ValueError(f"agentopd run under torchrun (WORLD_SIZE={world}): run.backend=local trains on one GPU, "
                             f"so each of the {world} processes would play its own run; for several GPUs launch it once "
                             "with run.backend=ray (configs/examples/qwen3-2gpu.yaml), which starts its trainer ranks itself")  # fmt: skip
        self.device, self.dtype = pick_device(cfg.run.device)
        torch.manual_seed(cfg.run.seed)
        random.seed(cfg.run.seed)
        self.mixture = Mixture.from_config(cfg)
        self.router = Router.from_config(cfg, self.mixture)  # a task without a teacher fails here, before any model
        self.backend = make_backend(cfg)
        self.backend.connect(cfg, self.router.refs)  # a run the backend cannot hold fails here, before any model
        self.trainer_cfg = trainer_config(cfg)
        self.mode = teacher_mode(self.trainer_cfg.loss)
        with self.progress.phase("bootstrap", total=None):
            kwargs = next(iter(self.mixture.sources.values())).kwargs if not self.mixture.mixed else None
            size = cfg.embedded.size  # built on the run's device (a tiny pair: on the CPU, always)
            student_ref = resolve_student(cfg.student.path, self.mixture.env_names, mixed=self.mixture.mixed,
                                          progress=self.progress.bootstrap_callback, env_kwargs=kwargs, size=size, device=self.device)  # fmt: skip
            teacher_refs = self.router.resolve(self.progress.bootstrap_callback, student=student_ref, size=size, device=self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(student_ref)
        cross = self.trainer_cfg.loss.is_cross_tokenizer
        for ref in teacher_refs.values():  # the cheap parts of `agentopd check-pair`: vocabulary, chat template
            if not is_server(ref):  # a server's tokenizer is the user's promise (its echo of the ids is checked)
                thinking = cfg.rollout.enable_thinking  # the run renders with it: so does the check
                require_pair(student_ref, ref, checks=("max_context",) if cross else RUN_CHECKS,
                             template_kwargs=None if thinking is None else {"enable_thinking": thinking},
                             teacher_template=cfg.teacher.chat_template)
        # a cross-tokenizer loss: each teacher reads the episodes re-rendered in its own template (agentopd.crosstok)
        if cross:
            from agentopd.crosstok.score import CrossScorer
            from agentopd.trainer.config import LossKind

            teacher_toks = {name: AutoTokenizer.from_pretrained(cfg.teacher.tokenizer if is_server(ref) else ref)
                            for name, ref in teacher_refs.items()}  # a server's: teacher.tokenizer (policy.check_run)
            self.cross_scorer = CrossScorer(self.tokenizer, teacher_toks, full=self.trainer_cfg.loss == LossKind.XTOK_FULL)
        if cfg.teacher.privileged is not None:  # every env must give the context: checked here, before any model
            self.privileged = PrivilegedView(self.mixture, self.tokenizer, cfg.teacher.privileged)
            self.privileged.check()
        self.plan = run_plan(cfg, self.device, student_ref, teacher_refs)  # a run that cannot fit stops here, before any model
        self.shapes = {STUDENT: ModelShape.from_ref(student_ref)} | {
            name: None if is_server(ref) else ModelShape.from_ref(ref) for name, ref in teacher_refs.items()}
        self.run_dir.mkdir(parents=True, exist_ok=True)  # only now: a run refused above leaves no directory behind
        self.progress.note(f"run directory: {self.run_dir}")  # printed once it exists (agentopd run removes it if no step ends)
        self.tokenizer.save_pretrained(self.rd.tokenizer)  # for the viewer, check-tokens and export
        self.rollout_cfg = rollout_config(cfg)
        self.eval_rollout_cfg = replace(self.rollout_cfg, temperature=cfg.eval.temperature)
        self.ctx = RunContext(cfg, self.mixture, student_ref, teacher_refs, self.trainer_cfg, self.rollout_cfg, self.device, self.dtype,
                              vocab_size=len(self.tokenizer))
        from agentopd.engines import EngineKind, resolve_kind

        sleeps = resolve_kind(cfg.engine.kind, self.device) != EngineKind.VLLM  # vLLM sizes its own memory
        if self.plan is not None:
            self.ctx.kv_cache_gib = self.plan.kv_cache_gib
            self.ctx.engine_sleep = self.plan.engine_sleep and sleeps
            self.ctx.teacher_offload = self.plan.teacher_offload
        else:  # CPU: no plan; engine.sleep=true still does what it says
            self.ctx.engine_sleep = cfg.engine.sleep is True and sleeps
            self.ctx.teacher_offload = cfg.teacher.offload is not False
        self.backend.setup(self.ctx, self.tokenizer)
        self.store = Store(self.rd.db)
        self.log = self._open_log(resume_after)

    # ---- the loop -------------------------------------------------------------------------
    def run(self, resume: bool = False) -> RunSummary:
        t0 = time.perf_counter()
        ckpt = self._resume_point() if resume else None
        start = checkpoint_step(ckpt) if ckpt is not None else 0
        try:
            self._setup(resume_after=start if ckpt is not None else None)
        except torch.OutOfMemoryError as e:  # loading the models: nothing to checkpoint yet
            plan = f"\n{self.plan.table()}" if self.plan is not None else ""
            raise OutOfMemory(f"CUDA out of memory in the setup phase (loading the models): {_first_line(e)}{plan}") from None
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
        restore = self._catch_ctrl_c()
        try:
            if start == 0:
                # a teacher with another tokenizer cannot play in the student's engines: it only scores
                with_teacher = self.cfg.eval.teacher and not self.trainer_cfg.loss.is_cross_tokenizer
                summary.before = self._eval(0, with_teacher=with_teacher, summary=summary)
                summary.teacher = self._teacher_result
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
            # the checkpoint is labelled with the last step the trainer took (its update is in the weights, so
            # it must not be replayed); a step interrupted before its optimizer step is replayed on resume
            last = self._trained_through
            if self._unlogged is not None:
                self._write(*self._unlogged)
            if last > start and self._checkpointed != last:
                self._checkpoint(last, summary)
            self.progress.note(f"interrupted: checkpoint at step {last}; continue with --resume")
        except torch.OutOfMemoryError as e:
            interrupted, oom = True, self._out_of_memory(e, start, summary)
        finally:
            restore()
            self.log.close()
        try:
            if not interrupted:
                if self._checkpointed != self.cfg.run.steps:  # run.checkpoint_every may have written the last step already
                    self._checkpoint(self.cfg.run.steps, summary)
                self.backend.export(self.rd.final, self.tokenizer)
        finally:
            summary.interrupted = interrupted
            summary.seconds = time.perf_counter() - t0
            self.progress.close()
            self.backend.close()
            if self.privileged is not None:
                self.privileged.close()
        if oom is not None:
            raise oom
        return summary

    @contextmanager
    def _in_phase(self, name: str, total: int | None = None) -> Iterator[Callable[[], None]]:
        """The progress phase `name`, remembered as the phase running now. Where the run has a memory plan (CUDA) and
        its phases do not overlap (not async on Ray): the phase's peak memory per GPU beside the plan's prediction,
        reported with the next step's metrics: `mem/<phase>_peak_gib` (reserved by the caching allocator: what the
        GPU holds, blocks cached from earlier phases included), `mem/<phase>_alloc_gib` (held in tensors: what the
        plan models), `mem/<phase>_alloc_retries` (the caching allocator's failed-and-retried cudaMallocs: stalls of a
        GPU run near its memory) and `mem/<phase>_plan_gib` on the local backend (its one GPU);
        `mem/gpu<g>_<phase>_...` per GPU of the plan on Ray."""
        self.phase = name
        overlap = self.cfg.run.backend != BackendKind.LOCAL and self.cfg.async_.enabled
        measure = self.plan is not None and not overlap
        if measure:
            self.backend.memory_peaks()  # resets them
        with self.progress.phase(name, total=total) as advance:
            yield advance
        if measure:
            local = self.cfg.run.backend == BackendKind.LOCAL
            for gpu, measured in self.backend.memory_peaks().items():
                key = f"mem/{name}" if local else f"mem/gpu{gpu}_{name}"
                self._mem[f"{key}_peak_gib"] = measured.reserved
                self._mem[f"{key}_alloc_gib"] = measured.allocated
                self._mem[f"{key}_alloc_retries"] = float(measured.retries)
                self._mem[f"{key}_plan_gib"] = self.plan.peak(gpu, Phase(name))

    def _out_of_memory(self, error: BaseException, start: int, summary: RunSummary) -> OutOfMemory:
        """The one-line error of a CUDA out-of-memory, after a checkpoint of the last trained step where possible."""
        phase, last = self.phase, self._trained_through
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        saved = ""
        if last > start and self._checkpointed != last:
            try:
                self._checkpoint(last, summary)
                saved = f"; checkpoint at step {last} (continue with --resume)"
            except Exception as again:  # noqa: BLE001 - the checkpoint is a courtesy; the OOM is the error
                saved = f"; no checkpoint ({type(again).__name__})"
        elif self._checkpointed >= 0:
            saved = f"; last checkpoint at step {self._checkpointed}"
        plan = f"\n{self.plan.table()}" if self.plan is not None else ""
        when = f"the eval after step {last}" if phase == "eval" else f"step {last + 1}"
        return OutOfMemory(f"CUDA out of memory in the {phase} phase ({when}){saved}: {_first_line(error)}{plan}")

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
            self.backend.forget([h for handles in self._pending.values() for h in handles])
            self._pending.clear()
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
        self._flops_cum = {"teacher": 0.0, "student": 0.0}
        if resume_after is not None:
            for record in metrics.read():
                for who in self._flops_cum:
                    self._flops_cum[who] += record.get(f"flops/{who}", 0.0)
        return metrics

    def _write(self, step: int, metrics: dict[str, Any]) -> None:
        self.log.write(step, metrics)
        self._unlogged = None

    def _catch_ctrl_c(self) -> Callable[[], None]:
        """First Ctrl-C: finish the running step, checkpoint it, stop. A second one stops at once
        (KeyboardInterrupt: the trainer's last step is checkpointed). Returns the undo."""

        def on_first() -> None:
            self._stop_requested = True
            self.progress.note("Ctrl-C: stopping after this step (Ctrl-C again to stop now)")

        return catch_ctrl_c(on_first)

    # ---- one step -------------------------------------------------------------------------
    def _objective(self, step: int) -> Objective:
        """The objective in force at `step`: SFT during the warm start (recipe.sft_steps), then the run's."""
        return Objective.SFT if step <= self.cfg.recipe.sft_steps else self.objective

    def _horizon(self, step: int) -> int | None:
        """The turn horizon of `step` (recipe.horizon_turns), else None."""
        r = self.cfg.recipe
        return None if r.horizon_turns is None else horizon(step, steps=self.cfg.run.steps, start=r.horizon_turns[0], end=r.horizon_turns[1])

    def _train_rollout(self, step: int) -> RolloutConfig:
        """The rollout settings of `step`'s training episodes: at most k turns under recipe.horizon_turns."""
        k = self._horizon(step)
        return self.rollout_cfg if k is None else horizon_rollout(self.rollout_cfg, k)

    def _submit(self, step: int) -> list[RolloutHandle]:
        """`step`'s rollouts, submitted; in async mode (async.score_ahead) their scoring too, started as each is played."""
        handles = self._submit_rollouts(step)
        if self._scores_ahead() and self._objective(step).scores:
            for h in handles:
                self.backend.score_ahead(h, [self.router.teacher_of(p) for p in h.planned], self.mode)
        return handles

    def _scores_ahead(self) -> bool:
        """Teacher scoring can start before the driver sees the episodes: the teacher scores the student's own token
        stream (no privileged prompt, no re-rendering for another tokenizer, no branches of recipe.intervene_below)."""
        cfg = self.cfg
        return (cfg.async_.enabled and cfg.async_.score_ahead and self.privileged is None and self.cross_scorer is None
                and cfg.recipe.intervene_below is None)  # fmt: skip

    def _submit_rollouts(self, step: int) -> list[RolloutHandle]:
        cfg = self.cfg
        planned = self.mixture.plan(step, tasks_per_step=cfg.rollout.tasks_per_step, n=cfg.rollout.n, seed=cfg.run.seed,
                                    policy_version=self.backend.policy_version)  # fmt: skip
        config = self._train_rollout(step)
        if self._objective(step).teacher_plays:  # each task's teacher plays it
            return self._teachers_play(planned, config)
        if self._engine_stale:  # the warm start is over: the student plays with the weights it trained
            self.backend.sync_weights()
            self._engine_stale = False
        # GKD's lambda: the first share of the step's tasks (a random draw already) is the teachers'
        k = cfg.rollout.n * round(cfg.recipe.teacher_fraction * (len(planned) // cfg.rollout.n))
        self._teacher_played[step] = {p.spec.episode_id for p in planned[:k]}
        student = planned[k:]
        return self._teachers_play(planned[:k], config) + [self.backend.submit_rollout(student, config, STUDENT)]

    def _teachers_play(self, planned: Sequence[Planned], config: RolloutConfig) -> list[RolloutHandle]:
        return [self.backend.submit_rollout(group, config, who) for who, group in self._by_teacher(planned).items()]

    def _by_teacher(self, planned: Sequence[Planned], split: str = "train") -> dict[str, list[Planned]]:
        out: dict[str, list[Planned]] = {}
        for p in planned:
            out.setdefault(self.router.teacher_of(p, split), []).append(p)
        return out

    def _collect(self, handles: list[RolloutHandle], on_episode: OnEpisode | None) -> tuple[list[Planned], list[Episode]]:
        planned, episodes = [], []
        for handle in handles:
            episodes += self.backend.collect(handle, on_episode)
            planned += handle.planned
        return planned, episodes

    def _rollout(self, step: int, advance: Callable[[], None]) -> tuple[list[Planned], list[Episode], dict[str, float], list[RolloutHandle]]:
        """This step's episodes (stored as they arrive) and the rollouts whose scores `_score` may take from the backend
        (async.score_ahead; none when staleness changed the episodes); in async mode the next steps' rollouts are
        submitted first."""
        cfg = self.cfg
        handles = self._pending.pop(step, None) or self._submit(step)
        if cfg.async_.enabled:
            for ahead in range(step + 1, min(step + cfg.async_.max_staleness, cfg.run.steps) + 1):
                if ahead not in self._pending:
                    self._pending[ahead] = self._submit(ahead)

        teacher_played = self._teacher_played.get(step, set())

        def on_episode(p: Planned, ep: Episode) -> None:
            if p.spec.episode_id in teacher_played:
                ep.info[PLAYED_BY] = PlayedBy.TEACHER  # recipe.teacher_fraction: shown as such in the store and viewer
            self.store.add(ep, p.spec.episode_id, split="train", teacher=self._teacher_name(p))
            advance()

        planned, episodes = self._collect(handles, on_episode)
        stats: dict[str, float] = {}
        if cfg.async_.enabled:
            planned, episodes, stats = self._bound_staleness(planned, episodes, on_episode)
            if stats["async/dropped"] or stats["async/regenerated"]:  # the step's episodes changed: scored by _score
                self.backend.forget(handles)
                handles = []
        return planned, episodes, stats, handles

    def _bound_staleness(self, planned: list[Planned], episodes: list[Episode], on_episode: OnEpisode):
        """Episodes older than async.max_staleness policy versions are dropped or re-generated now."""
        cfg = self.cfg.async_
        version = self.backend.policy_version
        staleness = [version - e.policy_version for e in episodes]
        stale = [i for i, s in enumerate(staleness) if s > cfg.max_staleness]
        stats = {"async/staleness_mean": sum(staleness) / max(len(staleness), 1), "async/staleness_max": float(max(staleness, default=0)),
                 "async/dropped": 0.0, "async/regenerated": 0.0}  # fmt: skip
        if not stale:
            return planned, episodes, stats
        if cfg.stale == Stale.REGENERATE:
            redo = [Planned(planned[i].source, replace(planned[i].spec, policy_version=version)) for i in stale]
            config = self._train_rollout(redo[0].spec.step)  # one step's episodes
            fresh = self._collect([self.backend.submit_rollout(redo, config, STUDENT)], on_episode)[1]
            for i, ep in zip(stale, fresh):
                episodes[i] = ep
            stats["async/regenerated"] = float(len(stale))
            return planned, episodes, stats
        drop = set(stale)
        for i in stale:  # still in the store (the viewer shows them), marked as not trained on
            episodes[i].info["dropped_stale"] = staleness[i]
            self.store.add(episodes[i], planned[i].spec.episode_id, split="train", teacher=self._teacher_name(planned[i]))
        stats["async/dropped"] = float(len(stale))
        keep = [i for i in range(len(episodes)) if i not in drop]
        return [planned[i] for i in keep], [episodes[i] for i in keep], stats

    def _teacher_name(self, p: Planned) -> str | None:
        return None if self.router.single else self.router.teacher_of(p)

    def _score(self, planned: list[Planned], episodes: list[Episode], teacher_of: list[str], objective: Objective,
               collected: Sequence[RolloutHandle] = ()) -> list[TeacherScores] | None:  # fmt: skip
        """The teachers' scores of every episode, in order, then of every branch (Episode.branches: student turns that
        recipe.intervene_below replaced, each scored by its episode's teacher), episode by episode. `collected`: the
        rollouts the episodes came from, in order, whose scores the backend may have started ahead (async.score_ahead;
        the share that came ahead in self._scored_ahead)."""
        self._scored_ahead = 0.0
        if not objective.scores or not episodes:
            self.backend.forget(collected)
            return None
        if self.cross_scorer is not None:
            return self._score_cross(planned, episodes, teacher_of)
        # teacher.privileged: the same response tokens after the privileged prompt (agentopd.privileged); no branches then
        own = self.privileged.streams(planned, episodes) if self.privileged is not None else [e.tokens for e in episodes]
        streams = own + [b for e in episodes for b in e.branches]
        branch_teachers = [name for e, name in zip(episodes, teacher_of) for _ in e.branches]
        self._scored = [(name, len(s.token_ids)) for name, s in zip([*teacher_of, *branch_teachers], streams)]
        with self._in_phase("teacher"):
            ahead = [self.backend.ahead_scores(h) for h in collected]
            if not ahead or any(a is None for a in ahead) or sum(map(len, ahead)) != len(streams):
                scores = score_episodes(self.backend, [*teacher_of, *branch_teachers], streams, self.mode)
            else:  # those missing (an actor died) scored now
                scores = [sc for a in ahead for sc in a]
                missing = [i for i, sc in enumerate(scores) if sc is None]
                self._scored_ahead = 1 - len(missing) / len(scores)
                late = score_episodes(self.backend, [teacher_of[i] for i in missing], [streams[i] for i in missing], self.mode) if missing else []
                for i, sc in zip(missing, late, strict=True):
                    scores[i] = sc
        with self.store.batch():  # one transaction: the scores arrive together
            for p, ep, sc in zip(planned, episodes, scores):
                ep.teacher_logprobs = sc.logprobs
                self.store.set_teacher_logprobs(p.spec.episode_id, sc.logprobs, ep.tokens)
        return scores

    def _score_cross(self, planned: list[Planned], episodes: list[Episode], teacher_of: list[str]) -> list[TeacherScores]:
        """A cross-tokenizer loss: scores through the alignment (agentopd.crosstok.score); the step's alignment metrics kept."""
        # the teacher's own streams differ in length: counted at the student's (an approximation, flops.py)
        self._scored = [(name, len(e.tokens.token_ids)) for name, e in zip(teacher_of, episodes)]
        with self._in_phase("teacher"):
            projected, self._cross_metrics = self.cross_scorer.score(self.backend, episodes, teacher_of, self.mode)
        with self.store.batch():
            for p, ep, xs in zip(planned, episodes, projected):
                ep.teacher_logprobs = xs.store
                self.store.set_teacher_logprobs(p.spec.episode_id, xs.store, ep.tokens)
        return [xs.train for xs in projected]

    def _step(self, step: int) -> dict[str, Any]:
        cfg = self.cfg
        objective = self._objective(step)
        t = time.perf_counter()
        with self._in_phase("rollout", total=cfg.rollout.tasks_per_step * cfg.rollout.n) as advance:
            planned, episodes, async_stats, collected = self._rollout(step, advance)
        rollout_s = time.perf_counter() - t

        teacher_of = [self.router.teacher_of(p) for p in planned]
        t = time.perf_counter()
        scores = self._score(planned, episodes, teacher_of, objective, collected)
        teacher_s = time.perf_counter() - t
        if cfg.async_.enabled:
            async_stats["async/scored_ahead"] = self._scored_ahead

        r = cfg.recipe  # recipe.turn_support_below: per-token loss weights of each episode (its turns' reliability)
        token_weights, recipe_metrics = (None, {}) if r.turn_support_below is None or scores is None else \
            step_turn_weights([e.tokens for e in episodes], [sc.logprobs for sc in scores], below=r.turn_support_below, floor=r.turn_weight_floor)
        keys = list(dict.fromkeys(teacher_of))  # the step's teachers; a sample's teacher_index points into them
        heads = [self.backend.teacher_head(k) for k in keys] if scores and scores[0].hidden is not None else None
        with self._in_phase("train"):
            # a phase with a loss of its own (the SFT warm start) trains at that loss's temperature (the run policy)
            step_loss = objective.loss if objective is not self.objective else None
            temperature = loss_temperature(cfg, step_loss) if step_loss is not None else None
            samples = train_samples(planned, episodes, scores, token_weights, [keys.index(k) for k in teacher_of])
            train = self.backend.train(samples, heads, loss=step_loss, temperature=temperature)
        self._trained_through = step
        self._unlogged = (step, dict(train))
        t = time.perf_counter()
        self.phase = "sync"
        if objective.teacher_plays:
            self._engine_stale = True  # synced before the student next plays (evals, or after the warm start)
        else:
            self.backend.sync_weights()
        sync_s = time.perf_counter() - t

        metrics = dict(train) | recipe_metrics | self._cross_metrics
        self._cross_metrics = {}
        teacher_played = self._teacher_played.pop(step, set())
        if teacher_played:
            metrics["recipe/teacher_episodes"] = float(len(teacher_played))
        if (k := self._horizon(step)) is not None:
            metrics["horizon/turns"] = float(k)
        metrics |= teacher_work(episodes, scored=scores is not None, teacher_plays=objective.teacher_plays)
        own = [i for i, p in enumerate(planned) if p.spec.episode_id not in teacher_played]  # what the diagnostics describe
        if own:
            mine = [episodes[i] for i in own]
            teacher_keys = None if self.router.single or scores is None else [teacher_of[i] for i in own]
            metrics |= step_metrics(mine, tool_names=sorted({t["function"]["name"] for e in mine for t in e.tools}), teacher_keys=teacher_keys)
            if self.mixture.mixed:
                for source in self.mixture.sources:
                    of_source = [episodes[i] for i in own if planned[i].source == source]
                    if of_source:
                        metrics[f"success_rate/{source}"] = sum(e.success for e in of_source) / len(of_source)
        metrics |= phase_metrics(episodes, rollout_s=rollout_s, teacher_s=teacher_s, sync_s=sync_s)
        metrics |= async_stats | self.backend.stats() | self._mem
        metrics |= self._step_flops(planned, episodes, teacher_of, objective, teacher_played, samples,
                                    guide_score=metrics.get("flops/teacher_guide_score", 0.0))  # fmt: skip
        self._mem = {}
        self._unlogged = (step, metrics)
        return metrics

    def _step_flops(self, planned: list[Planned], episodes: list[Episode], teacher_of: list[str], objective: Objective,
                    teacher_played: set[str], samples: list, guide_score: float) -> dict[str, float]:  # fmt: skip
        """The step's `flops/*` (agentopd.flops), the run's cumulative ones updated."""
        by_teacher = [objective.teacher_plays or p.spec.episode_id in teacher_played for p in planned]
        players = [self.shapes[name] if t else self.shapes[STUDENT] for name, t in zip(teacher_of, by_teacher)]
        guides = [self.shapes[name] if self.cfg.recipe.intervene_below is not None else None for name in teacher_of]
        scored, self._scored = [(self.shapes[name], n) for name, n in self._scored], []
        out = step_flops(episodes, players, by_teacher, guides, student=self.shapes[STUDENT], scored=scored,
                         train_lengths=[len(s.token_ids) for s in samples])  # fmt: skip
        out["flops/teacher_score"] += guide_score
        out["flops/teacher"] += guide_score
        for who in self._flops_cum:
            self._flops_cum[who] += out[f"flops/{who}"]
            out[f"flops/{who}_cum"] = self._flops_cum[who]
        return out

    # ---- eval and checkpoints -------------------------------------------------------------
    def _play_eval(self, step: int, teachers_play: bool, on_episode: OnEpisode | None = None) -> tuple[list[Planned], list[Episode]]:
        planned = self.mixture.eval_plan(step, num_tasks=self.cfg.eval.num_tasks, seed=self.cfg.run.seed)
        if teachers_play:
            groups = self._by_teacher(planned, split="eval")
            handles = [self.backend.submit_rollout(g, self.eval_rollout_cfg, who) for who, g in groups.items()]
        else:
            handles = [self.backend.submit_rollout(planned, self.eval_rollout_cfg, STUDENT)]
        return self._collect(handles, on_episode)

    def _summarise(self, planned: list[Planned], episodes: list[Episode], prefix: str) -> tuple[EvalResult, dict[str, float]]:
        result = summarise(self.env_name, "eval", 1, episodes)
        per_source = {}
        if self.mixture.mixed:
            for source in self.mixture.sources:
                mine = [e for p, e in zip(planned, episodes) if p.source == source]
                per_source[f"{prefix}/{source}/success_rate"] = summarise(source, "eval", 1, mine).success_rate if mine else 0.0
        return result, per_source

    def _eval(self, step: int, *, with_teacher: bool, summary: RunSummary, metrics: dict | None = None) -> EvalResult:
        def store_eval(p: Planned, ep: Episode) -> None:
            self.store.add(ep, p.spec.episode_id, split="eval")

        if self._engine_stale:
            self.phase = "sync"
            self.backend.sync_weights()
            self._engine_stale = False
        with self._in_phase("eval"):
            planned, episodes = self._play_eval(step, False, store_eval)
            result, per_source = self._summarise(planned, episodes, "eval")
            flops = {"flops/eval_student": played_flops(episodes, self.shapes[STUDENT])}
            teacher_per_source: dict[str, float] = {}
            if with_teacher:
                t_planned, t_episodes = self._play_eval(step, True)
                self._teacher_result, teacher_per_source = self._summarise(t_planned, t_episodes, "eval/teacher")
                flops["flops/eval_teacher"] = sum(played_flops([e], self.shapes[self.router.teacher_of(p, "eval")])
                                                  for p, e in zip(t_planned, t_episodes))  # fmt: skip
        record = {"step": step, "eval/success_rate": result.success_rate, "eval/mean_turns": result.mean_turns,
                  "eval/tool_error_rate": result.tool_error_rate, "eval/parse_error_rate": result.parse_error_rate, **per_source}  # fmt: skip
        if with_teacher and self._teacher_result is not None:
            record["eval/teacher_success_rate"] = self._teacher_result.success_rate
            record |= teacher_per_source
        record |= flops
        summary.evals.append(record)
        if metrics is not None:
            metrics.update({k: v for k, v in record.items() if k != "step"} | self._mem)
            self._mem = {}
        else:
            self.log.write(step, {k: v for k, v in record.items() if k != "step"})
        self.progress.note(
            f"eval @ step {step}: student success {result.success_rate:.0%}"
            + (f", teacher {self._teacher_result.success_rate:.0%}" if with_teacher and self._teacher_result else "")
        )
        return result

    def _checkpoint(self, step: int, summary: RunSummary) -> None:
        """Save the trainer's state as step `step`; a Ctrl-C meanwhile waits until the files are on disk."""
        with writes_uninterrupted(lambda: self.progress.note("Ctrl-C: finishing the checkpoint first")):
            self.backend.save_checkpoint(self.rd.checkpoint(step), {"step": step, "evals": summary.evals})
        self._checkpointed = step


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
