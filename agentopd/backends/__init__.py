"""Backends: where the runner's stages run. The runner (agentopd.runner) owns the loop, the data
plan, the store and the metrics; a backend plays episodes, scores them, trains and syncs weights.

    backend = make_backend(cfg)        # run.backend: local | ray
    backend.setup(ctx, tokenizer)      # ctx: agentopd.backends.stages.RunContext

local.py   LocalBackend: every stage in this process
ray.py     RayBackend: rollout workers, teacher pools, a trainer group of N ranks (Ray actors)
stages.py  the stage code both run (playing planned episodes, routed teacher scoring)

The interface (both backends): `policy_version`, `teacher_configs()`, `submit_rollout(planned,
config, who)` -> handle, `collect(handle, on_episode)` -> episodes in plan order,
`score({teacher: streams}, mode)`, `teacher_head(name)`, `train(samples, head)` -> metrics,
`sync_weights()`, `save_checkpoint(path, extra)`, `load_checkpoint(path)`, `export(dir, tokenizer)`,
`stats()` -> backend metrics for the step, `close()`.
"""

from __future__ import annotations

from typing import Any


def make_backend(cfg: Any) -> Any:
    if cfg.run.backend == "ray":
        from agentopd.backends.ray import RayBackend

        return RayBackend()
    from agentopd.backends.local import LocalBackend

    return LocalBackend()
