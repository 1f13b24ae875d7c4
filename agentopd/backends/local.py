"""The local backend: every stage in this process (one device; `torchrun` for FSDP over one node's GPUs).

    backend = LocalBackend()
    backend.setup(ctx, tokenizer)
    handle = backend.submit_rollout(planned, config)      # runs when collected
    episodes = backend.collect(handle, on_episode)
    scores = backend.score({"teacher": streams}, mode)   # {"teacher": [TeacherScores, ...]}
    metrics = backend.train(samples, head)
    backend.sync_weights()

Rollouts run when collected: `async.enabled` needs the Ray backend. With `teacher.overlap` the teacher scores each
training episode as it is played, beside the rollout (`score_ahead`, agentopd.backends.overlap), and the score stage
takes those scores (`ahead_scores`).

Memory (agentopd.memory_plan): with `ctx.engine_sleep` (engine.sleep) the student's engine frees its KV
pool before the teacher scores and the trainer steps, and allocates it again before the next rollout;
it also sleeps while a teacher plays an eval. A teacher's engine that played only evals (eval.teacher)
is closed after them, so it never stays resident beside the teacher's scoring and the trainer (unless it
also serves recipe.intervene_below's guide).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentopd.backends.base import BackendKind, RolloutHandle
from agentopd.backends.stages import (
    STUDENT,
    OnEpisode,
    Players,
    RunContext,
    Scorers,
    build_engine,
    build_teacher,
    engine_metrics,
    score_routed,
)
from agentopd.backends.teacher_weights import TeacherModels
from agentopd.env import Split
from agentopd.flops import ModelShape
from agentopd.memory_plan import PhaseMemory, measure_since_last
from agentopd.plan import Planned
from agentopd.recipes.intervene import guide_for, intervene_metrics
from agentopd.rollout import RolloutConfig
from agentopd.rundir import write_checkpoint
from agentopd.types import Episode, TokenStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentopd.backends.overlap import OverlapScorer
    from agentopd.batch import TrainSample
    from agentopd.config import Config
    from agentopd.engines.base import Engine
    from agentopd.teacher import TeacherMode, TeacherScores
    from agentopd.trainer.config import LossKind


def _scoring(overlap: OverlapScorer, handle: RolloutHandle, on_episode: OnEpisode | None) -> OnEpisode:
    """`on_episode` that first hands each played episode to the scorer beside the rollout (teacher.overlap)."""
    index = {p.spec.episode_id: i for i, p in enumerate(handle.planned)}

    def done(p: Planned, ep: Episode) -> None:
        if ep.tokens is not None and ep.num_turns > 0:  # one that never got to its first token is not trained on
            overlap.add(index[p.spec.episode_id], ep.tokens)
        if on_episode is not None:
            on_episode(p, ep)

    return done


class LocalBackend:
    name = BackendKind.LOCAL

    def connect(self, cfg: Config, teachers: dict[str, str | Path]) -> None:
        """Nothing to reserve: every stage runs in this process."""

    def setup(self, ctx: RunContext, tokenizer: PreTrainedTokenizerBase) -> None:
        from transformers import AutoModelForCausalLM

        from agentopd.trainer import Trainer

        assert not ctx.cfg.async_.enabled, "refused at config load (agentopd.policy.check_run)"
        self.ctx = ctx
        student = AutoModelForCausalLM.from_pretrained(ctx.student_ref, dtype=torch.float32)
        # a teacher that plays and scores holds one copy of its weights (backends.teacher_weights: on a CPU)
        self.teacher_models = TeacherModels(ctx)
        self.players = Players(ctx, tokenizer, student_engine=self._student_engine(student), module_of=self.teacher_models.get)
        # scorers load on first use (pure SFT: never); a teacher's play engine closes before its scorer loads, unless
        # the two share the weights (then the engine's are the scorer's: nothing to free)
        self.teachers = Scorers(ctx.teacher_refs, lambda name: build_teacher(ctx, name, self.teacher_models.get(name)),
                                self._before_scorer)  # fmt: skip
        self.trainer = Trainer(student, ctx.trainer_cfg, device=ctx.device, vocab_size=ctx.vocab_size)
        self._synced = 0  # the trainer step the engine's weights come from
        recipe = ctx.cfg.recipe
        self.guide = guide_for(  # recipe.intervene_below, else None
            self.teachers, self.players.engine, below=recipe.intervene_below, steps=recipe.intervene_steps or ctx.cfg.run.steps
        )
        self._stats: dict[str, float] = {}  # the step's metrics, until stats() reads them
        self._sleeping = False  # the student's engine freed its KV pool (ctx.engine_sleep)
        self._events: list[str] = []  # what the teachers went through since `teacher_events` last read it
        self._ahead: dict[int, tuple[list[str], TeacherMode]] = {}  # handle id -> who scores it beside its rollout
        self._ahead_scores: dict[int, list[TeacherScores | None]] = {}  # handle id -> those scores, once collected

    def _before_scorer(self, name: str) -> None:
        if not self.teacher_models.shares(name):
            self.players.drop(name)

    def _student_engine(self, student: torch.nn.Module) -> Engine:
        from agentopd.engines import EngineKind, resolve_kind

        if resolve_kind(self.ctx.cfg.engine.kind, self.ctx.device) == EngineKind.HF:
            return build_engine(self.ctx, student)  # a copy of the loaded module: no second read from disk
        return build_engine(self.ctx, self.ctx.student_ref)

    @property
    def policy_version(self) -> int:
        return self._synced

    def submit_rollout(self, planned: Sequence[Planned], config: RolloutConfig, who: str = STUDENT) -> RolloutHandle:
        return RolloutHandle(list(planned), config, who)

    def collect(self, handle: RolloutHandle, on_episode: OnEpisode | None = None) -> list[Episode]:
        """The played episodes; the student's training episodes play under the guide (recipe.intervene_below)."""
        guide = self.guide if handle.who == STUDENT else None
        # a teacher that plays only evals (eval.teacher), its engine not serving a guide (recipe.intervene_below)
        evals_only = handle.teacher_evals and self.guide is None
        self._asleep(handle.who != STUDENT)
        train = handle.student_training
        engine = self.players.engine(STUDENT) if train else None
        before = dict(getattr(engine, "timings", None) or {})
        overlap = self._overlap(handle)
        if overlap is not None:
            on_episode = _scoring(overlap, handle, on_episode)
        try:
            episodes = self.players.play(handle.planned, handle.config, on_episode, handle.who, guide)
        except BaseException:
            if overlap is not None:
                overlap.cancel()
            raise
        if overlap is not None:
            self._ahead_scores[handle.id], metrics = overlap.finish()
            self._stats |= metrics
        if train:  # the student's training rollout: where its engine's time went (rollout/engine_*)
            self._stats |= engine_metrics(before, getattr(engine, "timings", None) or {})
        if evals_only:  # free its engine at once
            self.players.drop(handle.who)
        if guide is not None and handle.planned and handle.planned[0].spec.split == Split.TRAIN:
            self._stats |= intervene_metrics(episodes, guide.probability(handle.planned[0].spec.step))
            lengths = guide.take_scored_lengths()
            self._stats["teacher/guide_scored_tokens"] = float(sum(lengths))
            (teacher,) = self.teachers.values()  # the guide's one teacher (recipe.intervene_below)
            self._stats["flops/teacher_guide_score"] = ModelShape.of_model(teacher.model).forwards(lengths)
        return episodes

    def _asleep(self, asleep: bool) -> None:
        """The student's engine sleeps (asleep) or wakes, where `engine.sleep` is on; seconds in perf/engine_sleep_s."""
        if not self.ctx.engine_sleep or asleep == self._sleeping:
            return
        t0 = time.perf_counter()
        self.players.sleep() if asleep else self.players.wake()
        self._sleeping = asleep
        if not asleep and "the engine's sleep/wake" not in self._events:  # a colocated engine's wake is what wiped a
            self._events.append("the engine's sleep/wake")  # teacher's weights elsewhere (redai-studio/Relax#287)
        key = "perf/engine_sleep_s" if asleep else "perf/engine_wake_s"
        self._stats[key] = self._stats.get(key, 0.0) + time.perf_counter() - t0

    def score(self, by_teacher: dict[str, list[TokenStream]], mode: TeacherMode) -> dict[str, list[TeacherScores]]:
        self._asleep(True)
        return score_routed(self.teachers, by_teacher, mode)

    def score_replicas(self, name: str, streams: list[TokenStream], mode: TeacherMode) -> list[list[TeacherScores]]:
        """The teacher's self-test (agentopd.step.selftest): `streams` scored by each replica of `name` (here: one)."""
        self._asleep(True)
        return [self.teachers[name].score(streams, mode=mode)]

    def teacher_events(self) -> dict[str, str]:
        """What each teacher went through since the last call that may change its scores (teacher name -> the event):
        the student engine's sleep/wake (engine.sleep), an offload to host memory and reload (teacher.offload on CUDA),
        a server teacher's reconnect after its server could not be reached (ServerTeacher.take_reconnects)."""
        from agentopd.teacher import ServerTeacher

        events = list(self._events)
        self._events.clear()
        out = {}
        for name, teacher in self.teachers.built().items():  # a teacher not loaded yet went through nothing
            mine = list(events)
            if getattr(teacher, "offload_after_score", False) and teacher.device.type == "cuda":
                mine.append("its offload and reload (teacher.offload)")
            if isinstance(teacher, ServerTeacher):
                mine += [f"its {e}" for e in teacher.take_reconnects()]
            if mine:
                out[name] = " and ".join(mine)
        return out

    def score_ahead(self, handle: RolloutHandle, teacher_of: Sequence[str], mode: TeacherMode) -> None:
        """teacher.overlap: `handle`'s episodes are scored by their teachers as each is played, when it is collected."""
        self._ahead[handle.id] = (list(teacher_of), mode)

    def _overlap(self, handle: RolloutHandle) -> OverlapScorer | None:
        """The scorer of `handle`'s episodes beside its rollout (score_ahead), its teachers loaded first; else None."""
        from agentopd.backends.overlap import OverlapScorer

        if handle.id not in self._ahead:
            return None
        teacher_of, mode = self._ahead.pop(handle.id)
        if handle.who != STUDENT:  # a teacher playing (recipe.teacher_fraction): its scorer would close its play engine
            self._ahead_scores[handle.id] = [None] * len(handle.planned)  # the score stage scores these after
            return None
        teachers = {name: self.teachers[name] for name in dict.fromkeys(teacher_of)}  # loaded here, not in the thread
        return OverlapScorer(teachers, teacher_of, mode, min_tokens=self.ctx.cfg.teacher.overlap_min_tokens, device=self.ctx.device)

    def ahead_scores(self, handle: RolloutHandle) -> list[TeacherScores | None] | None:
        """The scores of `handle`'s episodes taken beside its rollout (teacher.overlap), in plan order; None for an
        episode that was not played (the score stage scores those); None if none were taken."""
        return self._ahead_scores.pop(handle.id, None)

    def forget(self, handles: Sequence[RolloutHandle]) -> None:
        for h in handles:  # scores taken beside a rollout whose episodes the step no longer trains on as they are
            self._ahead.pop(h.id, None)
            self._ahead_scores.pop(h.id, None)

    def teacher_head(self, name: str) -> torch.Tensor:
        return self.teachers[name].head_weight()

    def train(self, samples: list[TrainSample], head: torch.Tensor | list[torch.Tensor] | None, loss: LossKind | None = None,
              temperature: float | None = None) -> dict[str, float]:  # fmt: skip
        self._asleep(True)
        return self.trainer.train_step(samples, teacher_head_VH=head, loss=loss, temperature=temperature)

    def sync_weights(self) -> None:
        """The trainer's weights into the student's engine. On a GPU they go from the (gathered) parameters on
        the device into the engine's in-place copy (`Trainer.full_tensors`); on CPU, and for vLLM (its workers
        load host tensors), through the full state dict on the host (`Trainer.state_dict_for_engine`)."""
        from agentopd.engines.vllm import VLLMEngine

        if self.trainer.device.type == "cuda" and not isinstance(self.players.engine(STUDENT), VLLMEngine):
            weights = {}
            for name, t in self.trainer.full_tensors():  # a collective under FSDP: every rank iterates
                if self.trainer.rank == 0:
                    weights[name] = t
            self.players.update_weights(weights)
        else:
            self.players.update_weights(self.trainer.state_dict_for_engine())
        self._synced = self.trainer.step

    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        write_checkpoint(path, extra["step"], lambda tmp: self.trainer.save_checkpoint(tmp, extra=extra))

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        return self.trainer.load_checkpoint(path)

    def export(self, out_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
        self.trainer.export(out_dir, tokenizer)

    def memory_peaks(self) -> dict[int, PhaseMemory]:
        """{0: this process's PhaseMemory on its CUDA device since the last call} ({} off CUDA)."""
        if self.ctx.device.type != "cuda":
            return {}
        return {0: measure_since_last(self.ctx.device)}

    def stats(self) -> dict[str, float]:
        """The metrics of the step since the last call (intervene/*)."""
        stats, self._stats = self._stats, {}
        return stats

    def close(self) -> None:
        self.players.close()
