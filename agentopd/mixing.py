"""Mixed environments in one run, multi-teacher routing, and the mixed built-in student.

    mixture = Mixture.from_config(cfg)              # one source per `envs.<name>` (or just `env`)
    planned = mixture.plan(step, tasks_per_step=16, n=4, seed=0, policy_version=v)
    planned[0].source, planned[0].spec              # which source, and the EpisodeSpec to play
    router = Router.from_config(cfg, mixture)       # raises ValueError before the run when a task has no teacher
    router.teacher_of(planned[0])                   # teacher name of that episode
    path = mixed_student(["calculator", "sql_db"])  # built-in student SFT'd on every env's demos (cached)

Sources. A single-env run has one source, named after its env. A mixed run (`--env a,b`, or
`envs:` with weights) has one per `envs` key; a key names the source (its "data source"), the
entry's `name` the env to make (default: the key), `weight` its share of every step's tasks
(largest-remainder quotas, the remainder drawn by weight: a pure function of seed and step, so a
resumed run sees the same data). Episode ids stay `train-<step>-<slot>` over the whole step, so
sources never collide and re-runs replace rows instead of adding them.

Routing. `teachers:` maps names to models; `teacher_key: env` routes an episode to the teacher
named like its env, `teacher_key: data_source` to the one named like its task's
`data["data_source"]` (or, for tasks without one, its source key). Every training task of
every source is checked before the run: a task whose key names no teacher is a ValueError
listing the teachers. With no `teachers:` the single `teacher.path` scores everything; a mixed
run with no teachers and `teacher.path=builtin` routes each env to its own built-in teacher.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentopd.env import ToolEnv
from agentopd.evaluate import eval_task_ids
from agentopd.models import BUILTIN, resolve_model
from agentopd.registry import make_env
from agentopd.rollout import EpisodeSpec, Rollout


@dataclass(frozen=True)
class Source:
    """One stream of tasks: a named env configuration with a sampling weight."""

    key: str  # the source name (data source); equals env_name for single-env runs
    env_name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0

    def factory(self, split: str = "train") -> Callable[[], ToolEnv]:
        kwargs = dict(self.kwargs)
        if "split" in kwargs or split != "train":
            kwargs["split"] = split
        return lambda: make_env(self.env_name, **kwargs)


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
        self._tasks: dict[tuple[str, str], list[Any]] = {}
        self._by_id: dict[tuple[str, str], dict[str, Any]] = {}

    @classmethod
    def from_config(cls, cfg: Any) -> Mixture:
        if cfg.mix.envs:
            return cls([Source(k, e.name or k, e.kwargs, e.weight) for k, e in cfg.mix.envs.items()])
        return cls([Source(cfg.env.name, cfg.env.name, cfg.env.kwargs)])

    @property
    def mixed(self) -> bool:
        return len(self.sources) > 1

    @property
    def env_names(self) -> list[str]:
        return sorted({s.env_name for s in self.sources.values()})

    def tasks(self, source: str, split: str = "train") -> list[Any]:
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

    def route_key(self, planned: Planned, teacher_key: str, split: str = "train") -> str:
        """The value an episode is routed on: its env name, or its task's data source."""
        source = self.sources[planned.source]
        if teacher_key == "env":
            return source.env_name
        task = self._task(planned.source, planned.spec.task_id, split)
        return str(task.data.get("data_source") or source.key) if task is not None else source.key

    def _task(self, source: str, task_id: str, split: str) -> Any:
        by_id = self._by_id.setdefault((source, split), {t.id: t for t in self.tasks(source, split)})
        return by_id.get(task_id)


class Router:
    """Which teacher scores which episode (see the module docstring)."""

    DEFAULT = "teacher"  # the one teacher's name when `teachers:` is empty

    def __init__(self, mixture: Mixture, refs: dict[str, str], teacher_key: str, *, single: bool = False):
        self.mixture = mixture
        self.refs = dict(refs)  # teacher name -> model reference (builtin..., folder, hub id)
        self.teacher_key = teacher_key
        self.single = single
        self.envs_of: dict[str, set[str]] = {name: set() for name in self.refs}  # filled by check()

    @classmethod
    def from_config(cls, cfg: Any, mixture: Mixture) -> Router:
        if cfg.mix.teachers:
            router = cls(mixture, cfg.mix.teachers, cfg.mix.teacher_key)
        elif mixture.mixed and cfg.teacher.path == BUILTIN:
            if cfg.mix.teacher_key != "env":
                raise ValueError("teacher_key=data_source needs `teachers:` (name -> model); the built-in teachers are routed by env")
            router = cls(mixture, {e: f"{BUILTIN}:{e}" for e in mixture.env_names}, "env")
        else:
            router = cls(mixture, {cls.DEFAULT: cfg.teacher.path}, cfg.mix.teacher_key, single=True)
        router.check()
        return router

    def teacher_of(self, planned: Planned, split: str = "train") -> str:
        if self.single:
            return self.DEFAULT
        return self.mixture.route_key(planned, self.teacher_key, split)

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

    def resolve(self, progress: Any = None) -> dict[str, Path | str]:
        """Teacher name -> something from_pretrained takes (built-in teachers bootstrapped on demand)."""
        out = {}
        for name, ref in self.refs.items():
            env = self._builtin_env(name, ref)
            out[name] = resolve_model(BUILTIN if env else ref, env or "", "teacher", progress)
        return out

    def _builtin_env(self, name: str, ref: str) -> str | None:
        """The env whose built-in teacher `ref` means: `builtin:<env>`, or `builtin` for the one env it scores."""
        if ref.startswith(f"{BUILTIN}:") and ref.split(":", 1)[1] not in ("teacher", "student"):
            return ref.split(":", 1)[1]
        if ref not in (BUILTIN, f"{BUILTIN}:teacher"):
            return None
        envs = sorted(self.envs_of.get(name, ()))
        if len(envs) != 1:
            raise ValueError(f"teachers.{name}={ref}: it scores envs {envs}; say builtin:<env> to pick one env's built-in teacher")
        return envs[0]


def resolve_student(cfg: Any, mixture: Mixture, progress: Any = None) -> Path | str:
    """The student reference: a mixed run's `builtin` is the student that has seen every env."""
    if mixture.mixed and cfg.student.path in (BUILTIN, f"{BUILTIN}:student"):
        return mixed_student(mixture.env_names, progress=progress)
    env = mixture.env_names[0]
    return resolve_model(cfg.student.path, env, "student", progress)


def mixed_student(env_names: Sequence[str], *, spec: Any = None, home: Path | None = None, force: bool = False,
                  progress: Any = None) -> Path:  # fmt: skip
    """A built-in student SFT'd on the union of the envs' oracle demonstrations, cached under
    `$AGENTOPD_HOME/models/mixed/<env+env>/student` (the built-in teachers of the envs are built too:
    a mixed run routes to them)."""
    import torch
    from transformers import Qwen3ForCausalLM

    from agentopd.bootstrap import (
        BUILTIN_ENVS, BootstrapSpec, _atomic_dir, agentopd_home, bootstrap, demonstrations, ensure_tokenizer,
        preset_env_kwargs, sft,
    )  # fmt: skip
    from agentopd.evaluate import evaluate
    from agentopd.rollout import RolloutConfig

    names = sorted(set(env_names))
    bad = [n for n in names if n not in BUILTIN_ENVS]
    if bad:
        raise ValueError(f"no built-in models for env {bad[0]!r}: built-in envs are {list(BUILTIN_ENVS)}; pass student=PATH and teachers")
    per_env_spec, spec = spec, spec or BootstrapSpec()  # each env's own models: its own recipe unless one is given
    home = home or agentopd_home()
    root = home / "models" / "mixed" / "+".join(names)
    out, report_path = root / "student", root / "report.json"
    env_kwargs = {n: preset_env_kwargs(n) for n in names}  # the presets' tasks, as bootstrap() uses
    if not force and report_path.exists() and (out / "config.json").exists():
        cached = json.loads(report_path.read_text())
        if cached.get("test") or cached.get("env_kwargs") == json.loads(json.dumps(env_kwargs)):
            return out
    for name in names:
        bootstrap(name, spec=per_env_spec, home=home, progress=progress)
    t0 = time.perf_counter()
    tok = ensure_tokenizer(spec, home=home)
    demos = [d for n in names for d in demonstrations(n, tok, spec.demonstrations, spec.max_context, env_kwargs=env_kwargs[n])]
    torch.manual_seed(spec.student.seed)
    model = Qwen3ForCausalLM(spec.student.size.config(tok, spec.max_context))
    train = sft(model, demos, spec.student, progress=progress, name="student")
    model.eval()
    rollout = RolloutConfig(temperature=0.0, max_context=spec.max_context)
    train["success"] = {
        n: evaluate(model, tok, n, env_kwargs=env_kwargs[n], split="eval", num_tasks=spec.eval_tasks, rollout=rollout).success_rate
        for n in names
    }
    train["parameters"] = sum(p.numel() for p in model.parameters())

    def save(path: Path) -> None:
        model.save_pretrained(path)
        tok.save_pretrained(path)

    _atomic_dir(out, save)
    report = {"envs": names, "env_kwargs": env_kwargs, "demonstrations": len(demos), "student": train, "seconds": round(time.perf_counter() - t0, 1)}
    report_path.write_text(json.dumps(report, indent=2))
    return out
