"""What each step plays: the run's sources (envs), their mixture, and the episodes planned per step.

    mixture = Mixture.from_config(cfg)              # one source per `envs.<name>` (or just `env`)
    planned = mixture.plan(step, tasks_per_step=16, n=4, seed=0, policy_version=v)
    planned[0].source, planned[0].spec              # which source, and the EpisodeSpec to play
    evals = mixture.eval_plan(step, num_tasks=100, seed=0)   # the fixed held-out sample

Sources. A single-env run has one source, named after its env. A mixed run (`--env a,b`, or
`envs:` with weights) has one per `envs` key; a key names the source (its "data source"), the
entry's `name` the env to make (default: the key), `weight` its share of every step's tasks
(largest-remainder quotas, the remainder drawn by weight: a pure function of seed and step, so a
resumed run sees the same data). Episode ids stay `train-<step>-<slot>` over the whole step, so
sources never collide and re-runs replace rows instead of adding them.

Which teacher scores an episode is agentopd.routing; which models play is agentopd.models.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentopd.env import Task, ToolEnv
from agentopd.evaluate import eval_task_ids
from agentopd.splits import make_env_for_split, without_split
from agentopd.rollout import EpisodeSpec, Rollout

if TYPE_CHECKING:
    from agentopd.config import Config


@dataclass(frozen=True)
class Source:
    """One stream of tasks: a named env configuration with a sampling weight."""

    key: str  # the source name (data source); equals env_name for single-env runs
    env_name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0

    def factory(self, split: str = "train") -> Callable[[], ToolEnv]:
        """Envs of this source serving `split` (agentopd.splits: the env's own `split`, or a held-out share)."""
        kwargs = without_split(self.kwargs)
        return lambda: make_env_for_split(self.env_name, split, **kwargs)


@dataclass(frozen=True)
class Planned:
    """One episode to play: its source and spec."""

    source: str
    spec: EpisodeSpec


class Mixture:
    """The sources of a run and the per-step plan of what to play (see the module docstring)."""

    def __init__(self, sources: Sequence[Source]):
        if not sources:
            raise ValueError("a run needs at least one env")
        self.sources = {s.key: s for s in sources}
        self._tasks: dict[tuple[str, str], list[Task]] = {}
        self._by_id: dict[tuple[str, str], dict[str, Task]] = {}

    @classmethod
    def from_config(cls, cfg: Config) -> Mixture:
        if cfg.mix.envs:
            return cls([Source(k, e.name or k, e.kwargs, e.weight) for k, e in cfg.mix.envs.items()])
        return cls([Source(cfg.env.name, cfg.env.name, cfg.env.kwargs)])

    @property
    def mixed(self) -> bool:
        return len(self.sources) > 1

    @property
    def env_names(self) -> list[str]:
        return sorted({s.env_name for s in self.sources.values()})

    def tasks(self, source: str, split: str = "train") -> list[Task]:
        """The Task records of a source's split (loaded once)."""
        if (source, split) not in self._tasks:
            env = self.sources[source].factory(split)()
            self._tasks[source, split] = list(env.tasks)
            env.close()
        return self._tasks[source, split]

    def quotas(self, total: int, rng: random.Random) -> dict[str, int]:
        """How many of `total` tasks each source gets: floor of its share, the rest drawn by weight."""
        keys = list(self.sources)
        weights = [self.sources[k].weight for k in keys]
        norm = sum(weights)
        exact = [total * w / norm for w in weights]
        out = {k: int(e) for k, e in zip(keys, exact)}
        rest = total - sum(out.values())
        remainders = [e - int(e) for e in exact]
        while rest > 0:
            k = rng.choices(keys, weights=[r if r > 0 else 0 for r in remainders] if any(remainders) else weights)[0]
            out[k] += 1
            remainders[keys.index(k)] = 0
            rest -= 1
        return out

    def plan(self, step: int, *, tasks_per_step: int, n: int, seed: int, policy_version: int = 0) -> list[Planned]:
        """The training episodes of a step: a pure function of (seed, step)."""
        rng = random.Random(seed * 1_000_003 + step)
        if not self.mixed:  # the single-env draw the local runner always made
            (key,) = self.sources
            ids = [t.id for t in self.tasks(key)]
            chosen = [(key, t) for t in rng.sample(ids, min(tasks_per_step, len(ids)))]
        else:
            chosen = []
            for key, k in self.quotas(tasks_per_step, rng).items():
                ids = [t.id for t in self.tasks(key)]
                chosen += [(key, t) for t in rng.sample(ids, min(k, len(ids)))]
        specs = Rollout.specs_for([t for _, t in chosen], n=n, step=step, seed=seed, policy_version=policy_version)
        return [Planned(chosen[i // n][0], spec) for i, spec in enumerate(specs)]

    def eval_plan(self, step: int, *, num_tasks: int, seed: int, split: str = "eval") -> list[Planned]:
        """`num_tasks` held-out tasks of every source: a fixed seeded sample, the same whatever the
        run's seed (`agentopd.evaluate.eval_task_ids`: the first N of an env grouped by template
        would test a few templates only); `seed` seeds the episodes' sampling."""
        chosen = [(key, task_id) for key in self.sources for task_id in eval_task_ids(self.tasks(key, split), num_tasks)]
        specs = Rollout.specs_for([t for _, t in chosen], n=1, step=step, seed=seed, split=split)
        return [Planned(chosen[i][0], spec) for i, spec in enumerate(specs)]

    def task(self, source: str, task_id: str, split: str = "train") -> Task | None:
        """A source's task by id (None when the split has no such task)."""
        by_id = self._by_id.setdefault((source, split), {t.id: t for t in self.tasks(source, split)})
        return by_id.get(task_id)
