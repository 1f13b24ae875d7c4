"""The play stage: a step's training episodes, played by the backend and stored as each finishes.

    play = Play(parts, engines)
    played = play(step)            # Played (agentopd.step.values)

Who plays: the student, or every task's teacher when the step's objective says so (objective=sft, the SFT warm
start), or the teachers for a recipe's share of the tasks (recipe.teacher_fraction); how: the run's rollout settings
as the recipes change them (recipe.horizon_turns). In async mode (Ray) the next `async.max_staleness` steps' rollouts
are submitted before this step's are collected (`pending`, kept across steps; with `async.score_ahead` the recipe
step/score.py `ScoreAhead` starts their scoring as each is played); episodes older than the staleness bound are
dropped or played again. Then each recipe's `played` hook sees the step's episodes before the score stage does
(step/selftest.py `TeacherSelfTest`: the teacher's pre-flight and re-checks); its metrics join `Played.metrics`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from agentopd.backends.stages import STUDENT, OnEpisode
from agentopd.config.schema import Stale
from agentopd.plan import Planned
from agentopd.step.values import Played
from agentopd.types import PLAYED_BY, Episode, PlayedBy, StopReason

if TYPE_CHECKING:
    from agentopd.backends.base import RolloutHandle
    from agentopd.objectives import Objective
    from agentopd.rollout import RolloutConfig
    from agentopd.step.values import StepParts


class StudentEngines:
    """Whether the student's engines hold the trainer's last weights. After a step the teacher played (objective=sft)
    they are synced only before the student plays again (a training step after the warm start, or an eval)."""

    def __init__(self, parts: StepParts):
        self.parts = parts
        self.stale = False

    def refresh(self, *, as_phase: bool = False) -> None:
        if self.stale:
            if as_phase:
                self.parts.phases.enter("sync")
            self.parts.backend.sync_weights()
            self.stale = False


class Play:
    def __init__(self, parts: StepParts, engines: StudentEngines):
        self.parts = parts
        self.engines = engines
        self.pending: dict[int, list[RolloutHandle]] = {}  # async mode: step -> rollouts already submitted
        self._teacher_played: dict[int, set[str]] = {}  # step -> its episodes the teachers played

    def objective(self, step: int) -> Objective:
        """The objective in force at `step` (a recipe may change the run's: the SFT warm start)."""
        objective = self.parts.objective
        for recipe in self.parts.recipes:
            objective = recipe.objective(step, objective)
        return objective

    def config(self, step: int) -> RolloutConfig:
        """The rollout settings of `step`'s training episodes (a recipe may change them: recipe.horizon_turns)."""
        config = self.parts.rollout_cfg
        for recipe in self.parts.recipes:
            config = recipe.rollout(step, config)
        return config

    def forget(self) -> None:
        """Rollouts submitted ahead are never collected (a rewind)."""
        self.parts.backend.forget([h for handles in self.pending.values() for h in handles])
        self.pending.clear()

    def __call__(self, step: int) -> Played:
        parts, cfg = self.parts, self.parts.cfg
        objective = self.objective(step)
        t = time.perf_counter()
        with parts.phases("rollout", total=cfg.rollout.tasks_per_step * cfg.rollout.n) as advance:
            planned, episodes, stats, collected = self._rollout(step, advance)
        seconds = time.perf_counter() - t
        kept = [i for i, ep in enumerate(episodes) if ep.tokens is not None and ep.num_turns > 0]  # a guide's turns count
        if episodes and not kept:
            raise ValueError(_none_played(step, episodes, self.config(step)))
        if len(kept) < len(episodes):  # out of time (or failed) before their first token: stored, nothing to train on
            stats = {**stats, "rollout/unplayed": float(len(episodes) - len(kept))}
            planned, episodes = [planned[i] for i in kept], [episodes[i] for i in kept]
            parts.backend.forget(collected)  # scores started ahead are per played episode: the score stage scores these
            collected = []
        played = Played(step, objective, planned, episodes, teacher_of=[parts.router.teacher_of(p) for p in planned],
                        teacher_played=self._teacher_played.pop(step, set()), collected=collected, seconds=seconds,
                        metrics=stats)  # fmt: skip
        for recipe in parts.recipes:  # a check of the played episodes before the teacher scores them (the self-test)
            played.metrics |= recipe.played(played, parts)
        return played

    # ---- submitting ----
    def submit(self, step: int) -> list[RolloutHandle]:
        """`step`'s rollouts, submitted (a recipe may start more work on them: async.score_ahead's scoring)."""
        handles = self._submit_rollouts(step)
        for recipe in self.parts.recipes:
            recipe.submitted(self.objective(step), handles, self.parts)
        return handles

    def _submit_rollouts(self, step: int) -> list[RolloutHandle]:
        parts, cfg = self.parts, self.parts.cfg
        planned = parts.mixture.plan(step, tasks_per_step=cfg.rollout.tasks_per_step, n=cfg.rollout.n, seed=cfg.run.seed,
                                     policy_version=parts.backend.policy_version)  # fmt: skip
        config = self.config(step)
        if self.objective(step).teacher_plays:  # each task's teacher plays it
            return self._teachers_play(planned, config)
        self.engines.refresh()  # the warm start is over: the student plays with the weights it trained
        k = sum(r.teacher_share(planned, cfg.rollout.n) for r in parts.recipes)
        self._teacher_played[step] = {p.spec.episode_id for p in planned[:k]}
        student = planned[k:]
        return self._teachers_play(planned[:k], config) + [parts.backend.submit_rollout(student, config, STUDENT)]

    def _teachers_play(self, planned: Sequence[Planned], config: RolloutConfig) -> list[RolloutHandle]:
        return [self.parts.backend.submit_rollout(g, config, who) for who, g in by_teacher(self.parts, planned).items()]

    # ---- collecting ----
    def _rollout(self, step: int, advance: Callable[[], None]) -> tuple[list[Planned], list[Episode], dict[str, float], list[RolloutHandle]]:
        """This step's episodes (stored as they arrive) and the rollouts whose scores the score stage may take from the
        backend (async.score_ahead; none when staleness changed the episodes); in async mode the next steps'
        rollouts are submitted first."""
        parts, cfg = self.parts, self.parts.cfg
        handles = self.pending.pop(step, None) or self.submit(step)
        if cfg.async_.enabled:
            for ahead in range(step + 1, min(step + cfg.async_.max_staleness, cfg.run.steps) + 1):
                if ahead not in self.pending:
                    self.pending[ahead] = self.submit(ahead)

        teacher_played = self._teacher_played.get(step, set())

        def on_episode(p: Planned, ep: Episode) -> None:
            if p.spec.episode_id in teacher_played:
                ep.info[PLAYED_BY] = PlayedBy.TEACHER  # recipe.teacher_fraction: shown as such in the store and viewer
            parts.store.add(ep, p.spec.episode_id, split="train", teacher=self._teacher_name(p))
            advance()

        planned, episodes = collect(parts, handles, on_episode)
        stats: dict[str, float] = {}
        if cfg.async_.enabled:
            planned, episodes, stats = self._bound_staleness(planned, episodes, on_episode)
            if stats["async/dropped"] or stats["async/regenerated"]:  # the step's episodes changed: scored anew
                parts.backend.forget(handles)
                handles = []
        return planned, episodes, stats, handles

    def _teacher_name(self, p: Planned) -> str | None:
        router = self.parts.router
        return None if router.single else router.teacher_of(p)

    def _bound_staleness(self, planned: list[Planned], episodes: list[Episode],
                         on_episode: OnEpisode) -> tuple[list[Planned], list[Episode], dict[str, float]]:  # fmt: skip
        """Episodes older than async.max_staleness policy versions are dropped or re-generated now."""
        parts, cfg = self.parts, self.parts.cfg.async_
        version = parts.backend.policy_version
        staleness = [version - e.policy_version for e in episodes]
        stale = [i for i, s in enumerate(staleness) if s > cfg.max_staleness]
        stats = {"async/staleness_mean": sum(staleness) / max(len(staleness), 1), "async/staleness_max": float(max(staleness, default=0)),
                 "async/dropped": 0.0, "async/regenerated": 0.0}  # fmt: skip
        if not stale:
            return planned, episodes, stats
        if cfg.stale == Stale.REGENERATE:
            redo = [Planned(planned[i].source, replace(planned[i].spec, policy_version=version)) for i in stale]
            config = self.config(redo[0].spec.step)  # one step's episodes
            fresh = collect(parts, [parts.backend.submit_rollout(redo, config, STUDENT)], on_episode)[1]
            for i, ep in zip(stale, fresh):
                episodes[i] = ep
            stats["async/regenerated"] = float(len(stale))
            return planned, episodes, stats
        drop = set(stale)
        for i in stale:  # still in the store (the viewer shows them), marked as not trained on
            episodes[i].info["dropped_stale"] = staleness[i]
            parts.store.add(episodes[i], planned[i].spec.episode_id, split="train", teacher=self._teacher_name(planned[i]))
        stats["async/dropped"] = float(len(stale))
        keep = [i for i in range(len(episodes)) if i not in drop]
        return [planned[i] for i in keep], [episodes[i] for i in keep], stats


def by_teacher(parts: StepParts, planned: Sequence[Planned], split: str = "train") -> dict[str, list[Planned]]:
    """The planned episodes grouped by the teacher each is routed to."""
    out: dict[str, list[Planned]] = {}
    for p in planned:
        out.setdefault(parts.router.teacher_of(p, split), []).append(p)
    return out


def collect(parts: StepParts, handles: list[RolloutHandle], on_episode: OnEpisode | None) -> tuple[list[Planned], list[Episode]]:
    """The episodes of submitted rollouts, in order, with what each played."""
    planned, episodes = [], []
    for handle in handles:
        episodes += parts.backend.collect(handle, on_episode)
        planned += handle.planned
    return planned, episodes


def _none_played(step: int, episodes: Sequence[Episode], config: RolloutConfig) -> str:
    """The one line of a step none of whose episodes got to its first token."""
    stops = Counter(str(ep.stop_reason) for ep in episodes)
    why = ", ".join(f"{n} {reason}" for reason, n in stops.most_common())
    errors = [ep.info["error"] for ep in episodes if "error" in ep.info]
    hint = (f"raise rollout.episode_timeout_s (now {config.episode_timeout_s:g} s) or lower rollout.concurrency (now "
            f"{config.concurrency})" if stops.get(str(StopReason.TIMEOUT)) else f"the first: {errors[0]}" if errors else "")  # fmt: skip
    return f"step {step}: none of its {len(episodes)} episodes got to its first token ({why})" + (f": {hint}" if hint else "")
