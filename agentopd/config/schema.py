"""The config tree: typed pydantic sections, one per concern, and `Config`, the whole.

    cfg = agentopd.config.load_config("sql_db", overrides=["env.max_turns=4"])   # presets + overrides: load.py
    cfg.env.name, cfg.env.kwargs        # "sql_db", {"max_turns": 4, ...}
    cfg.to_yaml("runs/x/config.yaml")   # the fully resolved config

Unknown keys and bad values raise ValueError naming the full dotted key and the bad value. The `env`
section is `{name, **kwargs}`: kwargs are free-form per env and are checked against the env's `__init__`
(or factory) signature (envargs.py); kwargs left out are filled with the signature's defaults so the
written config is complete. Rules that judge several sections together are the run policy
(agentopd.policy), which validation calls.

Adding a section (e.g. `trainer`): write `class TrainerConfig(Section)` with typed, defaulted fields and add
`trainer: TrainerConfig = Field(default_factory=TrainerConfig)` to `Config`. Presets and overrides pick it up
with no other change. A shorthand top-level override (`student=PATH` for `student.path=PATH`) is one entry in
`SHORTHANDS`.
"""

from __future__ import annotations

import re
import typing
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from agentopd.config.envargs import resolve_kwargs
from agentopd.env import Privileged
from agentopd.kinds import BackendKind, EmbeddedSize  # below both config and backends (tests/test_layout.py)
from agentopd.objectives import Objective

KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")  # a config key, a source name


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
        if self.mixed:
            if self.kwargs:
                key = sorted(self.kwargs)[0]
                raise ValueError(f"env.{key}: a mixed run ({self.name}) takes env kwargs per source, e.g. envs.<source>.{key}")
            return self
        factory = env_factory(self.name)
        for key, value in resolve_kwargs(factory, self.kwargs, prefix="env").items():
            setattr(self, key, value)
        return self


def env_factory(name: str) -> Any:
    """The registry's env `name`; an unknown name's error also lists the presets of installed envs (VARIANTS), which
    `--env` takes too."""
    from agentopd.config.load import VARIANTS  # late: load imports this module
    from agentopd.registry import env_factory as registered  # late: the registry loads env modules

    try:
        return registered(name)
    except ValueError as e:
        if not str(e).startswith("unknown env"):
            raise
        presets = ", ".join(f"{v} (a preset of {env})" for v, (env, _) in sorted(VARIANTS.items()))
        raise ValueError(f"{e}; presets: {presets}") from None


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
    host_memory_gib: float | None = Field(
        None, gt=0, description="a CPU run: the memory its plan may fill, GiB (agentopd.memory_host); null = what "
        "/proc/meminfo calls available at start",
    )
    checkpoint_every: int = Field(10, ge=0, description="steps between resumable checkpoints (0 = only at the end)")
    keep_checkpoints: int = Field(
        0, ge=0, description="finished checkpoints kept: once a new one is complete the older ones beyond this many are "
        "removed; 0 = keep all (agentopd.disk_plan counts what the run keeps against the free disk)",
    )
    disk_gib: float | None = Field(
        None, gt=0, description="the disk the run's checkpoints and final/ may fill, GiB (agentopd.disk_plan); null = the "
        "free space of the run directory's file system at start",
    )
    backend: BackendKind = Field(BackendKind.LOCAL, description="local (one process) | ray (actors: agentopd.backends.ray)")


class StudentConfig(Section):
    """`student`: the model being trained (`builtin` = the env's embedded student)."""

    path: str = "builtin"


class TeacherConfig(Section):
    """`teacher`: the model that scores the student's tokens (`builtin` = the env's embedded teacher; `self` = a
    frozen copy of the student's starting weights; an http(s) URL = a vLLM server's prompt logprobs,
    agentopd.teacher.ServerTeacher). `privileged` (solution | schema): the teacher reads each episode with that
    context from the env in its prompt, which the student lacks (privileged self-distillation, agentopd.privileged)."""

    path: str = "builtin"
    top_k: int = Field(20, ge=1, description="teacher top-k for trainer.loss=topk_forward_kl (a server: <= its --max-logprobs)")
    tokenizer: str | None = Field(
        None, description="a server teacher's tokenizer (a folder or hub id) for a cross-tokenizer loss (trainer.loss=xtok_*): "
        "the run re-renders and aligns each episode in it and the server scores those ids; a local teacher's is its own",
    )
    privileged: Privileged | None = Field(
        None, description="context the teacher reads and the student does not: solution (the oracle's) or schema (the hidden one)"
    )
    chat_template: str | None = Field(
        None, description="the teacher's chat template for the pair check: null = its own; student = the student's (a pair "
        "whose templates differ only in how they are written, e.g. an escaped brace); or a .jinja file",
    )
    temperature: float | None = Field(
        None, gt=0, description="the temperature the teacher scores the sampled tokens at; null = the rule of the loss "
        "(the sampler's: rollout.temperature, 1 for greedy); any other value is refused at load (agentopd.policy)",
    )
    selftest: bool = Field(
        True, description="score a probe (the env's oracle episodes and the student's first rollouts) twice on every replica "
        "before step 1 and again after a sleep, offload, reload or restart; refuse a noisy, uniform or broken teacher "
        "(agentopd.step.selftest)",
    )
    selftest_max_noise: float = Field(
        0.1, ge=0, description="the self-test refuses a teacher whose repeat or replica noise (mean |difference| a "
        "token) exceeds this share of the OPD signal (mean |teacher - student| on the same tokens)",
    )
    selftest_every: int | None = Field(
        None, ge=0, description="score the self-test's probe again every N steps even when nothing happened to the teacher "
        "(a server restarted between two scorings with other weights behind the same address is seen no other way); "
        "0 = only after a sleep, offload, reload, restart or reconnect; null = 10 for a teacher served over HTTP, 0 for "
        "one loaded by the run",
    )
    selftest_oracle: bool = Field(
        True, description="the self-test refuses a teacher no better than the student on the env's oracle episodes "
        "(off by itself for teacher=self and teacher.privileged, where the teacher is the student)",
    )
    offload: Literal["auto"] | bool = Field(
        "auto", description="a local teacher on a GPU: move it to pinned host memory after each scoring and back before the "
        "next (a host-to-GPU copy of its weights every step); false = keep it resident; auto = resident when the memory "
        "plan fits with it there in every phase (one local teacher, no engine.kv_cache_fraction), else offloaded",
    )
    reconnect_s: float = Field(
        120.0, gt=0, description="a server teacher: how long a scoring request keeps trying a server it cannot reach "
        "(a vLLM server's restart takes ~40 s and more) before the run stops with that error; a reconnect re-runs the "
        "teacher self-test's probe",
    )
    compile: bool = Field(
        False, description="a local teacher on a GPU: torch.compile each decoder layer's forward (its norms, activations "
        "and casts fused: issue 52's profile found ~10 s of eager elementwise work in the real-size teacher phase); "
        "compiles on its first scoring; ignored on a CPU",
    )
    linear_dtype: Literal["auto", "fp8"] = Field(
        "auto", description="a local teacher on a GPU: auto = its projections in the run's dtype; fp8 = the decoder "
        "layers' projections in float8 e4m3 with per-row scales, inputs quantized per token (agentopd.teacher.fp8): half "
        "their bytes and the fp8 tensor cores (compute capability >= 8.9: H100/H200); the teacher then scores as a "
        "slightly different model (benchmarks/teacher_fp8.py measures how far on a real checkpoint)",
    )
    overlap: bool = Field(
        False, description="the local backend: score each training episode as soon as it is played, on a thread (and a "
        "CUDA stream) of its own, while the rollout's stragglers still decode, instead of after the rollout (the teacher "
        "stays resident: teacher.offload must not be true; a recipe that changes what the teacher reads is refused); "
        "metrics teacher/overlap_s, teacher/overlap_share",
    )
    overlap_min_tokens: int = Field(
        4096, ge=1, description="teacher.overlap: the teacher scores what waits once it holds this many tokens (or the "
        "rollout has ended), all of it in one call",
    )


class VLLMOptions(Section):
    """`engine.vllm`: vLLM's own settings for engine.kind=vllm (agentopd.engines.vllm). Where the user's
    environment sets the vLLM variable of a key (VLLM_CPU_KVCACHE_SPACE, VLLM_ENABLE_V1_MULTIPROCESSING,
    TORCHDYNAMO_DISABLE), the variable wins."""

    kv_cache_gib: float | None = Field(
        None, gt=0, description="CPU: the KV cache's size; null = sized from the run (engine.max_batch_size contexts of "
        "the model's length, at most 2,048 tokens each, and at least one whole context); VLLM_CPU_KVCACHE_SPACE wins",
    )
    compile: bool | None = Field(
        None, description="torch.compile the model when the engine starts; null = off on CPU (the engine starts in "
        "seconds; compiling took ~25 s), vLLM's default (compiled, CUDA graphs) on GPU",
    )
    worker_process: bool = Field(
        False, description="CPU: run the model in a process of its own (vLLM's mp executor) instead of in the "
        "engine-core process; VLLM_ENABLE_V1_MULTIPROCESSING wins",
    )
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="GPU: the share of the GPU's memory vLLM takes; null = 0.5 with run.backend=local "
        "(the trainer and teacher share the GPU), else 0.9 x ray.gpus_per_rollout_worker (at most 0.9)",
    )


class EngineConfig(Section):
    """`engine`: what generates the student's episodes."""

    kind: Literal["auto", "hf", "fast", "vllm"] = Field(
        "auto", description="auto (vllm where installed on a GPU, else fast: paged KV kept across turns) | hf | fast | vllm"
    )
    max_batch_size: int = Field(64, ge=1)
    kv_cache_gib: float | None = Field(
        None, gt=0, description="GPU, fast engine: the KV pool's size in GiB; null = engine.kv_cache_fraction, else 16 "
        "(agentopd.memory_plan; `agentopd plan-memory` prints what the run holds)",
    )
    kv_cache_fraction: float | None = Field(
        None, gt=0, le=1, description="GPU, fast engine: the KV pool as this share of the memory the plan leaves free "
        "on the engine's GPU at its peak (agentopd.memory_plan); exclusive with engine.kv_cache_gib",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto", description="the KV cache's element type: auto = the model's; fp8 = float8 e4m3 (fast and vllm engines): "
        "half the bytes a token, so the same GiB hold twice the tokens; room, not speed: the fast engine's decode step "
        "measured 6-12% slower than bf16's on an H200, and the sampled tokens come from attention over K/V rounded to 3 "
        "mantissa bits (benchmarks/results/kv_fp8.md; the trainer's forward is unchanged)",
    )
    sleep: Literal["auto"] | bool = Field(
        "auto", description="run.backend=local, fast/hf engine: free the KV pool while the teacher scores and the trainer "
        "steps (woken for the next rollout); auto = on when the memory plan does not fit without it (on CPU: off)",
    )
    vllm: VLLMOptions = Field(default_factory=VLLMOptions, description="engine.kind=vllm: vLLM's own settings")


    @model_validator(mode="after")
    def _one_pool_size(self) -> EngineConfig:
        if self.kv_cache_gib is not None and self.kv_cache_fraction is not None:
            raise ValueError("engine.kv_cache_gib and engine.kv_cache_fraction both set: give one")
        if self.kv_cache_dtype != "auto" and self.kind == "hf":
            raise ValueError(f"engine.kv_cache_dtype={self.kv_cache_dtype} needs engine.kind fast or vllm: the transformers "
                             "engine keeps its K/V in the model's dtype")
        return self


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


class EmbeddedConfig(Section):
    """`embedded`: the built-in models (`student: builtin`, `teacher: builtin`). Each size is built by the same recipe
    (SFT on the env's oracle demonstrations) and cached apart: `tiny` under `$AGENTOPD_HOME/models/<env>/`, another
    under `models/<size>/<env>/`."""

    size: EmbeddedSize = Field(EmbeddedSize.TINY, description="tiny (CPU, the default) | gpu (a ~25M student, a ~150M teacher: one GPU)")
    allow_cpu: bool = Field(False, description="let embedded.size=gpu build and run on the CPU (hours, not minutes)")


class Stale(StrEnum):
    """`async.stale`: what happens to an episode older than async.max_staleness policy versions."""

    DROP = "drop"  # kept in the store, marked, not trained on
    REGENERATE = "regenerate"  # played again with the current weights


class AsyncConfig(Section):
    """`async`: overlap rollout of the next steps with training (run.backend=ray)."""

    enabled: bool = False
    max_staleness: int = Field(1, ge=0, description="largest allowed (trainer version - episode's policy version)")
    stale: Stale = Field(Stale.DROP, description="what happens to an episode past the bound: drop | regenerate")
    score_ahead: bool = Field(True, description="each work item scored by its teacher as soon as it is played, beside the "
                              "trainer's step (Ray; not with teacher.privileged, a cross-tokenizer loss or recipe.intervene_below)")


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
    - `horizon_turns: [start, end]`: truncated-horizon OPD: training episodes are played to at most k assistant
      turns, k stepping from `start` to `end` in equal shares of the run (agentopd.recipes.horizon).
    - `auto_warm_start` (default false: not yet shown to help, benchmarks/results/default_recipe.md): on the embedded default, sets `sft_steps` to a third of the run when the step-0
      evals find the student cold (far below the teacher, without the format), and prints what it chose and why
      (agentopd.warm_start); false: never.
    """

    teacher_fraction: float = Field(0.0, ge=0, le=1, description="share of each step's tasks the teacher plays (GKD lambda)")
    sft_steps: int = Field(0, ge=0, description="SFT warm start: steps trained on teacher episodes before the objective")
    intervene_below: float | None = Field(None, lt=0, description="mean teacher log-prob per token under which the teacher replays a student turn")
    intervene_steps: int | None = Field(None, ge=1, description="steps over which the intervention probability decays from 1 to 0 (null = run.steps)")
    turn_support_below: float | None = Field(None, gt=0, le=1, description="turn support under which its loss weight is scaled down")
    turn_weight_floor: float = Field(0.1, ge=0, le=1, description="the smallest weight a down-weighted turn gets")
    horizon_turns: tuple[int, int] | None = Field(
        None, description="[start, end]: training episodes play at most k turns, k growing from start to end over the run"
    )
    auto_warm_start: bool = Field(
        False, description="the embedded default's student, cold at step 0 (under 5% of the teacher's held-out success and "
        "parse errors in 10% of its turns or more), gets sft_steps = a third of the run (agentopd.warm_start); false: never"
    )

    @field_validator("horizon_turns")
    @classmethod
    def _horizon(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and not 1 <= value[0] <= value[1]:
            raise ValueError(f"recipe.horizon_turns must be [start, end] with 1 <= start <= end, got {list(value)}")
        return value


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
    embedded: EmbeddedConfig = Field(default_factory=EmbeddedConfig)

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
        envs = self.mix.envs
        if self.env.mixed or envs:
            if ",".join(envs) != self.env.name:
                raise ValueError(f"env.name {self.env.name!r} must be the sources of envs joined by commas ({','.join(envs)!r})")
            for key, entry in envs.items():
                if not KEY_RE.fullmatch(key):
                    raise ValueError(f"envs.{key}: a source name must be a plain key (letters, digits, _ and -)")
                entry.name = entry.name or key
                for k, v in resolve_kwargs(env_factory(entry.name), entry.kwargs, prefix=f"envs.{key}").items():
                    setattr(entry, k, v)
        return self

    @model_validator(mode="after")
    def _check_run(self) -> Config:
        """Combinations no single section can judge (agentopd.policy.check_run)."""
        from agentopd.policy import (
            check_run,  # late: the policy reads this module's types
        )

        check_run(self)
        return self

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The fully resolved config as YAML; also written to `path` when given."""
        text = yaml.safe_dump(self.model_dump(mode="json", by_alias=True), sort_keys=False, allow_unicode=True)
        if path is not None:
            Path(path).write_text(text)
        return text


