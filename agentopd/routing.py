"""Which teacher scores which episode (multi-teacher routing).

    router = Router.from_config(cfg, mixture)       # raises ValueError before the run when a task has no teacher
    router.teacher_of(planned)                      # teacher name of that episode
    router.refs                                     # teacher name -> model reference (builtin..., folder, hub id, URL)
    router.builtin_env(name, ref)                   # the env whose built-in teacher a `builtin` reference means

Routing only looks up: it builds no model. The bootstrap stage (agentopd.run_models) turns the references into
from_pretrained references, building the embedded models on first use.

`teachers:` maps names to models; `teacher_key: env` routes an episode to the teacher
named like its env, `teacher_key: data_source` to the one named like its task's
`data["data_source"]` (or, for tasks without one, its source key). Every training task of
every source is checked before the run: a task whose key names no teacher is a ValueError
listing the teachers. With no `teachers:` the single `teacher.path` scores everything; a mixed
run with no teachers and `teacher.path=builtin` routes each env to its own built-in teacher.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Any

from agentopd.plan import Mixture, Planned
from agentopd.rollout import EpisodeSpec

if TYPE_CHECKING:
    from agentopd.config import Config

# the model references routing reads (agentopd.models names them; routing imports no model code: tests/test_layout.py)
BUILTIN = "builtin"
CROSS = "cross"


class TeacherKey(StrEnum):
    """`teacher_key`: the episode field matched against the teacher names."""

    ENV = "env"  # the episode's env name
    DATA_SOURCE = "data_source"  # its task's data["data_source"], else its source key


class Router:
    """Which teacher scores which episode (see the module docstring)."""

    DEFAULT = "teacher"  # the one teacher's name when `teachers:` is empty

    def __init__(self, mixture: Mixture, refs: dict[str, str], teacher_key: TeacherKey | str, *, single: bool = False):
        self.mixture = mixture
        self.refs = dict(refs)  # teacher name -> model reference (builtin..., folder, hub id)
        self.teacher_key = TeacherKey(teacher_key)
        self.single = single
        self.envs_of: dict[str, set[str]] = {name: set() for name in self.refs}  # filled by check()

    @classmethod
    def from_config(cls, cfg: Config, mixture: Mixture) -> Router:
        if cfg.mix.teachers:
            router = cls(mixture, cfg.mix.teachers, cfg.mix.teacher_key)
        elif mixture.mixed and cfg.teacher.path == BUILTIN:
            if cfg.mix.teacher_key != TeacherKey.ENV:
                raise ValueError("teacher_key=data_source needs `teachers:` (name -> model); the built-in teachers are routed by env")
            router = cls(mixture, {e: f"{BUILTIN}:{e}" for e in mixture.env_names}, TeacherKey.ENV)
        else:
            router = cls(mixture, {cls.DEFAULT: cfg.teacher.path}, cfg.mix.teacher_key, single=True)
        router.check()
        return router

    def teacher_of(self, planned: Planned, split: str = "train") -> str:
        if self.single:
            return self.DEFAULT
        return self.route_key(planned, split)

    def route_key(self, planned: Planned, split: str = "train") -> str:
        """The value an episode is routed on: its env name, or its task's data source."""
        source = self.mixture.sources[planned.source]
        if self.teacher_key == TeacherKey.ENV:
            return source.env_name
        task = self.mixture.task(planned.source, planned.spec.task_id, split)
        return str(task.data.get("data_source") or source.key) if task is not None else source.key

    def check(self) -> None:
        """Every training task of every source must route to a teacher: ValueError otherwise."""
        for key, source in self.mixture.sources.items():
            for task in self.mixture.tasks(key):
                name = self.teacher_of(Planned(key, EpisodeSpec(task_id=task.id, seed=0, episode_id="check")))
                if name not in self.refs:
                    raise ValueError(
                        f"task {task.id!r} of source {key!r} routes to teacher {name!r} (teacher_key={self.teacher_key}), "
                        f"but teachers has only {sorted(self.refs)}: add teachers.{name}=<model>"
                    )
                self.envs_of[name].add(source.env_name)

    def kwargs_of(self, env: str | None) -> dict[str, Any] | None:
        """The constructor arguments the run gives `env` (its one source's), for its embedded models."""
        kwargs = [s.kwargs for s in self.mixture.sources.values() if s.env_name == env]
        return kwargs[0] if len(kwargs) == 1 else None

    def builtin_env(self, name: str, ref: str) -> str | None:
        """The env whose built-in teacher `ref` means: `builtin:<env>`, or `builtin` for the one env it scores."""
        if ref.startswith(f"{BUILTIN}:") and ref.split(":", 1)[1] not in ("teacher", "student", CROSS):
            return ref.split(":", 1)[1]
        if ref not in (BUILTIN, f"{BUILTIN}:teacher", f"{BUILTIN}:{CROSS}"):
            return None
        envs = sorted(self.envs_of.get(name, ()))
        if len(envs) != 1:
            raise ValueError(f"teachers.{name}={ref}: it scores envs {envs}; say builtin:<env> to pick one env's built-in teacher")
        return envs[0]
