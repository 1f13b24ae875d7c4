"""The stage code every backend runs: play planned episodes, score them with routed teachers.

    ctx = RunContext(cfg, mixture, student_ref, teacher_refs, trainer_cfg, rollout_cfg, device, dtype)
    players = Players(ctx, tokenizer)                   # engines by role, env instances by source
    episodes = players.play(planned, config, on_episode, who="student")
    scores = score_routed(teachers, by_teacher, mode)   # {teacher: [TeacherScores, ...]}

The local backend calls these in its own process; the Ray backend calls the same functions
inside its rollout and teacher actors. `who` is `student` or a teacher name (a teacher plays
episodes for `objective=sft` and for the teacher's eval).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agentopd.engines.base import logprob_temperature
from agentopd.mixing import Mixture, Planned
from agentopd.rollout import Rollout, RolloutConfig
from agentopd.types import Episode

STUDENT = "student"
OnEpisode = Callable[[Planned, Episode], None]


@dataclass
class RunContext:
    """What the stages need to build their parts (picklable: it travels to Ray actors)."""

    cfg: Any  # agentopd.config.Config
    mixture: Mixture
    student_ref: Path | str
    teacher_refs: dict[str, Path | str]  # teacher name -> from_pretrained reference
    trainer_cfg: Any  # agentopd.trainer.TrainerConfig
    rollout_cfg: RolloutConfig
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    env_vars: dict[str, str] = field(default_factory=dict)  # set in every actor before it builds anything (AGENTOPD_HOME)


def build_engine(ctx: RunContext, model: Any) -> Any:
    """The rollout engine (`engine.kind`) over a model object or a reference."""
    from agentopd.engines import EngineKind, make_engine, resolve_kind

    kind = resolve_kind(ctx.cfg.engine.kind, ctx.device)
    kwargs: dict[str, Any] = {"max_batch_size": ctx.cfg.engine.max_batch_size, "seed": ctx.cfg.run.seed}
    if kind == EngineKind.HF:
        kwargs["device"] = ctx.device
        if not isinstance(model, torch.nn.Module):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model, dtype=ctx.dtype)
        else:
            model = copy.deepcopy(model).to(ctx.dtype)
    elif isinstance(model, torch.nn.Module):
        model = str(ctx.student_ref)
    return make_engine(kind, model, **kwargs)


class Players:
    """Plays planned episodes of every source with the student's (or a teacher's) engine."""

    def __init__(self, ctx: RunContext, tokenizer: Any, student_engine: Any = None):
        self.ctx = ctx
        self.tokenizer = tokenizer
        self.engines: dict[str, Any] = {}
        if student_engine is not None:
            self.engines[STUDENT] = student_engine

    def engine(self, who: str) -> Any:
        if who not in self.engines:
            if who == STUDENT:
                self.engines[who] = build_engine(self.ctx, self.ctx.student_ref)
            else:
                if who not in self.ctx.teacher_refs:
                    raise ValueError(f"no teacher named {who!r} (teachers: {sorted(self.ctx.teacher_refs)})")
                from transformers import AutoModelForCausalLM

                model = AutoModelForCausalLM.from_pretrained(self.ctx.teacher_refs[who], dtype=self.ctx.dtype)
                self.engines[who] = build_engine(self.ctx, model)
        return self.engines[who]

    async def play_async(
        self, planned: Sequence[Planned], config: RolloutConfig, on_episode: OnEpisode | None = None, who: str = STUDENT
    ) -> list[Episode]:
        """Every planned episode, all sources at once on one engine (it batches across them); in plan order."""
        engine = self.engine(who)
        groups: dict[tuple[str, str], list[int]] = {}
        for i, p in enumerate(planned):
            groups.setdefault((p.source, p.spec.split), []).append(i)
        out: list[Episode | None] = [None] * len(planned)
        rollouts = []

        async def run(source: str, split: str, idx: list[int]) -> None:
            ro = Rollout(self.ctx.mixture.sources[source].factory(split), engine, self.tokenizer, config)
            rollouts.append(ro)
            by_id = {planned[i].spec.episode_id: i for i in idx}

            def done(spec, ep):
                out[by_id[spec.episode_id]] = ep
                if on_episode is not None:
                    on_episode(planned[by_id[spec.episode_id]], ep)

            await ro.run([planned[i].spec for i in idx], done)

        try:
            await asyncio.gather(*(run(s, split, idx) for (s, split), idx in groups.items()))
        finally:
            for ro in rollouts:
                ro.close()
        assert all(e is not None for e in out)
        return out  # type: ignore[return-value]

    def play(self, planned: Sequence[Planned], config: RolloutConfig, on_episode: OnEpisode | None = None, who: str = STUDENT) -> list[Episode]:
        return asyncio.run(self.play_async(planned, config, on_episode, who))

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        asyncio.run(self.engine(STUDENT).update_weights(state_dict))

    def close(self) -> None:
        async def close_all() -> None:
            for e in self.engines.values():
                await e.close()

        asyncio.run(close_all())
        self.engines.clear()


def build_teacher(ctx: RunContext, name: str) -> Any:
    from agentopd.teacher import HFTeacher

    # the teacher's sampled-token logprobs (kl/* metrics, sampled losses) sit beside the sampler's: same temperature;
    # the hidden states the full-vocabulary losses use carry none (the loss applies trainer.temperature)
    temperature = logprob_temperature(ctx.rollout_cfg.temperature)
    return HFTeacher(ctx.teacher_refs[name], device=ctx.device, dtype=ctx.dtype, temperature=temperature)


def score_routed(teachers: dict[str, Any], by_teacher: dict[str, list[Any]], mode: Any) -> dict[str, list[Any]]:
    """Each teacher scores the streams routed to it."""
    return {name: teachers[name].score(streams, mode=mode) for name, streams in by_teacher.items() if streams}
