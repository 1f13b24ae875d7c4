"""The config tree: typed pydantic sections, YAML presets in `configs/`, dotted overrides.

One scheme for every command. A config is resolved in three layers:

    1. the preset `configs/<env>.yaml` (or the file given with `--config`, which replaces it);
       an env without a preset (a plugin's) starts from `configs/defaults/embedded.yaml`; overrides that
       select a variant of the env (VARIANTS: `env.difficulty=[explore]` on sql_db) start from its preset,
    2. dotted overrides `a.b=c` on top, each value parsed as a YAML scalar
       (`env.max_turns=4` -> 4, `env.tasks=my.jsonl` -> "my.jsonl", `x=null` -> None,
       `lr=1e-6` -> 1e-06: YAML 1.2 numbers, which PyYAML alone would leave as strings),
    3. validation against the typed tree: unknown keys and bad values raise ValueError
       naming the full dotted key and the bad value.

    cfg = load_config("sql_db", overrides=["env.max_turns=4", "run.seed=1"])
    cfg.env.name, cfg.env.kwargs        # "sql_db", {"max_turns": 4, ...}
    cfg.to_yaml("runs/x/config.yaml")   # the fully resolved config

The `env` section is `{name, **kwargs}`: kwargs are free-form per env and are checked
against the env's `__init__` (or factory) signature — an unknown kwarg is an error listing
the accepted ones, a value of the wrong type is an error naming `env.<key>`; kwargs left
out are filled with the signature's defaults so the written config is complete.

Adding a section (e.g. `trainer`): write `class TrainerConfig(Section)` with typed,
defaulted fields and add `trainer: TrainerConfig = Field(default_factory=TrainerConfig)`
to `Config`. Presets and overrides pick it up with no other change. A shorthand top-level
override (`student=PATH` for `student.path=PATH`) is one entry in `SHORTHANDS`.
"""

from __future__ import annotations

import inspect
import re
import typing
from importlib.resources import files
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model, field_validator, model_validator

from agentopd.objectives import Objective

_YAML_SCALARS = (str, int, float, bool, type(None))
# YAML 1.2 floats PyYAML (YAML 1.1) reads as strings: "1e-6", "2E3", "1.e5".
_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EnvConfig(BaseModel):
    """`env`: which environment and its constructor kwargs (free-form, checked against its signature).

    A mixed run (`--env sql_db,calculator`) has the comma-joined source names here and no
    kwargs; its sources, kwargs and weights are the `envs` section (see `EnvEntry`)."""

    model_config = ConfigDict(extra="allow")

    name: str

    @property
    def kwargs(self) -> dict[str, Any]:
        """The kwargs for `agentopd.make_env(self.name, **kwargs)`."""
        return dict(self.model_extra or {})

    @property
    def mixed(self) -> bool:
        return "," in self.name

    @model_validator(mode="after")
    def _check_kwargs(self) -> EnvConfig:
        from agentopd.registry import env_factory  # late: the registry loads env modules

        if self.mixed:
            if self.kwargs:
                key = sorted(self.kwargs)[0]
                raise ValueError(f"env.{key}: a mixed run ({self.name}) takes env kwargs per source, e.g. envs.<source>.{key}")
            return self
        factory = env_factory(self.name)
        for key, value in resolve_kwargs(factory, self.kwargs, prefix="env").items():
            setattr(self, key, value)
        return self


class EnvEntry(BaseModel):
    """One source of a mixed run, `envs.<source>`: an env (`name`, default: the source's own key),
    its sampling `weight` and its constructor kwargs (checked like `env`'s)."""

    model_config = ConfigDict(extra="allow")

    name: str | None = None
    weight: float = Field(1.0, gt=0, description="share of each step's tasks (normalised over the sources)")

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class RunConfig(Section):
    """`run`: what every job shares."""

    seed: int = Field(0, description="seed for task sampling, rollouts and initialisation")
    steps: int = Field(100, ge=0, description="training steps")
    objective: Objective = Field(Objective.OPD, description="opd | sft (teacher episodes) | grpo (reward only)")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    checkpoint_every: int = Field(10, ge=0, description="steps between resumable checkpoints (0 = only at the end)")
    backend: Literal["local", "ray"] = Field("local", description="local (one process) | ray (actors: agentopd.backends.ray)")


class StudentConfig(Section):
    """`student`: the model being trained (`builtin` = the env's embedded student)."""

    path: str = "builtin"


class TeacherConfig(Section):
    """`teacher`: the model that scores the student's tokens (`builtin` = the env's embedded teacher;
    an http(s) URL = a vLLM server's prompt logprobs, agentopd.teacher.ServerTeacher)."""

    path: str = "builtin"
    top_k: int = Field(20, ge=1, description="teacher top-k for trainer.loss=topk_forward_kl (a server: <= its --max-logprobs)")


class EngineConfig(Section):
    """`engine`: what generates the student's episodes."""

    kind: Literal["auto", "hf", "fast", "vllm"] = Field(
        "auto", description="auto (vllm where installed on a GPU, else fast: paged KV kept across turns) | hf | fast | vllm"
    )
    max_batch_size: int = Field(64, ge=1)


class EvalConfig(Section):
    """`eval`: periodic held-out evaluation (greedy by default)."""

    every: int = Field(5, ge=0, description="steps between evals (0 = only before and after)")
    num_tasks: int = Field(100, ge=1, description="held-out tasks per eval (a fixed seeded sample of the eval split, the same every eval)")
    teacher: bool = Field(True, description="also evaluate the teacher on the same tasks (before training)")
    temperature: float = Field(0.0, ge=0)


class LogConfig(Section):
    """`log`: where metrics go besides metrics.jsonl."""

    tensorboard: bool = True
    wandb: bool = False
    mlflow: bool = False


class RayConfig(Section):
    """`ray`: where the actors of `run.backend=ray` run and what each role gets (agentopd.backends.ray).
    A `cpus_per_*` left null is sized to the cluster (agentopd.backends.placement); every role is
    reserved up front, and a request the cluster cannot meet fails within `placement_timeout_s`."""

    address: str | None = Field(None, description="cluster address; null = $RAY_ADDRESS, else a local ray.init()")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a local cluster started by the run (null = all)")
    num_gpus: int | None = Field(None, ge=0, description="GPUs of a local cluster started by the run (null = all)")
    rollout_workers: int = Field(2, ge=1, description="rollout actors (engine + env instances each)")
    cpus_per_rollout_worker: float | None = Field(None, ge=0, description="null = a share of the cluster's CPUs")
    gpus_per_rollout_worker: float = Field(0.0, ge=0)
    teacher_replicas: int = Field(1, ge=1, description="scoring actors per teacher")
    cpus_per_teacher: float | None = Field(None, ge=0, description="null = a share of the cluster's CPUs")
    gpus_per_teacher: float = Field(0.0, ge=0)
    trainer_workers: int = Field(1, ge=1, description="ranks of the trainer's torch.distributed group (FSDP2)")
    cpus_per_trainer_worker: float | None = Field(None, ge=0, description="null = a share of the cluster's CPUs")
    gpus_per_trainer_worker: float = Field(0.0, ge=0)
    min_cpus_per_actor: float = Field(
        0.25, gt=0, le=1, description="the smallest share a CPU-sized role gets (null cpus_per_*); fewer CPUs fail the run"
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy of the reservation of every role"
    )
    placement_timeout_s: float = Field(20.0, gt=0, description="how long to wait for the reservation before failing")
    episodes_per_call: int | None = Field(
        None, ge=1,
        description="episodes per rollout work item (what is re-run when an actor dies); null = each worker's whole share "
        "of the step in one call: an engine batches only the episodes of one call, so small items starve a GPU engine",
    )
    max_restarts: int = Field(3, ge=0, description="replacements of dead rollout/teacher actors (and trainer group restarts) before the run fails")
    threads_per_actor: int = Field(1, ge=1, description="torch intra-op threads in each actor")
    engine_sleep: bool = Field(
        False, description="rollout engines free their KV pool while the trainer runs (a trainer sharing their GPU); "
        "the fast engine captures its step graphs again on waking",
    )
    weight_sync: Literal["auto", "object_store", "broadcast", "ipc"] = Field(
        "auto",
        description="trainer -> engines: object_store (through Ray's store), broadcast (a NCCL group of trainer rank 0 "
        "and the workers; gloo on CPU), ipc (CUDA IPC: trainer rank 0 and every worker on one GPU); auto = ipc when "
        "they share a GPU, broadcast when they have GPUs of their own, else object_store",
    )

    @model_validator(mode="after")
    def _check_gpus(self) -> RayConfig:
        if self.trainer_workers > 1 and 0 < self.gpus_per_trainer_worker <= 0.5:
            raise ValueError(
                f"ray.trainer_workers={self.trainer_workers} with ray.gpus_per_trainer_worker={self.gpus_per_trainer_worker:g}: "
                "Ray may put two ranks on one GPU, and NCCL cannot run a group with two ranks of one GPU; give each rank "
                "more than half a GPU (e.g. 0.75 leaves 0.25 of each for rollout workers or teachers) or a whole one"
            )
        if self.weight_sync == "ipc" and not (self.gpus_per_rollout_worker > 0 and self.gpus_per_trainer_worker > 0):
            raise ValueError(
                "ray.weight_sync=ipc shares GPU memory between trainer rank 0 and the rollout workers: it needs "
                f"ray.gpus_per_rollout_worker > 0 and ray.gpus_per_trainer_worker > 0 (got {self.gpus_per_rollout_worker:g} "
                f"and {self.gpus_per_trainer_worker:g})"
            )
        return self


class AsyncConfig(Section):
    """`async`: overlap rollout of the next steps with training (run.backend=ray)."""

    enabled: bool = False
    max_staleness: int = Field(1, ge=0, description="largest allowed (trainer version - episode's policy version)")
    stale: Literal["drop", "regenerate"] = Field("drop", description="what happens to an episode past the bound")


class RecipeConfig(Section):
    """`recipe`: on-policy distillation beyond plain KL on the student's episodes (agentopd.recipes). Each is
    off by default; they combine with every objective=opd loss.

    - `teacher_fraction` (GKD's lambda): that share of each step's tasks is played by the teacher and
      trained with the same loss (scored by the teacher like the student's).
    - `sft_steps`: SFT warm start: the first N steps are objective=sft (the teacher plays, cross-entropy),
      then the run's objective.
    - `intervene_below`: turn-level teacher intervention: a student turn whose mean teacher log-prob per
      token is below this is replayed by the teacher from the same prefix and the episode continues from
      the teacher's turn (masked out: the student trains on its own turns only, the replaced one included);
      the probability of intervening falls linearly from 1 to 0 over `intervene_steps` steps (null = the
      whole run). Training episodes only; run.backend=local, objective=opd, one teacher that can play.
    - `turn_support_below`: per-turn reliability weights: a student turn whose support (mean teacher
      probability of the student's tokens) is below this has its loss weight scaled by support / threshold
      (never under `turn_weight_floor`): turns where the student left the teacher's support count less.
    """

    teacher_fraction: float = Field(0.0, ge=0, le=1, description="share of each step's tasks the teacher plays (GKD lambda)")
    sft_steps: int = Field(0, ge=0, description="SFT warm start: steps trained on teacher episodes before the objective")
    intervene_below: float | None = Field(None, lt=0, description="mean teacher log-prob per token under which the teacher replays a student turn")
    intervene_steps: int | None = Field(None, ge=1, description="steps over which the intervention probability decays from 1 to 0 (null = run.steps)")
    turn_support_below: float | None = Field(None, gt=0, le=1, description="turn support under which its loss weight is scaled down")
    turn_weight_floor: float = Field(0.1, ge=0, le=1, description="the smallest weight a down-weighted turn gets")


class MixConfig(Section):
    """`mix`: mixed environments and multi-teacher routing (agentopd.plan, agentopd.routing). Written at the top
    level as `envs:`, `teachers:`, `teacher_key:` (or `--env a,b`); stored here."""

    LIFTED: ClassVar[tuple[str, ...]] = ("envs", "teachers", "teacher_key")

    envs: dict[str, EnvEntry] = Field(default_factory=dict, description="sources of a mixed run: name -> env, weight, kwargs")
    teachers: dict[str, str] = Field(
        default_factory=dict, description="teacher name -> model (folder, hub id, builtin, builtin:<env>); empty = teacher.path"
    )
    teacher_key: Literal["env", "data_source"] = Field("env", description="episode field matched against the teacher names")


class DataclassSection(Section):
    """A section mirroring a dataclass of the code; the dataclass's own checks run on validation."""

    _dataclass: ClassVar[type]

    @model_validator(mode="after")
    def _check_with_dataclass(self) -> DataclassSection:
        import dataclasses

        names = {f.name for f in dataclasses.fields(self._dataclass)}
        self._dataclass(**{k: v for k, v in self.model_dump().items() if k in names})  # raises ValueError naming the key
        return self

    def build(self) -> Any:
        """The dataclass instance this section describes."""
        import dataclasses

        names = {f.name for f in dataclasses.fields(self._dataclass)}
        return self._dataclass(**{k: v for k, v in self.model_dump().items() if k in names})


def _section_of(
    dataclass_type: type, name: str, extra: dict[str, Any] | None = None, validators: dict[str, Any] | None = None
) -> type[Section]:
    """A config section with the fields (types, defaults) of a dataclass the code already has (and pydantic
    `validators` of its own)."""
    import dataclasses

    hints = typing.get_type_hints(dataclass_type)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(dataclass_type):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        fields[f.name] = (hints[f.name], default)
    fields.update(extra or {})
    model = create_model(name, __base__=DataclassSection, __doc__=dataclass_type.__doc__, __validators__=validators, **fields)
    model._dataclass = dataclass_type
    return model


def _rollout_section() -> type[Section]:
    from agentopd.rollout import RolloutConfig as Rollout

    extra = {"tasks_per_step": (int, Field(16, ge=1)), "n": (int, Field(4, ge=1, description="episodes per task"))}
    return _section_of(Rollout, "RolloutSection", extra)


def _trainer_section() -> type[Section]:
    from agentopd.trainer.config import LossKind
    from agentopd.trainer.config import TrainerConfig as Trainer

    training = [k.value for k in LossKind if k is not LossKind.SAMPLED_K3]

    def check_loss(value: Any) -> Any:
        """trainer.loss: one of `training`, the list a bad value is answered with."""
        if value == LossKind.SAMPLED_K3:
            raise ValueError(
                "trainer.loss=sampled_k3 is not a training loss: the k3 estimator's expected gradient ascends the forward "
                "KL, not the reverse KL (agentopd.losses.policy); use trainer.loss=sampled_k1 (k3 stays in the metrics)"
            )
        if value not in training:
            raise ValueError(f"bad value for trainer.loss: {value!r} (one of {', '.join(map(repr, training))})")
        return value

    return _section_of(Trainer, "TrainerSection", validators={"check_loss": field_validator("loss", mode="before")(check_loss)})


RolloutSection = _rollout_section()
TrainerSection = _trainer_section()


class Config(Section):
    """The whole config. New sections are new fields with a default factory."""

    SHORTHANDS: ClassVar[dict[str, str]] = {  # `key=value` meaning `dotted.key=value`
        "env": "env.name",
        "student": "student.path",
        "teacher": "teacher.path",
        "engine": "engine.kind",
        "objective": "run.objective",
        "steps": "run.steps",
        "backend": "run.backend",
    }
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    env: EnvConfig
    run: RunConfig = Field(default_factory=RunConfig)
    student: StudentConfig = Field(default_factory=StudentConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    rollout: RolloutSection = Field(default_factory=RolloutSection)  # type: ignore[valid-type]
    trainer: TrainerSection = Field(default_factory=TrainerSection)  # type: ignore[valid-type]
    eval: EvalConfig = Field(default_factory=EvalConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    mix: MixConfig = Field(default_factory=lambda: MixConfig())
    ray: RayConfig = Field(default_factory=RayConfig)
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    recipe: RecipeConfig = Field(default_factory=RecipeConfig)

    @model_validator(mode="before")
    @classmethod
    def _lift_mix_keys(cls, data: Any) -> Any:
        """Top-level `envs:`, `teachers:`, `teacher_key:` (the documented spelling) live in `mix`;
        `envs:` without `env:` names the run after its sources."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        mix = dict(data.get("mix") or {}) if isinstance(data.get("mix", {}), dict) else data.get("mix")
        for key in MixConfig.LIFTED:
            if key in data:
                if isinstance(mix, dict) and key in mix:
                    raise ValueError(f"{key} is given twice: top-level and as mix.{key}")
                if isinstance(mix, dict):
                    mix[key] = data.pop(key)
        if mix:
            data["mix"] = mix
        envs = mix.get("envs") if isinstance(mix, dict) else None
        if isinstance(envs, dict) and envs and "env" not in data:
            data["env"] = {"name": ",".join(envs)}
        return data

    @model_validator(mode="after")
    def _check_sources(self) -> Config:
        from agentopd.registry import env_factory

        envs = self.mix.envs
        if self.env.mixed or envs:
            if ",".join(envs) != self.env.name:
                raise ValueError(f"env.name {self.env.name!r} must be the sources of envs joined by commas ({','.join(envs)!r})")
            for key, entry in envs.items():
                if not _KEY_RE.fullmatch(key):
                    raise ValueError(f"envs.{key}: a source name must be a plain key (letters, digits, _ and -)")
                entry.name = entry.name or key
                for k, v in resolve_kwargs(env_factory(entry.name), entry.kwargs, prefix=f"envs.{key}").items():
                    setattr(entry, k, v)
        return self

    @model_validator(mode="after")
    def _check_recipe(self) -> Config:
        """Combinations no single section can judge: each a ValueError naming the keys."""
        if self.async_.enabled and self.async_.max_staleness == 0:
            raise ValueError(
                "async.max_staleness=0 with async.enabled=true: every episode would be one step stale and dropped; "
                "set async.enabled=false for synchronous training, or async.max_staleness >= 1"
            )
        if self.ray.engine_sleep and self.async_.enabled:
            raise ValueError(
                "ray.engine_sleep with async.enabled=true: the engines play the next step while the trainer runs, so "
                "they cannot free their KV pool then; turn one off"
            )
        self._check_teacher_recipes()
        self._check_intervene()
        trainer = self.trainer_config()  # the loss, its temperature and the teachers must fit together
        servers = self.server_teachers()
        if servers:
            self._check_server_teacher(servers[0], trainer)
        return self

    def _check_teacher_recipes(self) -> None:
        """recipe.teacher_fraction and recipe.sft_steps: the teacher plays some of the training episodes."""
        r, used = self.recipe, []
        if r.teacher_fraction > 0:
            used.append(f"recipe.teacher_fraction={r.teacher_fraction}")
        if r.sft_steps > 0:
            used.append(f"recipe.sft_steps={r.sft_steps}")
            if r.sft_steps >= self.run.steps:
                raise ValueError(f"recipe.sft_steps={r.sft_steps} leaves none of run.steps={self.run.steps} to {self.run.objective} (use objective=sft for SFT alone)")
            if self.async_.enabled:
                raise ValueError("recipe.sft_steps with async.enabled=true: rollouts submitted ahead would cross the switch; turn one off")
        if used and self.run.objective != Objective.OPD:
            raise ValueError(f"{' and '.join(used)} need{'s' if len(used) == 1 else ''} objective=opd (got objective={self.run.objective})")

    def server_teachers(self) -> list[str]:
        """The teachers given as http(s) URLs: vLLM servers that score tokens and cannot play."""
        from agentopd.teacher.base import is_server

        return [ref for ref in (*self.mix.teachers.values(), self.teacher.path) if is_server(ref)]

    def _check_intervene(self) -> None:
        """recipe.intervene_below: the local backend replaces student turns with turns one teacher plays in-process."""
        r = self.recipe
        if r.intervene_below is None:
            return
        servers = self.server_teachers()
        problems = []
        if self.run.backend != "local":
            problems.append(f"run.backend={self.run.backend} (only the local backend intervenes)")
        if self.run.objective != Objective.OPD:
            problems.append(f"objective={self.run.objective} (it replaces turns the student plays: objective=opd)")
        if servers:
            problems.append(f"teacher={servers[0]}, a server that scores tokens but cannot play turns")
        if self.teacher_count() > 1:
            problems.append(f"{self.teacher_count()} teachers (it needs exactly one)")
        if problems:
            raise ValueError(f"recipe.intervene_below={r.intervene_below} cannot run with " + "; ".join(problems))

    def _check_server_teacher(self, url: str, trainer: Any) -> None:
        """A teacher behind a vLLM server returns prompt logprobs at temperature 1 and nothing else."""
        problems = []
        if trainer.loss.is_full_vocab:
            problems.append(f"trainer.loss={trainer.loss} needs the teacher's hidden states (use sampled_k1 or topk_forward_kl)")
        if Objective(self.run.objective).teacher_plays:
            problems.append("objective=sft needs the teacher to play episodes")
        if self.recipe.teacher_fraction > 0 or self.recipe.sft_steps > 0:
            problems.append("recipe.teacher_fraction and recipe.sft_steps need the teacher to play episodes")
        if self.eval.teacher:
            problems.append("eval.teacher=true plays the teacher on the eval tasks (set eval.teacher=false)")
        if self.rollout.temperature not in (0.0, 1.0):
            problems.append(f"rollout.temperature={self.rollout.temperature}: prompt logprobs are at temperature 1 only")
        if problems:
            raise ValueError(f"teacher={url} is a server that scores tokens only: " + "; ".join(problems))

    def teacher_count(self) -> int:
        """How many teachers score the run's episodes (agentopd.routing.Router routes among them)."""
        if self.mix.teachers:
            return len(self.mix.teachers)
        if self.env.mixed and self.teacher.path == "builtin":  # each env's own built-in teacher
            return len({entry.name or key for key, entry in self.mix.envs.items()})
        return 1

    def trainer_config(self) -> Any:
        """The run's agentopd.trainer.TrainerConfig: the `trainer` section with the objective's loss, the
        run's steps and the loss temperature (`loss_temperature`); the `trainer` section only accepts the
        losses a run trains with."""
        cfg = self.trainer.build()
        cfg.loss = Objective(self.run.objective).loss or cfg.loss
        cfg.total_steps = max(self.run.steps, 1)
        cfg.temperature = self.loss_temperature(cfg.loss)
        return cfg

    def loss_temperature(self, loss: Any) -> float:
        """The temperature the loss divides logits by.

        Losses on sampled tokens (sampled_k1, grpo, topk_forward_kl) compare the student with the
        sampler, so they use the rollout's temperature (trainer.temperature is not used). Full-vocabulary
        distillation (forward_kl, reverse_kl, jsd) compares the student's and the teacher's distributions
        at `trainer.temperature` (default 1: the models' own distributions), whatever temperature explores;
        at T=0.5 a tiny student's copy errors cost 10-25 nats per token and training at lr >= 1e-3
        collapsed (benchmarks/results/default_run.md). sft is cross-entropy at T=1.
        """
        from agentopd.engines.base import logprob_temperature
        from agentopd.trainer.config import LossKind

        sampler = logprob_temperature(self.rollout.temperature)  # greedy rollouts report T=1 logprobs
        if loss == LossKind.SFT:
            return 1.0
        if not loss.is_full_vocab:
            return sampler
        if self.trainer.task_reward_coef > 0 and self.trainer.temperature != sampler:
            raise ValueError(
                f"trainer.task_reward_coef={self.trainer.task_reward_coef} adds a policy-gradient term whose importance "
                f"ratio compares with the sampler: set trainer.temperature={self.trainer.temperature} equal to "
                f"rollout.temperature={sampler}"
            )
        return self.trainer.temperature

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The fully resolved config as YAML; also written to `path` when given."""
        text = yaml.safe_dump(self.model_dump(mode="json", by_alias=True), sort_keys=False, allow_unicode=True)
        if path is not None:
            Path(path).write_text(text)
        return text


# --- env kwargs against the env signature ---------------------------------------------------
def resolve_kwargs(factory: Any, kwargs: dict[str, Any], prefix: str = "env") -> dict[str, Any]:
    """Check `kwargs` against `factory`'s signature and fill in its YAML-able defaults.

    Unknown keys raise ValueError listing the accepted ones; values that do not validate
    against the parameter's annotation raise ValueError naming `<prefix>.<key>` and the value.
    """
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check against
        return dict(kwargs)
    params = {n: p for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    unknown = sorted(set(kwargs) - set(params))
    if unknown and not takes_any:
        raise ValueError(
            f"unknown key {prefix}.{unknown[0]} (value {kwargs[unknown[0]]!r}); "
            f"{_name(factory)} accepts: {', '.join(f'{prefix}.{n}' for n in params) or 'nothing'}"
        )
    try:
        hints = typing.get_type_hints(factory.__init__ if inspect.isclass(factory) else factory)
    except Exception:  # unresolvable annotations (forward refs to absent modules): check names only
        hints = {}
    out = dict(kwargs)
    for name, value in kwargs.items():
        if name in hints:
            try:
                checked = TypeAdapter(hints[name]).validate_python(value)
            except ValidationError as e:
                err = e.errors()[0]
                raise ValueError(f"bad value for {prefix}.{name}: {value!r} ({err['msg']}; expected {_type_name(hints[name])})") from None
            if isinstance(checked, _YAML_SCALARS):  # e.g. "1e-6" for a float becomes 1e-06
                out[name] = checked
    for name, p in params.items():
        if name not in out and p.default is not p.empty and _yaml_able(p.default):
            out[name] = p.default
    return out


def _yaml_able(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_yaml_able(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _yaml_able(v) for k, v in value.items())
    return isinstance(value, _YAML_SCALARS)


def _name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or repr(obj)


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


# --- dotted overrides -------------------------------------------------------------------------
def parse_value(raw: str) -> Any:
    """A command-line value as a YAML scalar (or flow list/map), YAML 1.2 style for exponent floats."""
    if _FLOAT_RE.fullmatch(raw.strip()):
        return float(raw)
    try:
        return yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ValueError(f"cannot parse value {raw!r}: {str(e).splitlines()[0]}") from None


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """`"a.b=c"` -> `(("a", "b"), value)`; a shorthand key (`env=x`) expands per `Config.SHORTHANDS`."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"override {text!r} is not of the form key=value (e.g. env.max_turns=4)")
    key = Config.SHORTHANDS.get(key, key)
    parts = tuple(key.split("."))
    if not all(_KEY_RE.fullmatch(p) for p in parts):
        raise ValueError(f"override {text!r}: {key!r} is not a dotted key (e.g. trainer.lr)")
    try:
        return parts, parse_value(raw)
    except ValueError as e:
        raise ValueError(f"override {key}: {e}") from None


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply dotted overrides to a nested dict (a copy is returned; intermediate maps are created)."""
    out = _deep_copy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(
                    f"cannot set {'.'.join(parts)}: {'.'.join(parts[: i + 1])} is a value ({child!r}), not a section"
                )
            node = child
        node[parts[-1]] = value
    return out


def _deep_copy(d: Any) -> Any:
    return {k: _deep_copy(v) for k, v in d.items()} if isinstance(d, dict) else d


# --- presets and loading ----------------------------------------------------------------------
# presets of a built-in env other than its own (configs/<name>.yaml): name -> (env, the env kwargs that select it).
# `--env sql_db env.difficulty=[explore]` starts from configs/sql_db_explore.yaml as `--env sql_db_explore` does:
# the embedded models it gets (agentopd.bootstrap) were built for that preset's tools, turns and lengths
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {"sql_db_explore": ("sql_db", {"difficulty": ["explore"]})}


def variant_of(env_name: str, env_kwargs: dict[str, Any] | None) -> str:
    """The preset of a run of `env_name` with these env kwargs: a variant's (VARIANTS) when they select it,
    else the env's own name."""
    for name, (env, selects) in VARIANTS.items():
        if env == env_name and env_kwargs is not None and all(env_kwargs.get(k) in (v, *v) for k, v in selects.items()):
            return name
    return env_name


def preset_dir() -> Path:
    """Where the shipped presets live (the `configs` package)."""
    return Path(str(files("configs")))


def presets() -> list[str]:
    """Names of the shipped presets (`configs/<name>.yaml`)."""
    return sorted(p.stem for p in preset_dir().glob("*.yaml"))


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping, got {type(data).__name__}")
    return data


def mixed_preset(env_names: str) -> dict[str, Any]:
    """`sql_db,calculator`: each env's preset `env` section becomes a source of `envs` (weight 1);
    the other sections come from the presets merged in order (a later one fills what is unset). Each env's
    episodes are scored by its own teacher; the full-vocabulary losses apply each sample's teacher's lm_head."""
    names = [n.strip() for n in env_names.split(",")]
    if any(not n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"--env {env_names!r}: give distinct env names separated by commas, e.g. sql_db,calculator")
    data: dict[str, Any] = {"envs": {}}
    for name in names:
        preset = read_yaml(preset_dir() / f"{name}.yaml") if (preset_dir() / f"{name}.yaml").is_file() else {}
        env = dict(preset.pop("env", None) or {})
        env.pop("name", None)
        data["envs"][name] = {"name": name, "weight": 1.0, **env}
        for section, values in preset.items():
            if isinstance(values, dict):
                data[section] = {**values, **data.get(section, {})}
            else:
                data.setdefault(section, values)
    data["env"] = {"name": ",".join(names)}
    return data


def validate(data: dict[str, Any]) -> Config:
    """Build a Config from a nested dict; every problem becomes one ValueError naming its dotted key."""
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ValueError("; ".join(_describe(err) for err in e.errors())) from None


def load_config(env_name: str | None, config_file: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Resolve a config: preset for `env_name` (or `config_file`), then `overrides`, then validation."""
    if config_file is not None:
        data = read_yaml(config_file)
        file_env = (data.get("env") or {}).get("name") if isinstance(data.get("env"), dict) else None
        if env_name is not None and file_env is not None and file_env != env_name:
            raise ValueError(f"config file {str(config_file)!r} is for env {file_env!r}, but the env asked for is {env_name!r}")
    elif env_name is not None and "," in env_name:
        data = mixed_preset(env_name)
    elif env_name is not None and (preset_dir() / f"{env_name}.yaml").is_file():
        data = read_yaml(preset_dir() / f"{env_name}.yaml")
        env = apply_overrides(data, overrides).get("env")
        if (variant := variant_of(env_name, env if isinstance(env, dict) else None)) != env_name:
            data = read_yaml(preset_dir() / f"{variant}.yaml")  # the overrides select a variant: its preset
    elif env_name is not None:  # an env without a preset of its own (a plugin's): the embedded-default recipe
        data = read_yaml(preset_dir() / "defaults" / "embedded.yaml")
    else:
        raise ValueError("no env given: pass an env name or a config file with env.name")
    if env_name is not None and not (isinstance(data.get("envs"), dict) and data["envs"] and "env" not in data):
        data.setdefault("env", {})
        if isinstance(data["env"], dict):
            data["env"].setdefault("name", env_name)
    return validate(apply_overrides(data, overrides))


def _describe(err: dict[str, Any]) -> str:
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "value_error":  # our own validators already name the key and value
        return str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        allowed = _fields_at(err["loc"][:-1])
        return f"unknown key {key} (value {err['input']!r}); {'.'.join(map(str, err['loc'][:-1])) or 'the config'} accepts: {allowed}"
    if err["type"] == "missing":
        return f"missing key {key}"
    return f"bad value for {key}: {err['input']!r} ({err['msg']})"


def _fields_at(loc: tuple[Any, ...]) -> str:
    model: Any = Config
    for part in loc:
        field = model.model_fields.get(str(part)) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return "?"
        model = field.annotation
    prefix = "".join(f"{p}." for p in loc)
    return ", ".join(prefix + n for n in model.model_fields)
