"""The OPD loop, local backend: rollout -> teacher scoring -> train step -> weight sync -> eval -> checkpoint.

    runner = Runner(cfg, run_dir)          # cfg: agentopd.config.Config (resolved, validated)
    summary = runner.run(resume=False)     # summary.before / after / teacher eval results

Every step: sample `rollout.tasks_per_step` training tasks (a fixed function of seed and step,
so a resumed run sees the same data), play `rollout.n` episodes of each with the student
engine, write each episode to `trajectories.db` as it finishes, score them with the teacher
(two-phase: the teacher is on the device only while scoring), train one optimizer step, push
the new weights to the engine, log the DESIGN 3.6 metrics. Every `eval.every` steps: greedy
success on held-out tasks. Every `run.checkpoint_every` steps and on Ctrl-C: a resumable
checkpoint. At the end: `final/` (Hugging Face folder) and a before/after table.

Objectives (`run.objective`): `opd` (default) distils on the student's own episodes; `sft`
trains on the teacher's episodes (sequence-level KD) with the same budget of student tokens;
`grpo` trains on the env reward alone (group-normalised advantages, no teacher).
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer

from agentopd.backends import make_backend
from agentopd.backends.stages import STUDENT, RunContext
from agentopd.batch import TrainSample
from agentopd.diagnostics import step_metrics
from agentopd.engines.base import logprob_temperature
from agentopd.evaluate import EvalResult, summarise
from agentopd.metrics_log import MetricsLog
from agentopd.mixing import Mixture, Planned, Router, resolve_student
from agentopd.models import pick_device
from agentopd.progress import RunProgress
from agentopd.rollout import RolloutConfig
from agentopd.store import Store
from agentopd.teacher import TeacherMode, check_compatible
from agentopd.trainer import LossKind
from agentopd.types import Episode

CHECKPOINTS = "checkpoints"


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


def teacher_mode(loss: LossKind) -> TeacherMode:
    if loss in (LossKind.FORWARD_KL, LossKind.REVERSE_KL, LossKind.JSD):
        return TeacherMode.HIDDEN
    if loss == LossKind.TOPK_FORWARD_KL:
        return TeacherMode.TOPK
    return TeacherMode.LOGPROBS


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = sorted(p for p in (run_dir / CHECKPOINTS).glob("step_*") if (p / "DONE").exists())
    return done[-1] if done else None


class Runner:
    def __init__(self, cfg: Any, run_dir: str | Path, *, console: Any = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.progress = RunProgress(console)
        self.env_name = cfg.env.name  # the run's label: one env, or the sources of a mixed run joined by commas
        self._pending: dict[int, Any] = {}  # async mode: step -> rollout handle already submitted
        self._engine_stale = False  # objective=sft trains without syncing (the teacher plays): sync before the student plays

    # ---- set-up ---------------------------------------------------------------------------
    def _setup(self) -> None:
        cfg = self.cfg
        self.device, self.dtype = pick_device(cfg.run.device)
        torch.manual_seed(cfg.run.seed)
        random.seed(cfg.run.seed)
        self.mixture = Mixture.from_config(cfg)
        self.router = Router.from_config(cfg, self.mixture)  # a task without a teacher fails here, before any model
        self.trainer_cfg = trainer_config(cfg)
        self.mode = teacher_mode(self.trainer_cfg.loss)
        if self.mode is TeacherMode.HIDDEN and len(self.router.refs) > 1 and cfg.run.objective == "opd":
            raise ValueError(f"trainer.loss={self.trainer_cfg.loss} uses one teacher's lm_head: with several teachers use sampled_k1, sampled_k3 or topk_forward_kl")
        with self.progress.phase("bootstrap", total=None):
            student_ref = resolve_student(cfg, self.mixture, self.progress.bootstrap_callback)
            teacher_refs = self.router.resolve(self.progress.bootstrap_callback)
        self.tokenizer = AutoTokenizer.from_pretrained(student_ref)
        self.tokenizer.save_pretrained(self.run_dir / "tokenizer")  # for the viewer, check-tokens and export
        student_config = AutoConfig.from_pretrained(student_ref)
        for name, ref in teacher_refs.items():
            check_compatible(self.tokenizer, AutoTokenizer.from_pretrained(ref), student_config, AutoConfig.from_pretrained(ref))
        self.rollout_cfg = cfg.rollout.build()
        self.eval_rollout_cfg = RolloutConfig(**{**self.rollout_cfg.__dict__, "temperature": cfg.eval.temperature})
        self.ctx = RunContext(cfg, self.mixture, student_ref, teacher_refs, self.trainer_cfg, self.rollout_cfg, self.device, self.dtype)
        self.backend = make_backend(cfg)
        self.backend.setup(self.ctx, self.tokenizer)
        self.store = Store(self.run_dir / "trajectories.db")
        self.log = MetricsLog(self.run_dir, tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb, mlflow=cfg.log.mlflow, run_name=self.run_dir.name)

    # ---- the loop -------------------------------------------------------------------------
    def run(self, resume: bool = False) -> RunSummary:
        t0 = time.perf_counter()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._setup()
        self.cfg.to_yaml(self.run_dir / "config.yaml")
        summary = RunSummary(self.run_dir, steps=self.cfg.run.steps)
        start = 0
        if resume:
            ckpt = latest_checkpoint(self.run_dir)
            if ckpt is None:
                raise ValueError(f"--resume: no finished checkpoint under {self.run_dir / CHECKPOINTS}")
            extra = self.backend.load_checkpoint(ckpt)
            start = int(extra["step"])
            summary.evals = extra.get("evals", [])
            self.store.delete_after(start)
            self.log.truncate_after(start)
            self.backend.sync_weights()
            if start >= self.cfg.run.steps:
                raise ValueError(f"--resume: {self.run_dir} already finished its {self.cfg.run.steps} steps (raise steps= to train on)")
            self.progress.note(f"resumed from {ckpt.name}: continuing at step {start + 1}")
        interrupted = False
        restore = self._catch_ctrl_c()
        try:
            if start == 0:
                summary.before = self._eval(0, with_teacher=self.cfg.eval.teacher, summary=summary)
                summary.teacher = self._teacher_result
            step = start
            for step in range(start + 1, self.cfg.run.steps + 1):
                metrics = self._step(step)
                if self.cfg.eval.every and step % self.cfg.eval.every == 0 and step != self.cfg.run.steps:
                    self._eval(step, with_teacher=False, summary=summary, metrics=metrics)
                if step == self.cfg.run.steps:
                    summary.after = self._eval(step, with_teacher=False, summary=summary, metrics=metrics)
                self.log.write(step, metrics)
                self.progress.step_line(step, self.cfg.run.steps, metrics)
                if self._stop_requested and step < self.cfg.run.steps:
                    self._checkpoint(step, summary)
                    self.progress.note(f"stopped: checkpoint at step {step}; continue with --resume")
                    interrupted = True
                    break
                if self.cfg.run.checkpoint_every and step % self.cfg.run.checkpoint_every == 0:
                    self._checkpoint(step, summary)
        except KeyboardInterrupt:  # a second Ctrl-C: stop now, keep the last finished step
            interrupted = True
            last = step - 1  # the interrupted step did not finish: it is replayed on resume
            if last > start:
                self._checkpoint(last, summary)
            self.progress.note(f"interrupted: checkpoint at step {last}; continue with --resume")
        finally:
            restore()
            self.log.close()
        try:
            if not interrupted:
                self._checkpoint(self.cfg.run.steps, summary)
                self.backend.export(self.run_dir / "final", self.tokenizer)
        finally:
            summary.interrupted = interrupted
            summary.seconds = time.perf_counter() - t0
            self.progress.close()
            self.backend.close()
        return summary

    _stop_requested = False

    def _catch_ctrl_c(self):
        """First Ctrl-C: finish the running step, checkpoint it, stop. A second one stops at once
        (KeyboardInterrupt: the last finished step is checkpointed). Returns the undo."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = signal.getsignal(signal.SIGINT)

        def on_sigint(signum, frame):
            self._stop_requested = True
            self.progress.note("Ctrl-C: stopping after this step (Ctrl-C again to stop now)")
            signal.signal(signal.SIGINT, signal.default_int_handler)

        signal.signal(signal.SIGINT, on_sigint)
        return lambda: signal.signal(signal.SIGINT, previous)

    # ---- one step -------------------------------------------------------------------------
    def _plan(self, step: int) -> list[Planned]:
        cfg = self.cfg
        return self.mixture.plan(step, tasks_per_step=cfg.rollout.tasks_per_step, n=cfg.rollout.n, seed=cfg.run.seed,
                                 policy_version=self.backend.policy_version)  # fmt: skip

    def _submit(self, step: int) -> Any:
        planned = self._plan(step)
        if self.cfg.run.objective == "sft":  # sequence-level KD: each task's teacher plays it
            return [(self.backend.submit_rollout(group, self.rollout_cfg, who), group) for who, group in self._by_teacher(planned).items()]
        return [(self.backend.submit_rollout(planned, self.rollout_cfg, STUDENT), planned)]

    def _by_teacher(self, planned: Sequence[Planned], split: str = "train") -> dict[str, list[Planned]]:
        out: dict[str, list[Planned]] = {}
        for p in planned:
            out.setdefault(self.router.teacher_of(p, split), []).append(p)
        return out

    def _collect(self, handles: Any, on_episode) -> tuple[list[Planned], list[Episode]]:
        planned, episodes = [], []
        for handle, group in handles:
            episodes += self.backend.collect(handle, on_episode)
            planned += group
        return planned, episodes

    def _rollout(self, step: int, advance) -> tuple[list[Planned], list[Episode], dict[str, float]]:
        """This step's episodes (stored as they arrive); in async mode the next steps' rollouts are submitted first."""
        cfg = self.cfg
        handles = self._pending.pop(step, None) or self._submit(step)
        if cfg.async_.enabled:
            for ahead in range(step + 1, min(step + max(cfg.async_.max_staleness, 1), cfg.run.steps) + 1):
                if ahead not in self._pending:
                    self._pending[ahead] = self._submit(ahead)

        def on_episode(p: Planned, ep: Episode) -> None:
            self.store.add(ep, p.spec.episode_id, split="train", teacher=self._teacher_name(p))
            advance()

        planned, episodes = self._collect(handles, on_episode)
        stats: dict[str, float] = {}
        if cfg.async_.enabled:
            planned, episodes, stats = self._bound_staleness(planned, episodes, on_episode)
        return planned, episodes, stats

    def _bound_staleness(self, planned, episodes, on_episode):
        """Episodes older than async.max_staleness policy versions are dropped or re-generated now."""
        cfg = self.cfg.async_
        version = self.backend.policy_version
        staleness = [version - e.policy_version for e in episodes]
        stale = [i for i, s in enumerate(staleness) if s > cfg.max_staleness]
        stats = {"async/staleness_mean": sum(staleness) / max(len(staleness), 1), "async/staleness_max": float(max(staleness, default=0)),
                 "async/dropped": 0.0, "async/regenerated": 0.0}  # fmt: skip
        if not stale:
            return planned, episodes, stats
        if cfg.stale == "regenerate":
            redo = [Planned(planned[i].source, _with_version(planned[i].spec, version)) for i in stale]
            fresh = self._collect([(self.backend.submit_rollout(redo, self.rollout_cfg, STUDENT), redo)], on_episode)[1]
            for i, ep in zip(stale, fresh):
                episodes[i] = ep
            stats["async/regenerated"] = float(len(stale))
            return planned, episodes, stats
        keep = [i for i in range(len(episodes)) if i not in set(stale)]
        for i in stale:  # still in the store (the viewer shows them), marked as not trained on
            episodes[i].info["dropped_stale"] = staleness[i]
            self.store.add(episodes[i], planned[i].spec.episode_id, split="train", teacher=self._teacher_name(planned[i]))
        stats["async/dropped"] = float(len(stale))
        return [planned[i] for i in keep], [episodes[i] for i in keep], stats

    def _teacher_name(self, p: Planned) -> str | None:
        return None if self.router.single else self.router.teacher_of(p)

    def _step(self, step: int) -> dict[str, Any]:
        cfg = self.cfg
        objective = cfg.run.objective
        t = time.perf_counter()
        with self.progress.phase("rollout", total=cfg.rollout.tasks_per_step * cfg.rollout.n) as advance:
            planned, episodes, async_stats = self._rollout(step, advance)
        rollout_s = time.perf_counter() - t
        gen_tokens = sum(e.tokens.num_llm_tokens for e in episodes if e.tokens)

        streams = [e.tokens for e in episodes]
        teacher_of = [self.router.teacher_of(p) for p in planned]
        t = time.perf_counter()
        scores: list[Any] | None = None
        if objective != "grpo" and episodes:
            by_teacher: dict[str, list[int]] = {}
            for i, name in enumerate(teacher_of):
                by_teacher.setdefault(name, []).append(i)
            with self.progress.phase("teacher", total=None):
                routed = self.backend.score({n: [streams[i] for i in idx] for n, idx in by_teacher.items()}, self.mode)
            scores = [None] * len(episodes)
            for name, idx in by_teacher.items():
                for i, sc in zip(idx, routed[name]):
                    scores[i] = sc
            for p, ep, sc in zip(planned, episodes, scores):
                ep.teacher_logprobs = sc.logprobs
                self.store.set_teacher_logprobs(p.spec.episode_id, sc.logprobs, ep.tokens)
        teacher_s = time.perf_counter() - t

        group = {tid: i for i, tid in enumerate(dict.fromkeys((p.source, p.spec.task_id) for p in planned))}
        samples = []
        for i, (p, ep) in enumerate(zip(planned, episodes)):
            sc = scores[i] if scores is not None else None
            samples.append(
                TrainSample.from_stream(
                    ep.tokens,
                    teacher_logprobs=sc.logprobs if sc else None,
                    teacher_topk_ids=sc.topk_ids if sc else None,
                    teacher_topk_logprobs=sc.topk_logprobs if sc else None,
                    teacher_hidden=sc.hidden if sc else None,
                    reward=ep.reward,
                    group_id=group[p.source, ep.task_id],
                )
            )
        head = self.backend.teacher_head(teacher_of[0]) if scores and scores[0].hidden is not None else None
        with self.progress.phase("train", total=None):
            train = self.backend.train([s for s in samples if s.num_student_tokens > 0], head)
        t = time.perf_counter()
        if objective != "sft":
            self.backend.sync_weights()
        else:
            self._engine_stale = True
        sync_s = time.perf_counter() - t

        metrics = dict(train)
        if episodes:
            teacher_keys = None if self.router.single or scores is None else teacher_of
            metrics |= step_metrics(episodes, tool_names=sorted({t['function']['name'] for e in episodes for t in e.tools}), teacher_keys=teacher_keys)
            if self.mixture.mixed:
                for source in self.mixture.sources:
                    mine = [e for p, e in zip(planned, episodes) if p.source == source]
                    if mine:
                        metrics[f"success_rate/{source}"] = sum(e.success for e in mine) / len(mine)
        metrics |= {
            "perf/rollout_s": rollout_s,
            "perf/teacher_s": teacher_s,
            "perf/weight_sync_s": sync_s,
            "perf/rollout_tokens_per_s": gen_tokens / rollout_s if rollout_s else 0.0,
            "perf/teacher_tokens_per_s": sum(len(s.token_ids) for s in streams) / teacher_s if teacher_s else 0.0,
            "episodes": len(episodes),
        }
        metrics |= async_stats | self.backend.stats()
        return metrics

    # ---- eval and checkpoints -------------------------------------------------------------
    _teacher_result: EvalResult | None = None

    def _play_eval(self, step: int, who_by_plan: bool, on_episode=None) -> tuple[list[Planned], list[Episode]]:
        planned = self.mixture.eval_plan(step, num_tasks=self.cfg.eval.num_tasks, seed=self.cfg.run.seed)
        if who_by_plan:
            groups = self._by_teacher(planned, split="eval")
            handles = [(self.backend.submit_rollout(g, self.eval_rollout_cfg, who), g) for who, g in groups.items()]
        else:
            handles = [(self.backend.submit_rollout(planned, self.eval_rollout_cfg, STUDENT), planned)]
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
            self.backend.sync_weights()
            self._engine_stale = False
        with self.progress.phase("eval", total=None):
            planned, episodes = self._play_eval(step, False, store_eval)
            result, per_source = self._summarise(planned, episodes, "eval")
            teacher_per_source: dict[str, float] = {}
            if with_teacher:
                t_planned, t_episodes = self._play_eval(step, True)
                self._teacher_result, teacher_per_source = self._summarise(t_planned, t_episodes, "eval/teacher")
        record = {"step": step, "eval/success_rate": result.success_rate, "eval/mean_turns": result.mean_turns,
                  "eval/tool_error_rate": result.tool_error_rate, "eval/parse_error_rate": result.parse_error_rate, **per_source}  # fmt: skip
        if with_teacher and self._teacher_result is not None:
            record["eval/teacher_success_rate"] = self._teacher_result.success_rate
            record |= teacher_per_source
        summary.evals.append(record)
        if metrics is not None:
            metrics.update({k: v for k, v in record.items() if k != "step"})
        else:
            self.log.write(step, {k: v for k, v in record.items() if k != "step"})
        self.progress.note(
            f"eval @ step {step}: student success {result.success_rate:.0%}"
            + (f", teacher {self._teacher_result.success_rate:.0%}" if with_teacher and self._teacher_result else "")
        )
        return result

    def _checkpoint(self, step: int, summary: RunSummary) -> None:
        path = self.run_dir / CHECKPOINTS / f"step_{step:06d}"
        self.backend.save_checkpoint(path, {"step": step, "evals": summary.evals})


def trainer_config(cfg: Any) -> Any:
    """The run's TrainerConfig: the `trainer` section, with the objective's loss, the run's steps and
    the loss temperature (`loss_temperature`)."""
    trainer_cfg = cfg.trainer.build()
    if cfg.run.objective == "grpo":
        trainer_cfg.loss = LossKind.GRPO
    elif cfg.run.objective == "sft":
        trainer_cfg.loss = LossKind.SFT
    trainer_cfg.total_steps = max(cfg.run.steps, 1)
    trainer_cfg.temperature = loss_temperature(cfg, trainer_cfg.loss)
    return trainer_cfg


def loss_temperature(cfg: Any, loss: LossKind) -> float:
    """The temperature the loss divides logits by.

    Losses on sampled tokens (sampled_k1/k3, grpo, topk_forward_kl) compare the student with the
    sampler, so they use the rollout's temperature (trainer.temperature is not used). Full-vocabulary
    distillation (forward_kl, reverse_kl, jsd) compares the student's and the teacher's distributions at `trainer.temperature`
    (default 1: the models' own distributions), whatever temperature explores; at T=0.5 a tiny
    student's copy errors cost 10-25 nats per token and training at lr >= 1e-3 collapsed
    (benchmarks/results/default_run.md). sft is cross-entropy at T=1.
    """
    sampler = logprob_temperature(cfg.rollout.temperature)  # greedy rollouts report T=1 logprobs
    if loss == LossKind.SFT:
        return 1.0
    if not loss.is_full_vocab:
        return sampler
    if cfg.trainer.task_reward_coef > 0 and cfg.trainer.temperature != sampler:
        raise ValueError(
            f"trainer.task_reward_coef={cfg.trainer.task_reward_coef} adds a policy-gradient term whose importance ratio "
            f"compares with the sampler: set trainer.temperature={cfg.trainer.temperature} equal to rollout.temperature={sampler}"
        )
    return cfg.trainer.temperature


def _with_version(spec: Any, version: int) -> Any:
    import dataclasses

    return dataclasses.replace(spec, policy_version=version)


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path) -> None:
    """A checkpoint of a run (`<run>/checkpoints/step_N`) as a Hugging Face folder with the run's tokenizer."""
    from agentopd.trainer import export_checkpoint as export_trainer_checkpoint

    ckpt = Path(checkpoint_dir)
    if not (ckpt / "DONE").exists():
        raise ValueError(f"{ckpt} is not a finished checkpoint of a run (no DONE marker)")
    tokenizer_dir = ckpt.parent.parent / "tokenizer"
    if not (tokenizer_dir / "tokenizer_config.json").exists():
        raise ValueError(f"{ckpt.parent.parent} has no tokenizer/ folder: is {ckpt} inside a run directory?")
    export_trainer_checkpoint(ckpt, out_dir, AutoTokenizer.from_pretrained(tokenizer_dir))
