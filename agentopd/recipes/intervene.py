"""Turn-level teacher intervention (`recipe.intervene_below`): the teacher takes over a student turn it finds unlikely.

    guide = TurnGuide(teacher, teacher_engine, below=-2.0, steps=100)     # an agentopd.rollout.Guide
    rollout = Rollout(env_factory, student_engine, tokenizer, config, guide=guide)
    metrics = intervene_metrics(episodes, guide.probability(step))      # intervene/rate, /turn_<k>, /p

In a training episode (never an eval), after the student samples a turn the guide draws whether it may
intervene: probability p(step) = max(0, 1 - (step - 1) / steps), from a generator seeded by the episode's
seed and the turn, so a resumed run draws what an uninterrupted one drew. If it may, the teacher scores
the student's turn from the same prefix; when the teacher's mean log-prob per token of it is below
`below`, the teacher's engine generates the turn from that prefix (the same sampling parameters and
seed) and the episode goes on from the teacher's turn. The rollout keeps that turn in the stream with
mask 0, and the student's rejected turn as a branch (`Episode.branches`) that the runner scores and
trains on: the student learns from its own tokens at the state where it went wrong, never from the
teacher's, and the rest of the episode it plays from states the teacher led it back to.

The local backend builds the guide (`guide_for`); Config refuses the recipe where it cannot run
(run.backend=ray, objective other than opd, a server teacher, several teachers).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence

from agentopd.engines.base import Engine, FinishReason, GenerateRequest, GenerateResult
from agentopd.env import Split
from agentopd.recipes.base import Recipe, Stage
from agentopd.rollout import EpisodeSpec, turn_seed
from agentopd.teacher.base import Teacher, TeacherMode
from agentopd.types import INTERVENED, Episode, TokenStream


def probability(step: int, steps: int) -> float:
    """The chance of intervening at training step `step` (1-based): 1 at step 1, 0 from step `steps` + 1 on."""
    return max(0.0, 1.0 - (step - 1) / steps)


class _TurnScorer:
    """The teacher's mean log-prob per token of a turn after its prefix. One teacher call at a time, off the
    event loop; the turns that arrive meanwhile (or in the same pass of the loop) go in the next call together."""

    def __init__(self, teacher: Teacher):
        self.teacher = teacher
        self._waiting: list[tuple[TokenStream, asyncio.Future]] = []
        self._drain: asyncio.Task | None = None  # the task calling the teacher while turns wait
        self.scored_lengths: list[int] = []  # the length of every (prefix + turn) the teacher scored

    async def mean(self, prefix: Sequence[int], turn: Sequence[int]) -> float:
        n = len(turn)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiting.append((TokenStream([*prefix, *turn], len(prefix), [1] * n, [0.0] * n, [0] * n), future))
        if self._drain is None or self._drain.done():
            self._drain = loop.create_task(self._score_waiting())
        return sum(await future) / n

    async def _score_waiting(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, []
            self.scored_lengths += [len(s.token_ids) for s, _ in batch]
            try:
                scores = await asyncio.to_thread(self.teacher.score, [s for s, _ in batch], mode=TeacherMode.LOGPROBS)
            except Exception as e:  # noqa: BLE001 - each waiting turn's episode fails with the teacher's error
                for _, future in batch:
                    future.set_exception(e)
                continue
            for (_, future), sc in zip(batch, scores, strict=True):
                future.set_result(sc.logprobs)


class TurnGuide:
    """Replaces a training episode's student turn by the teacher's when the teacher finds it unlikely
    (see the module docstring); an agentopd.rollout.Guide. The teacher's log-probs are at its scoring
    temperature (the rollout's); its engine's requests are `<episode id>/teacher`, released after each turn."""

    def __init__(self, teacher: Teacher, engine: Engine, *, below: float, steps: int):
        if steps < 1:
            raise ValueError(f"recipe.intervene_steps must be >= 1, got {steps}")
        self.engine = engine  # the teacher's: it generates the turns that replace the student's
        self.below = below
        self.steps = steps
        self._scorer = _TurnScorer(teacher)

    def probability(self, step: int) -> float:
        return probability(step, self.steps)

    def take_scored_lengths(self) -> list[int]:
        """The lengths of the sequences (prefix + turn, every turn drawn) the teacher scored to decide since the
        last call (their tokens: `teacher/guide_scored_tokens`; their cost: `flops/teacher_guide_score`)."""
        lengths, self._scorer.scored_lengths = self._scorer.scored_lengths, []
        return lengths

    def may_intervene(self, spec: EpisodeSpec, turn: int) -> bool:
        """This turn's draw against p(step): seeded by (episode seed, turn), so a replayed episode draws the same."""
        return random.Random(f"intervene:{turn_seed(spec.seed, turn)}").random() < self.probability(spec.step)

    async def __call__(self, spec: EpisodeSpec, turn: int, request: GenerateRequest, result: GenerateResult) -> GenerateResult | None:
        if spec.split != Split.TRAIN or not result.token_ids or not self.may_intervene(spec, turn):
            return None
        if await self._scorer.mean(request.token_ids, result.token_ids) >= self.below:
            return None
        request_id = f"{spec.episode_id}/teacher"
        try:
            taken = await self.engine.generate(GenerateRequest(request.token_ids, request.params, request_id))
        finally:
            self.engine.release(request_id)
        if taken.finish_reason == FinishReason.ABORT:
            raise RuntimeError("the teacher's engine aborted the request")
        return taken if taken.token_ids else None  # no room left for the teacher: the student's turn stands


def guide_for(
    teachers: dict[str, Teacher], engine_of: Callable[[str], Engine], *, below: float | None, steps: int
) -> TurnGuide | None:
    """The run's guide (None unless `below`, recipe.intervene_below, is set): its one teacher scores, that
    teacher's engine (`engine_of(name)`, built now) generates. Config has refused the runs it cannot serve."""
    if below is None:
        return None
    (name,) = teachers
    return TurnGuide(teachers[name], engine_of(name), below=below, steps=steps)


def intervene_metrics(episodes: Sequence[Episode], p: float) -> dict[str, float]:
    """A step's intervention metrics: `intervene/rate` (replaced turns / the turns the student sampled: every
    turn of an episode, kept or replaced), `intervene/turn_<k>` for k = 0.. (as `kl/turn_<k>`; share of the episodes reaching
    turn k whose turn k was replaced) and `intervene/p` (the probability in force)."""
    turns = sum(e.num_turns for e in episodes)
    replaced = [set(e.info.get(INTERVENED, ())) for e in episodes]
    out = {"intervene/p": p, "intervene/rate": sum(map(len, replaced)) / turns if turns else 0.0}
    for k in range(max((e.num_turns for e in episodes), default=0)):
        reached = [r for e, r in zip(episodes, replaced) if e.num_turns > k]
        out[f"intervene/turn_{k}"] = sum(k in r for r in reached) / len(reached)
    return out


class Intervene(Recipe):
    """`recipe.intervene_below` seen from the step: the backend plays with the guide (`guide_for`), so the teacher
    takes over turns (its FLOPs counted) and the rejected turns are branches to score: no scoring ahead."""

    name = "intervene_below"
    stages = frozenset({Stage.PLAY, Stage.SCORE})
    scores_played_streams = False
    teacher_takes_turns = True
