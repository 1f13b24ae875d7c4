"""Backends: where the runner's stages run. The runner (agentopd.runner) owns the loop, the data
plan, the store and the metrics; a backend plays episodes, scores them, trains and syncs weights.

    backend = make_backend(cfg)        # run.backend: local | ray
    backend.setup(ctx, tokenizer)      # ctx: agentopd.backends.stages.RunContext

base.py    the Backend protocol both implement (and what `policy_version` means)
local.py   LocalBackend: every stage in this process
ray.py     RayBackend: rollout workers, teacher pools, a trainer group of N ranks (Ray actors)
stages.py  the stage code both run (playing planned episodes, routed teacher scoring)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentopd.backends.base import Backend
    from agentopd.config import Config


def make_backend(cfg: Config) -> Backend:
    if cfg.run.backend == "ray":
        from agentopd.backends.ray import RayBackend

        return RayBackend()
    from agentopd.backends.local import LocalBackend

    return LocalBackend()
