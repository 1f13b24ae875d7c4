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

import asyncio
import copy
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentopd.batch import TrainSample
from agentopd.diagnostics import step_metrics
from agentopd.engines import make_engine
from agentopd.evaluate import EvalResult, evaluate_async
from agentopd.metrics_log import MetricsLog
from agentopd.models import pick_device, resolve_model
from agentopd.progress import RunProgress
from agentopd.registry import make_env
from agentopd.rollout import Rollout, RolloutConfig
from agentopd.store import Store
from agentopd.teacher import HFTeacher, TeacherMode, check_compatible
from agentopd.trainer import LossKind, Trainer

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
        self.env_name = cfg.env.name
        self.env_kwargs = cfg.env.kwargs

    # ---- set-up ---------------------------------------------------------------------------
    def _env_factory(self, split: str):
        kwargs = dict(self.env_kwargs)
        if "split" in kwargs or split != "train":
            kwargs["split"] = split
        return lambda: make_env(self.env_name, **kwargs)

    def _setup(self) -> None:
        cfg = self.cfg
        self.device, self.dtype = pick_device(cfg.run.device)
        torch.manual_seed(cfg.run.seed)
        random.seed(cfg.run.seed)
        with self.progress.phase("bootstrap", total=None):
            self.student_ref = resolve_model(cfg.student.path, self.env_name, "student", self.progress.bootstrap_callback)
            self.teacher_ref = resolve_model(cfg.teacher.path, self.env_name, "teacher", self.progress.bootstrap_callback)
        self.tokenizer = AutoTokenizer.from_pretrained(self.student_ref)
        self.tokenizer.save_pretrained(self.run_dir / "tokenizer")  # for the viewer, check-tokens and export
        teacher_tok = AutoTokenizer.from_pretrained(self.teacher_ref)
        self.trainer_cfg = cfg.trainer.build()
        if cfg.run.objective == "grpo":
            self.trainer_cfg.loss = LossKind.GRPO
        elif cfg.run.objective == "sft":
            self.trainer_cfg.loss = LossKind.SFT
        self.trainer_cfg.total_steps = max(cfg.run.steps, 1)
        self.trainer_cfg.temperature = cfg.rollout.temperature or 1.0
        student = AutoModelForCausalLM.from_pretrained(self.student_ref, dtype=torch.float32)
        self.teacher = HFTeacher(self.teacher_ref, device=self.device, dtype=self.dtype, temperature=self.trainer_cfg.temperature)
        check_compatible(self.tokenizer, teacher_tok, student.config, self.teacher.config)
        engine_model = copy.deepcopy(student).to(self.dtype) if cfg.engine.kind == "hf" else str(self.student_ref)
        self.trainer = Trainer(student, self.trainer_cfg, device=self.device)
        engine_kwargs = {"max_batch_size": cfg.engine.max_batch_size, "seed": cfg.run.seed}
        if cfg.engine.kind == "hf":
            engine_kwargs["device"] = self.device
        self.engine = make_engine(cfg.engine.kind, engine_model, **engine_kwargs)
        self.rollout_cfg = cfg.rollout.build()
        self.eval_rollout_cfg = RolloutConfig(**{**self.rollout_cfg.__dict__, "temperature": cfg.eval.temperature})
        self.train_env = self._env_factory("train")()
        self.store = Store(self.run_dir / "trajectories.db")
        self.log = MetricsLog(self.run_dir, tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb, mlflow=cfg.log.mlflow, run_name=self.run_dir.name)
        self._teacher_engine = None

    def _tasks_for_step(self, step: int) -> list[str]:
        """The training tasks of a step: a pure function of (seed, step), so resume replays the same data."""
        rng = random.Random(self.cfg.run.seed * 1_000_003 + step)
        ids = [t.id for t in self.train_env.tasks]
        return rng.sample(ids, min(self.cfg.rollout.tasks_per_step, len(ids)))

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
            extra = self.trainer.load_checkpoint(ckpt)
            start = int(extra["step"])
            summary.evals = extra.get("evals", [])
            self.store.delete_after(start)
            self.log.truncate_after(start)
            asyncio.run(self.engine.update_weights(self.trainer.state_dict_for_engine()))
            if start >= self.cfg.run.steps:
                raise ValueError(f"--resume: {self.run_dir} already finished its {self.cfg.run.steps} steps (raise steps= to train on)")
            self.progress.note(f"resumed from {ckpt.name}: continuing at step {start + 1}")
        interrupted = False
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
                if self.cfg.run.checkpoint_every and step % self.cfg.run.checkpoint_every == 0:
                    self._checkpoint(step, summary)
        except KeyboardInterrupt:
            interrupted = True
            last = step - 1  # the interrupted step did not finish: it is replayed on resume
            if last > start:
                self._checkpoint(last, summary)
            self.progress.note(f"interrupted: checkpoint at step {last}; continue with --resume")
        finally:
            self.log.close()
        if not interrupted:
            self._checkpoint(self.cfg.run.steps, summary)
            self.trainer.export(self.run_dir / "final", self.tokenizer)
        summary.interrupted = interrupted
        summary.seconds = time.perf_counter() - t0
        self.progress.close()
        asyncio.run(self.engine.close())
        return summary

    def _step(self, step: int) -> dict[str, Any]:
        cfg = self.cfg
        objective = cfg.run.objective
        task_ids = self._tasks_for_step(step)
        specs = Rollout.specs_for(task_ids, n=cfg.rollout.n, step=step, seed=cfg.run.seed, policy_version=self.trainer.step)
        engine = self._teacher_rollout_engine() if objective == "sft" else self.engine
        t = time.perf_counter()
        rollout = Rollout(self._env_factory("train"), engine, self.tokenizer, self.rollout_cfg)
        with self.progress.phase("rollout", total=len(specs)) as advance:
            def on_episode(spec, ep):
                self.store.add(ep, spec.episode_id, split="train")
                advance()

            episodes = asyncio.run(rollout.run(specs, on_episode))
        rollout.close()
        rollout_s = time.perf_counter() - t
        gen_tokens = sum(e.tokens.num_llm_tokens for e in episodes if e.tokens)

        streams = [e.tokens for e in episodes]
        t = time.perf_counter()
        scores = None
        if objective != "grpo":
            mode = teacher_mode(self.trainer_cfg.loss)
            with self.progress.phase("teacher", total=None):
                scores = self.teacher.score(streams, mode=mode)
            for (spec, ep, sc) in zip(specs, episodes, scores):
                ep.teacher_logprobs = sc.logprobs
                self.store.set_teacher_logprobs(spec.episode_id, sc.logprobs, ep.tokens)
        teacher_s = time.perf_counter() - t

        group = {tid: i for i, tid in enumerate(dict.fromkeys(task_ids))}
        samples = []
        for i, ep in enumerate(episodes):
            sc = scores[i] if scores is not None else None
            samples.append(
                TrainSample.from_stream(
                    ep.tokens,
                    teacher_logprobs=sc.logprobs if sc else None,
                    teacher_topk_ids=sc.topk_ids if sc else None,
                    teacher_topk_logprobs=sc.topk_logprobs if sc else None,
                    teacher_hidden=sc.hidden if sc else None,
                    reward=ep.reward,
                    group_id=group[ep.task_id],
                )
            )
        head = self.teacher.head_weight() if scores is not None and scores[0].hidden is not None else None
        with self.progress.phase("train", total=None):
            train = self.trainer.train_step([s for s in samples if s.num_student_tokens > 0], teacher_head_VH=head)
        t = time.perf_counter()
        if objective != "sft":
            asyncio.run(self.engine.update_weights(self.trainer.state_dict_for_engine()))
        sync_s = time.perf_counter() - t

        metrics = dict(train)
        metrics |= step_metrics(episodes, tool_names=sorted({t['function']['name'] for e in episodes for t in e.tools}))
        metrics |= {
            "perf/rollout_s": rollout_s,
            "perf/teacher_s": teacher_s,
            "perf/weight_sync_s": sync_s,
            "perf/rollout_tokens_per_s": gen_tokens / rollout_s if rollout_s else 0.0,
            "perf/teacher_tokens_per_s": sum(len(s.token_ids) for s in streams) / teacher_s if teacher_s else 0.0,
            "episodes": len(episodes),
        }
        return metrics

    def _teacher_rollout_engine(self):
        """For objective=sft: the teacher plays the episodes (sequence-level KD)."""
        if self._teacher_engine is None:
            model = AutoModelForCausalLM.from_pretrained(self.teacher_ref, dtype=self.dtype)
            self._teacher_engine = make_engine("hf", model, device=self.device, max_batch_size=self.cfg.engine.max_batch_size, seed=self.cfg.run.seed)
        return self._teacher_engine

    # ---- eval and checkpoints -------------------------------------------------------------
    _teacher_result: EvalResult | None = None

    def _eval(self, step: int, *, with_teacher: bool, summary: RunSummary, metrics: dict | None = None) -> EvalResult:
        cfg = self.cfg
        env_factory = self._env_factory("eval")

        def store_eval(spec, ep):
            self.store.add(ep, spec.episode_id, split="eval")

        with self.progress.phase("eval", total=None):
            result = asyncio.run(
                evaluate_async(self.engine, self.tokenizer, env_factory, env_name=self.env_name, split="eval",
                               num_tasks=cfg.eval.num_tasks, rollout=self.eval_rollout_cfg, step=step, seed=cfg.run.seed,
                               on_episode=store_eval)
            )  # fmt: skip
            if with_teacher:
                self._teacher_result = asyncio.run(
                    evaluate_async(self._teacher_rollout_engine(), self.tokenizer, env_factory, env_name=self.env_name,
                                   split="eval", num_tasks=cfg.eval.num_tasks, rollout=self.eval_rollout_cfg, step=step,
                                   seed=cfg.run.seed)
                )  # fmt: skip
        record = {"step": step, "eval/success_rate": result.success_rate, "eval/mean_turns": result.mean_turns,
                  "eval/tool_error_rate": result.tool_error_rate, "eval/parse_error_rate": result.parse_error_rate}  # fmt: skip
        if with_teacher and self._teacher_result is not None:
            record["eval/teacher_success_rate"] = self._teacher_result.success_rate
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
        self.trainer.save_checkpoint(path, extra={"step": step, "evals": summary.evals})
        if self.trainer.rank == 0:
            (path / "DONE").write_text(str(step))



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
