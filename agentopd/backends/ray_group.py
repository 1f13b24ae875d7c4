"""The trainer group of the Ray backend: N TrainerWorker ranks forming one torch.distributed group
(gloo on CPU, NCCL on GPU), and its restart from a checkpoint when a rank dies.

    group = TrainerGroup(ray, ctx, rc, reservation)          # ranks up, process group formed
    metrics = group.call("train", head_ref, per_rank=shares)  # one call per rank; TrainerLost if a rank died
    refs = group.submit("state_dict"); group.wait(refs)       # the same, keeping the ObjectRefs
    step = group.restart(checkpoint)                          # a new group from `checkpoint` (None: the initial weights)

A dead rank leaves its peers blocked inside a collective (gloo waits for the missing rank), so a call
returns once every rank answered or as soon as one is found dead, never waiting on the blocked ones;
`restart` then kills every rank and forms a new group in the same placement-group bundles. The
backend raises `TrainerRestarted(step)` to the runner, which forgets the steps after `step` and plays
them again: the plan and the sampling seeds are functions of (seed, step, slot, turn), so the replayed
steps are the ones an uninterrupted run plays.

No module-level import of ray. `TrainerRestarted` is part of the Backend protocol (backends/base.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentopd.backends.placement import Reservation
    from agentopd.backends.stages import RunContext
    from agentopd.config import RayConfig


class TrainerLost(RuntimeError):
    """A rank of the trainer group died (its process group cannot be re-formed mid-step)."""


class TrainerGroup:
    def __init__(self, ray: Any, ctx: RunContext, rc: RayConfig, reservation: Reservation):
        self.ray, self.ctx, self.rc, self.reservation = ray, ctx, rc, reservation
        self.ranks: list[Any] = []
        self._spawn()

    def _spawn(self) -> None:
        from agentopd.backends.placement import TRAINER
        from agentopd.backends.ray_actors import TrainerWorker

        rc, cls = self.rc, self.ray.remote(TrainerWorker)
        world = rc.trainer_workers
        self.ranks = [
            cls.options(**self.reservation.options(TRAINER, r)).remote(self.ctx, r, world, rc.gpus_per_trainer_worker, rc.threads_per_actor)
            for r in range(world)
        ]
        addr, port = self.wait([self.ranks[0].rendezvous.remote()])[0]
        self.call("init", addr, port)

    def submit(self, method: str, *args: Any, per_rank: list[Any] | None = None) -> list[Any]:
        """`method(*args)` on every rank (with `per_rank[r]` first, when given): the ObjectRefs."""
        return [getattr(a, method).remote(*(() if per_rank is None else (per_rank[r],)), *args) for r, a in enumerate(self.ranks)]

    def wait(self, refs: list[Any]) -> list[Any]:
        """The results of `refs`; TrainerLost as soon as one of them comes from a dead rank, or fails because a
        rank died (a survivor's collective breaks when its peer is killed, and may report first)."""
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        pending = list(refs)
        while pending:
            ready, pending = self.ray.wait(pending, num_returns=1)
            try:
                self.ray.get(ready[0])
            except (RayActorError, ActorUnavailableError) as e:
                raise TrainerLost(str(e).splitlines()[0]) from e
            except RayTaskError as e:
                dead = self._dead_rank()
                if dead is not None:
                    raise TrainerLost(dead) from e
                raise
        return self.ray.get(refs)

    def _dead_rank(self, timeout_s: float = 30.0) -> str | None:
        """Which rank is gone, if one is: each is asked for its pid; a dead one answers with RayActorError."""
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        for r, actor in enumerate(self.ranks):
            try:
                self.ray.get(actor.pid.remote(), timeout=timeout_s)
            except (RayActorError, ActorUnavailableError) as e:
                return f"rank {r}: {str(e).splitlines()[0]}"
            except GetTimeoutError:
                continue
        return None

    def call(self, method: str, *args: Any, per_rank: list[Any] | None = None) -> list[Any]:
        return self.wait(self.submit(method, *args, per_rank=per_rank))

    def restart(self, checkpoint: Path | None) -> int:
        """Every rank killed, a new group formed, `checkpoint` loaded (None: the initial weights); its step."""
        self.kill()
        self._spawn()
        if checkpoint is not None:
            self.call("load", str(checkpoint))
        return self.call("step")[0]

    def kill(self) -> None:
        for actor in self.ranks:
            self.ray.kill(actor, no_restart=True)
        self.ranks = []

    def close(self) -> None:
        try:
            self.call("close")
        except Exception:  # noqa: BLE001 - a dead rank has nothing to close
            pass
        self.kill()
