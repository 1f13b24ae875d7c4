"""The Ray backend (`run.backend=ray`): the runner's stages as Ray actors.

    agentopd run --env calculator,sql_db backend=ray ray.rollout_workers=2 ray.trainer_workers=2
    RAY_ADDRESS=ray://head:10001 agentopd run --env sql_db backend=ray    # an existing cluster

Placement (agentopd.backends.placement): roles whose `ray.cpus_per_*` is null share the cluster's
free CPUs; every role is reserved in one placement group before any actor starts, and a run the
cluster cannot hold fails within `ray.placement_timeout_s`, naming what it asked and what is free.

Roles and resources (`ray.*`, see agentopd.config.RayConfig):
- `rollout_workers` RolloutWorker actors, each with its own engine and env instances of every
  source. A step's episodes are cut into work items (by default one per worker: an engine batches
  only what one call gives it; `episodes_per_call` makes them smaller, so less is replayed when an
  actor dies), spread round-robin; the driver stores each item's episodes as it arrives.
- `teacher_replicas` TeacherWorker actors per teacher (one pool per teacher); a teacher's streams
  are split over its pool.
- `trainer_workers` TrainerWorker actors forming one torch.distributed group (gloo on CPU, NCCL on
  GPU) running the FSDP2 Trainer; each rank gets a token-balanced share of the batch.
- Weight sync after each update (`ray.weight_sync`, agentopd.backends.weight_sync): `object_store`
  (every rank gathers the full state dict, rank 0's copy goes into the object store, every rollout
  worker loads it: `perf/weight_gather_s`, `perf/weight_push_s`); `broadcast` (trainer rank 0 and the
  workers form a NCCL group of their own, gloo on CPU, formed again when a member is replaced:
  `perf/weight_broadcast_s`, `perf/weight_group_s`); `ipc` (trainer rank 0 and every worker share one
  GPU: a CUDA IPC handle to one flat buffer: `perf/weight_gather_s`, `perf/weight_push_s`). `auto`
  picks ipc, broadcast or the object store from the GPUs Ray gave the actors.
- `engine_sleep`: each rollout engine frees its KV pool (and the fast engine its step graphs) before the
  trainer runs and allocates them again when the next rollout is submitted: for a trainer that shares the
  engines' GPU (colocated). `perf/engine_sleep_s`.
The driver owns the store, metrics and viewer files, so a run directory looks as it does locally.

Async mode (`async.enabled`): the runner submits the rollouts of the next `max_staleness` steps
before training the current one; rollout actors run calls in order, so those episodes are played
with the weights the actor holds then and carry that version (`Episode.policy_version`). Weight
pushes are not waited for in async mode (they queue behind the in-flight rollouts). With
`async.score_ahead` each work item is handed to its teacher as an ObjectRef when it is submitted, so
its scoring starts the moment it is played, beside the trainer's step (`score_ahead`).

Fault tolerance (each role up to `ray.max_restarts` times per run): a rollout or teacher actor that
dies is replaced; the replacement starts from the latest weights, and the work items the dead actor
held are played again. A trainer rank that dies takes its group down (agentopd.backends.ray_group):
every rank is replaced, the new group loads the last checkpoint this run finished (or the initial
weights), and `TrainerRestarted` tells the runner to play the steps after it again. Episode ids are
stable per step and slot, so the store replaces rows and never duplicates them. A driver killed
outright takes its actors with it; `--resume` continues from the last finished checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentopd.backends.base import BackendKind, RolloutHandle, TrainerRestarted
from agentopd.backends.placement import (
    ROLLOUT,
    TRAINER,
    Cluster,
    Placement,
    PlacementError,
    Reservation,
    gpu_index,
    place,
    teacher_role,
)
from agentopd.backends.ray_actors import RolloutWorker, TeacherWorker, with_hidden_refs
from agentopd.backends.ray_group import TrainerGroup, TrainerLost
from agentopd.backends.stages import STUDENT, OnEpisode, RunContext, engine_metrics
from agentopd.backends.weight_sync import WeightLayout, WeightSync
from agentopd.memory_plan import PhaseMemory
from agentopd.plan import Planned
from agentopd.rollout import RolloutConfig
from agentopd.rundir import RunDir, write_checkpoint
from agentopd.teacher.base import is_server
from agentopd.types import Episode, TokenStream

RAY_TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"  # Ray's token-auth notices (ray 2.5x-2.60)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentopd.batch import TrainSample
    from agentopd.config import Config
    from agentopd.teacher import TeacherMode, TeacherScores
    from agentopd.trainer.config import LossKind


@dataclass
class _Item:
    """One work item: episodes for one rollout worker."""

    planned: list[Planned]
    config: RolloutConfig
    who: str
    worker: int
    ref: Any = None  # the ObjectRef of its episodes
    actor: Any = None  # the actor it was sent to
    tag: str | None = None  # the student's training plays: the worker keeps its engine's timings under it


@dataclass
class _Ahead:
    """The teacher calls `score_ahead` made on one work item: (teacher, replica, the item's episodes it scores, the
    call's ObjectRefs, the actor), and the item's ref they wait on (an item played again has another: they are void)."""

    item: _Item
    played: Any
    calls: list[tuple[str, int, list[int], list[Any], Any]]


class RayBackend:
    name = BackendKind.RAY
    rollout_worker_cls: type = RolloutWorker  # the actor classes (benchmarks/ray_orchestration.py puts stand-ins here)
    teacher_worker_cls: type = TeacherWorker

    def __init__(self) -> None:
        self.placement: Placement | None = None
        self._in_flight: dict[int, list[_Item]] = {}  # RolloutHandle.id -> its work items
        self._ahead: dict[int, tuple[list[_Ahead], TeacherMode]] = {}  # RolloutHandle.id -> scoring started on its items

    def connect(self, cfg: Config, teachers: dict[str, str | Path]) -> None:
        """Join (or start) the cluster and size every role for it: a run it cannot hold fails here,
        before the runner builds any model (PlacementError naming what was asked and what is free)."""
        import ray

        self.ray = ray
        self._owns_ray = False
        self.reservation: Reservation | None = None
        self.workers: list[Any] = []
        self.teachers: dict[str, list[Any]] = {}
        self.group: TrainerGroup | None = None
        if not ray.is_initialized():
            rc = cfg.ray
            address = rc.address or os.environ.get("RAY_ADDRESS")
            local = {} if address else {"num_cpus": rc.num_cpus, "num_gpus": rc.num_gpus}
            start_ray(ray, address, **local)
            self._owns_ray = True
        try:
            servers = {name for name, ref in teachers.items() if is_server(ref)}
            self.placement = place(cfg.ray, list(teachers), Cluster.of(ray), servers)
        except BaseException:
            if self._owns_ray:
                ray.shutdown()
            raise

    def setup(self, ctx: RunContext, tokenizer: PreTrainedTokenizerBase) -> None:
        from agentopd.paths import agentopd_home

        self.ctx = ctx = dataclasses.replace(ctx, env_vars={"AGENTOPD_HOME": str(agentopd_home())})
        self.rc = ctx.cfg.ray
        if self.placement is None:
            self.connect(ctx.cfg, dict(ctx.teacher_refs))
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        rc, ray = self.rc, self.ray
        self.reservation = Reservation.make(ray, self.placement, rc.placement_timeout_s)
        self.restarts = {"rollout": 0, "teacher": 0, "trainer": 0}
        self.weights_ref, self.weights_version = None, 0
        self._checkpoint: Path | None = None  # the last finished checkpoint: where a restarted trainer group starts
        self._timings: dict[str, float] = {}
        self._rollout_stats: dict[str, float] = {}  # the last training rollout's rollout/engine_* (stats() takes them)
        self._heads: dict[str, tuple[torch.Tensor, Any]] = {}  # teacher -> its lm_head and that head's ObjectRef
        self.workers = [self._new_rollout_worker(i) for i in range(rc.rollout_workers)]
        self.teachers = {name: [self._new_teacher(name, r) for r in range(rc.teacher_replicas)] for name in self.ctx.teacher_refs}
        self.group = TrainerGroup(ray, self.ctx, rc, self.reservation)
        ray.get([w.pid.remote() for w in self.workers])  # every actor up before the first step
        self.version = 0
        self.weight_sync = self._weight_sync_mode()
        self._layout: WeightLayout | None = None
        self._weight_members: tuple[Any, ...] = ()
        self._pending: list[Any] = []  # a weight sync still running (async mode): settled before the trainer's next call
        self._asleep = False  # the engines freed their KV pools for training (ray.engine_sleep)
        self._teacher_events: dict[str, list[str]] = {}  # teacher -> what it went through since teacher_events read it

    # ---- actors -----------------------------------------------------------------------------
    def _new_rollout_worker(self, i: int) -> Any:
        rc, options = self.rc, self.reservation.options(ROLLOUT, i)
        cls = self.ray.remote(self.rollout_worker_cls).options(**options)
        return cls.remote(self.ctx, options["num_gpus"], rc.threads_per_actor, self.weights_ref, self.weights_version)

    def _new_teacher(self, name: str, replica: int) -> Any:
        options = self.reservation.options(teacher_role(name), replica)
        cls = self.ray.remote(self.teacher_worker_cls).options(**options)
        return cls.remote(self.ctx, name, options["num_gpus"], self.rc.threads_per_actor)

    def _restart(self, role: str, error: Exception) -> None:
        self.restarts[role] += 1
        if self.restarts[role] > self.rc.max_restarts:
            raise RuntimeError(f"{role} actors died {self.restarts[role]} times (ray.max_restarts={self.rc.max_restarts}): {error}") from error

    def _replace_worker(self, i: int, dead: Any, error: Exception, push: bool = True) -> None:
        if self.workers[i] is dead:  # several items of one dead actor: replace it once
            self._restart("rollout", error)
            self.ray.kill(dead, no_restart=True)
            self.workers[i] = self._new_rollout_worker(i)
            if push and self.weight_sync != WeightSync.OBJECT_STORE and self.version > 0:  # it starts from the initial weights
                self._push_weights(wait=True)

    def _await_workers(self, calls: list[tuple[int, Any, Any]], push: bool = True) -> None:
        """Wait for each (worker index, worker, ObjectRef) call; a worker found dead is replaced (and given the
        current weights, unless `push` is False). RayActorError covers ActorUnavailableError and ActorDiedError."""
        from ray.exceptions import RayActorError

        for i, w, ref in calls:
            try:
                self.ray.get(ref)
            except RayActorError as e:
                self._replace_worker(i, w, e, push=push)

    def _sleep_engines(self) -> None:
        """Every rollout engine frees its KV pool before the trainer runs (`ray.engine_sleep`); it is allocated
        again when the next rollout is submitted. A worker that died here is replaced (awake)."""
        t0 = time.perf_counter()
        self._await_workers([(i, w, w.sleep.remote()) for i, w in enumerate(self.workers)])
        self._asleep = True
        self._timings["perf/engine_sleep_s"] = time.perf_counter() - t0

    def _replace_dead_workers(self) -> None:
        """Replace the rollout workers that died since they last answered (without pushing weights to them):
        a broadcast group with a dead member would wait for it."""
        self._await_workers([(i, w, w.pid.remote()) for i, w in enumerate(self.workers)], push=False)

    @property
    def policy_version(self) -> int:
        return self.version

    # ---- rollout ------------------------------------------------------------------------------
    def submit_rollout(self, planned: Sequence[Planned], config: RolloutConfig, who: str = STUDENT) -> RolloutHandle:
        if self._asleep:  # the wake runs on each worker before the plays queued after it
            self._asleep = False
            for name in self.teachers:  # teachers sharing a GPU with a woken engine (redai-studio/Relax#287)
                if "the rollout engines' sleep/wake" not in self._teacher_events.setdefault(name, []):
                    self._teacher_events[name].append("the rollout engines' sleep/wake")
            for w in self.workers:
                w.wake.remote()
        planned, n = list(planned), len(self.workers)
        share = math.ceil(len(planned) / n)
        size = max(1, min(self.rc.episodes_per_call or share, share))
        handle = RolloutHandle(planned, config, who)
        timed = handle.student_training  # rollout/engine_*
        items = [_Item(planned[i : i + size], config, who, (i // size) % n, tag=f"{handle.id}:{i}" if timed else None)
                 for i in range(0, len(planned), size)]  # fmt: skip
        for item in items:
            self._submit(item)
        self._in_flight[handle.id] = items
        return handle

    def _submit(self, item: _Item) -> None:
        worker = self.workers[item.worker]
        item.ref = worker.play.remote(item.planned, item.config, item.who, item.tag)
        item.actor = worker

    def collect(self, handle: RolloutHandle, on_episode: OnEpisode | None = None) -> list[Episode]:
        """Episodes of every item in plan order; an item whose actor died is played again on its replacement."""
        from ray.exceptions import ActorUnavailableError, RayActorError

        items = self._in_flight.pop(handle.id)
        results: dict[int, list[Episode]] = {}
        waiting = {item.ref: k for k, item in enumerate(items)}
        while waiting:
            refs = list(waiting)
            ready, rest = self.ray.wait(refs, num_returns=1)
            if rest:  # and whatever else is done by now: one pass over the waiting refs per batch of arrivals
                ready += self.ray.wait(rest, num_returns=len(rest), timeout=0)[0]
            for ref in ready:
                k = waiting.pop(ref)
                item = items[k]
                try:
                    episodes = self.ray.get(ref)
                except (ActorUnavailableError, RayActorError) as e:
                    self._replace_worker(item.worker, item.actor, e)
                    self._submit(item)
                    waiting[item.ref] = k
                    continue
                results[k] = episodes
                if on_episode is not None:
                    for p, ep in zip(item.planned, episodes):
                        on_episode(p, ep)
        if handle.teacher_evals:
            # a teacher's evals (eval.teacher, step 0 only) are done: free its engine on every worker at once, as the
            # local backend does, instead of keeping a second 8B engine beside the teacher's scoring for the whole run
            self.ray.get([w.drop.remote(handle.who) for w in self.workers])
        if any(item.tag for item in items):  # where the engines' time went, summed over the workers (rollout/engine_*)
            self._rollout_stats = engine_metrics({}, self._take_timings(items))
        return [ep for k in range(len(items)) for ep in results[k]]

    def _take_timings(self, items: Sequence[_Item]) -> dict[str, float]:
        """The engine timings the workers kept for `items`' plays (RolloutWorker.take_timings), summed. A worker that
        died since its play is left out (a diagnostic: its replacement comes with its next play)."""
        from ray.exceptions import ActorUnavailableError, RayActorError

        by_actor: dict[int, tuple[Any, list[str]]] = {}
        for item in items:
            if item.tag is not None:
                by_actor.setdefault(id(item.actor), (item.actor, []))[1].append(item.tag)
        total: dict[str, float] = {}
        for ref in [actor.take_timings.remote(tags) for actor, tags in by_actor.values()]:
            try:
                part = self.ray.get(ref)
            except (ActorUnavailableError, RayActorError):
                continue
            for k, v in part.items():
                total[k] = total.get(k, 0) + v
        return total

    def forget(self, handles: Sequence[RolloutHandle]) -> None:
        """Handles submitted that will never be collected (the runner went back to a checkpoint): their work items and
        any scores started on them (hidden rows in the object store, in HIDDEN mode) are let go."""
        for handle in handles:
            for item in self._in_flight.pop(handle.id, []):
                if item.tag is not None and item.actor is not None:  # the worker forgets the play's timings
                    item.actor.take_timings.remote([item.tag])
            self._ahead.pop(handle.id, None)

    # ---- teachers -----------------------------------------------------------------------------
    def _replace_teacher(self, name: str, replica: int, dead: Any, error: Exception) -> None:
        if self.teachers[name][replica] is dead:  # several calls of one dead actor: replace it once
            self._restart("teacher", error)
            self.ray.kill(dead, no_restart=True)
            self.teachers[name][replica] = self._new_teacher(name, replica)
            self._teacher_events.setdefault(name, []).append(f"replica {replica}'s restart after a fault")

    def _scores(self, refs: list[Any], mode: TeacherMode) -> list[TeacherScores]:
        """The scores of a `TeacherWorker.score_apart` call from its ObjectRefs (the scores, then each stream's rows)."""
        from agentopd.teacher.base import TeacherMode

        scores = self.ray.get(refs[0])
        if mode == TeacherMode.HIDDEN:  # the rows stay in the object store for the trainer (HiddenRef)
            scores = with_hidden_refs(scores, refs[1:])
        return scores

    def score_ahead(self, handle: RolloutHandle, teacher_of: Sequence[str], mode: TeacherMode) -> None:
        """Async mode: every work item of `handle` (not collected yet) is scored by its episodes' teachers as soon as
        it is played. The teacher call takes the item's ObjectRef, so Ray starts it when the episodes exist, with no
        trip through the driver: a step's scoring runs while the trainer takes the step before. `ahead_scores` returns
        the scores; work item k goes to replica k of each teacher's pool (round-robin)."""
        aheads, start = [], 0
        for k, item in enumerate(self._in_flight[handle.id]):
            groups: dict[str, list[int]] = {}
            for j in range(len(item.planned)):
                groups.setdefault(teacher_of[start + j], []).append(j)
            start += len(item.planned)
            calls = []
            for name, idx in groups.items():
                r = k % len(self.teachers[name])
                actor = self.teachers[name][r]
                calls.append((name, r, idx, actor.score_played.options(num_returns=len(idx) + 1).remote(item.ref, idx, mode), actor))
            aheads.append(_Ahead(item, item.ref, calls))
        self._ahead[handle.id] = (aheads, mode)

    def ahead_scores(self, handle: RolloutHandle) -> list[TeacherScores | None] | None:
        """The scores `score_ahead` started on `handle`'s episodes (collected), in plan order; None for an episode whose
        item was played again (its rollout actor died) or whose teacher replica died (replaced here): the caller scores
        those with `score`. None if no scoring was started on `handle`."""
        from ray.exceptions import RayActorError

        if handle.id not in self._ahead:
            return None
        aheads, mode = self._ahead.pop(handle.id)
        out: list[TeacherScores | None] = []
        for ahead in aheads:
            part: list[TeacherScores | None] = [None] * len(ahead.item.planned)
            for name, r, idx, refs, actor in ahead.calls if ahead.item.ref is ahead.played else ():
                try:
                    scores = self._scores(refs, mode)
                except RayActorError as e:
                    self._replace_teacher(name, r, actor, e)
                    continue
                for j, sc in zip(idx, scores, strict=True):
                    part[j] = sc
            out += part
        return out

    def score(self, by_teacher: dict[str, list[TokenStream]], mode: TeacherMode) -> dict[str, list[TeacherScores]]:
        from ray.exceptions import RayActorError

        def submit(actor: Any, streams: list[TokenStream]) -> list[Any]:  # the scores' ref, then one per stream's rows
            return actor.score_apart.options(num_returns=len(streams) + 1).remote(streams, mode)

        jobs = []  # (teacher, replica, slice, refs, actor)
        for name, streams in by_teacher.items():
            pool = self.teachers[name]
            size = math.ceil(len(streams) / len(pool)) if streams else 0
            for r in range(len(pool)):
                part = slice(r * size, min((r + 1) * size, len(streams)))
                if part.start < part.stop:
                    jobs.append([name, r, part, submit(pool[r], streams[part]), pool[r]])
        out: dict[str, list[Any]] = {name: [None] * len(s) for name, s in by_teacher.items()}
        for job in jobs:
            name, r, part = job[:3]
            while True:
                try:
                    out[name][part] = self._scores(job[3], mode)
                    break
                except RayActorError as e:
                    self._replace_teacher(name, r, job[4], e)
                    job[4] = self.teachers[name][r]
                    job[3] = submit(job[4], by_teacher[name][part])
        return out

    def score_replicas(self, name: str, streams: list[TokenStream], mode: TeacherMode) -> list[list[TeacherScores]]:
        """Every replica of `name`'s pool scores every stream (the teacher's self-test, agentopd.step.selftest); a replica
        found dead is replaced and asked again."""
        from ray.exceptions import RayActorError

        out = []
        for r in range(len(self.teachers[name])):
            while True:
                actor = self.teachers[name][r]
                try:
                    out.append(self._scores(actor.score_apart.options(num_returns=len(streams) + 1).remote(streams, mode), mode))
                    break
                except RayActorError as e:
                    self._replace_teacher(name, r, actor, e)
        return out

    def teacher_events(self) -> dict[str, str]:
        """{teacher: its replicas restarted, a server teacher's reconnects (each replica's client: TeacherWorker.reconnects)
        and the engines' sleep/wake since the last call} (Backend.teacher_events)."""
        from ray.exceptions import RayActorError

        for name, actors in self.teachers.items():
            if not is_server(self.ctx.teacher_refs[name]):
                continue
            for r, actor in enumerate(actors):
                try:
                    found = self.ray.get(actor.reconnects.remote())
                except RayActorError:  # dead: the next scoring replaces it, and that restart is an event of its own
                    continue
                self._teacher_events.setdefault(name, []).extend(f"replica {r}'s {e}" for e in found)
        events, self._teacher_events = self._teacher_events, {}
        return {name: " and ".join(dict.fromkeys(e)) for name, e in events.items() if e}

    def teacher_head(self, name: str) -> torch.Tensor:
        """The teacher's lm_head, fetched once (its weights never change: 1.2 GB for a Qwen3-8B head, which went through
        the object store twice a step before), with the ObjectRef `train` hands the trainer ranks."""
        if name not in self._heads:
            head = self.ray.get(self.teachers[name][0].head_weight.remote())
            self._heads[name] = (head, self.ray.put(head))
        return self._heads[name][0]

    def _head_ref(self, head: torch.Tensor | list[torch.Tensor]) -> Any:
        """The stored ref of a head `teacher_head` gave (a list: one per teacher), else a new one."""
        refs = {id(h): ref for h, ref in self._heads.values()}
        if isinstance(head, torch.Tensor):
            return refs[id(head)] if id(head) in refs else self.ray.put(head)
        if all(id(h) in refs for h in head):
            return [refs[id(h)] for h in head]  # a list of refs: the rank gets each (TrainerWorker.train)
        return self.ray.put(head)

    # ---- trainer ------------------------------------------------------------------------------
    def _trainer_lost(self, error: TrainerLost) -> None:
        """Rebuild the group from the last finished checkpoint; the runner replays what came after."""
        self._restart("trainer", error)
        step = self.group.restart(self._checkpoint)
        self.version = step
        raise TrainerRestarted(step, str(error)) from error

    def train(self, samples: list[TrainSample], head: torch.Tensor | list[torch.Tensor] | None, loss: LossKind | None = None,
              temperature: float | None = None) -> dict[str, float]:  # fmt: skip
        self._settle()
        ranks = self.rc.trainer_workers
        shares: list[list[TrainSample]] = [[] for _ in range(ranks)]
        load = [0] * ranks
        for s in sorted(samples, key=lambda s: -s.num_tokens):  # token-balanced shares
            r = load.index(min(load))
            shares[r].append(s)
            load[r] += s.num_tokens
        head_ref = self._head_ref(head) if head is not None else None
        self._timings = {}  # this step's (stats() reads them after the sync)
        if self.rc.engine_sleep:
            self._sleep_engines()
        try:
            metrics = self.group.call("train", head_ref, loss, temperature, per_rank=shares)
            self.version = self.group.call("step")[0]  # a skipped step (no student tokens) is no new version
        except TrainerLost as e:
            self._trainer_lost(e)
        return metrics[0]

    def sync_weights(self) -> None:
        """Trainer -> every rollout engine, by `self.weight_sync`. Waited for unless in async mode."""
        self._push_weights(wait=not self.ctx.cfg.async_.enabled)

    def _push_weights(self, wait: bool) -> None:
        self._settle()
        if self.weight_sync == WeightSync.OBJECT_STORE:
            self._sync_object_store(wait)
        elif self.weight_sync == WeightSync.BROADCAST:
            self._sync_broadcast(wait)
        else:
            self._sync_ipc(wait)

    def _sync_object_store(self, wait: bool) -> None:
        t0 = time.perf_counter()
        refs = self.group.submit("state_dict")  # a collective: every rank takes part; rank 0 holds the weights
        try:
            self.group.wait(refs)
        except TrainerLost as e:
            self._trainer_lost(e)
        self.weights_ref, self.weights_version = refs[0], self.version
        t1 = time.perf_counter()
        pushes = [(i, w, w.update_weights.remote(self.weights_ref, self.version)) for i, w in enumerate(self.workers)]
        if wait:
            self._await_workers(pushes)
        self._timings |= {"perf/weight_gather_s": t1 - t0, "perf/weight_push_s": time.perf_counter() - t1}

    def _sync_broadcast(self, wait: bool) -> None:
        t0 = time.perf_counter()
        self._replace_dead_workers()
        self._form_weight_group()
        t1 = time.perf_counter()
        sends = self.group.submit("send_weights", self._layout)
        pushes = [(i, w, w.receive_weights.remote(self._layout, self.version)) for i, w in enumerate(self.workers)]
        self._timings["perf/weight_group_s"] = t1 - t0
        self._pending = [sends, pushes, None, t1]
        if wait:
            self._settle()

    def _sync_ipc(self, wait: bool) -> None:
        t0 = time.perf_counter()
        refs = self.group.submit("share_weights", self._weight_layout())  # rank 0 holds one flat GPU buffer
        try:
            handle = self.group.wait(refs)[0]
        except TrainerLost as e:
            self._trainer_lost(e)
        t1 = time.perf_counter()
        pushes = [(i, w, w.load_ipc.remote(handle, self._layout, self.version)) for i, w in enumerate(self.workers)]
        self._timings["perf/weight_gather_s"] = t1 - t0
        self._pending = [None, pushes, "unshare_weights", t1]
        if wait:
            self._settle()

    def _settle(self) -> None:
        """Wait for the weight sync still running (broadcast or ipc), then release what it held."""
        if not self._pending:
            return
        sends, pushes, release, t1 = self._pending
        self._pending = []
        if sends is not None:
            try:
                seconds = self.group.wait(sends)[0]
            except TrainerLost as e:
                self._trainer_lost(e)
            self._timings["perf/weight_broadcast_s"] = seconds
        self._await_workers(pushes)
        if release is not None:
            self.group.call(release)
        self._timings["perf/weight_push_s"] = time.perf_counter() - t1

    def _weight_layout(self) -> WeightLayout:
        if self._layout is None:
            dtype = torch.bfloat16 if self.reservation.placement.role(ROLLOUT).gpus > 0 else torch.float32
            self._layout = self.ray.get(self.group.ranks[0].weight_layout.remote(dtype))
        return self._layout

    def _form_weight_group(self) -> None:
        """Trainer rank 0 and every rollout worker in one broadcast group; formed again when one was replaced."""
        members = (self.group.ranks[0], *self.workers)
        if len(members) == len(self._weight_members) and all(a is b for a, b in zip(members, self._weight_members)):
            return
        self._weight_layout()
        world, rank0 = len(members), members[0]
        addr, port = self.ray.get(rank0.host_weights.remote(world))
        joins = [rank0.join_weights.remote(addr, port, world)]
        joins += [w.join_weights.remote(addr, port, i + 1, world) for i, w in enumerate(self.workers)]
        self.ray.get(joins)
        self._weight_members = members

    def _weight_sync_mode(self) -> WeightSync:
        """`ray.weight_sync`, `auto` resolved from the GPUs Ray gave trainer rank 0 and the workers; a mode
        the placement cannot serve is refused here, before the first step."""
        asked = WeightSync(self.rc.weight_sync)
        trainer = set(self.group.call("gpu_ids")[0])
        workers = [set(g) for g in self.ray.get([w.gpu_ids.remote() for w in self.workers])]
        shared = [bool(g & trainer) for g in workers]
        on_gpus = bool(trainer) and all(workers)
        if asked == WeightSync.AUTO:
            if not on_gpus:
                return WeightSync.OBJECT_STORE
            return WeightSync.IPC if all(shared) else WeightSync.BROADCAST if not any(shared) else WeightSync.OBJECT_STORE
        if asked == WeightSync.IPC and not (on_gpus and all(shared)):
            raise PlacementError(
                f"ray.weight_sync=ipc needs every rollout worker on trainer rank 0's GPU; trainer rank 0 has GPU "
                f"{sorted(trainer) or 'none'}, the workers {[sorted(g) or 'none' for g in workers]}"
            )
        if asked == WeightSync.BROADCAST and on_gpus and any(shared):
            raise PlacementError(
                "ray.weight_sync=broadcast cannot run NCCL between two actors of one GPU: a rollout worker shares "
                f"trainer rank 0's GPU {sorted(trainer)}; use ray.weight_sync=ipc (all on that GPU) or object_store"
            )
        return asked

    # ---- checkpoints and export ------------------------------------------------------------------
    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        self._settle()

        def write(tmp: Path) -> None:  # every rank's part (a shared file system)
            try:
                self.group.call("save", str(tmp), extra)
            except TrainerLost as e:
                self._trainer_lost(e)

        write_checkpoint(path, extra["step"], write)
        self._checkpoint = path

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        self._settle()
        extras = self.group.call("load", str(path))
        self.version = self.group.call("step")[0]
        self._checkpoint = path
        return extras[0]

    def export(self, out_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
        self._settle()
        tok_dir = RunDir(out_dir.parent).tokenizer
        if not (tok_dir / "tokenizer_config.json").exists():
            tokenizer.save_pretrained(tok_dir)
        self.group.call("export", str(out_dir), str(tok_dir))

    def memory_peaks(self) -> dict[int, PhaseMemory]:
        """Per GPU of the run's placement (`gpu_index` of the roles reserved in `connect`, as the memory plan places
        them; a server teacher's clients on none): the PhaseMemory of the actors placed there since the last call,
        summed (each actor's own peak: an upper bound where they peaked apart). Asks every actor, so it waits for one
        that is busy: the runner measures only where the phases do not overlap."""
        gpu = gpu_index(self.placement.roles)
        pools = {TRAINER: self.group.ranks, ROLLOUT: self.workers} | {teacher_role(n): p for n, p in self.teachers.items()}
        placed = [(gpu.get((role, i), -1), a) for role, pool in pools.items() for i, a in enumerate(pool)]
        placed = [(g, a) for g, a in placed if g >= 0]
        peaks = self.ray.get([a.memory_peak.remote() for _, a in placed])
        out: dict[int, PhaseMemory] = {}
        for (g, _), peak in zip(placed, peaks):
            out[g] = out.get(g, PhaseMemory(0.0, 0.0)) + PhaseMemory(*peak)
        return out

    def stats(self) -> dict[str, float]:
        rollout, self._rollout_stats = self._rollout_stats, {}
        return {**self._timings, **rollout, **{f"ray/{role}_restarts": float(n) for role, n in self.restarts.items()}}

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        for actor in [*self.workers, *(a for pool in self.teachers.values() for a in pool)]:
            self.ray.kill(actor, no_restart=True)
        if self.reservation is not None:
            self.reservation.release(self.ray)
        if self._owns_ray:
            self.ray.shutdown()


def start_ray(ray: Any, address: str | None, **local: Any) -> None:
    """`ray.init` for a run: its workers' logs stay off the driver. A local cluster (no address) is started without
    Ray's warning that token authentication is on and how to opt out, which it printed on every run: it is Ray's own
    default and nothing the run asks the user to act on (RAY_AUTH_MODE=disabled still opts out)."""
    import logging

    if address is None:
        logging.getLogger(RAY_TOKEN_LOGGER).setLevel(logging.ERROR)
    ray.init(address=address, log_to_driver=False, **local)
