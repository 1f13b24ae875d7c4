"""Backends: where the runner's stages run. The runner (agentopd.runner) owns the loop, the data
plan, the store and the metrics; a backend plays episodes, scores them, trains and syncs weights.

    backend = make_backend(cfg)        # run.backend: local | ray (BackendKind)
    backend.setup(ctx, tokenizer)      # ctx: agentopd.backends.stages.RunContext

base.py         the Backend protocol both implement (and what `policy_version` means), BackendKind,
                TrainerRestarted
stages.py       the stage code both run (RunContext, playing planned episodes, routed teacher scoring)
local.py        LocalBackend: every stage in this process
ray.py          RayBackend: rollout workers, teacher pools, a trainer group of N ranks (Ray actors)
ray_actors.py   the Ray actors, one class per role, each a thin shell around stages.py
ray_group.py    the trainer group: N ranks in one torch.distributed group, restarted from a checkpoint
placement.py    what each Ray role gets (CPUs, GPUs), reserved up front in one placement group
weight_sync.py  the trainer's new weights into the rollout engines (WeightSync: object_store | broadcast | ipc)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentopd.backends.base import Backend, BackendKind, TrainerRestarted

if TYPE_CHECKING:
    from agentopd.config import Config

__all__ = ["Backend", "BackendKind", "TrainerRestarted", "make_backend"]


def make_backend(cfg: Config) -> Backend:
    if cfg.run.backend == BackendKind.RAY:
        from agentopd.backends.ray import RayBackend

        return RayBackend()
    from agentopd.backends.local import LocalBackend

    return LocalBackend()
