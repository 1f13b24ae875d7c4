"""The run policy: what a run's settings imply together, beside the objective they serve (agentopd.objectives).

    trainer_cfg = trainer_config(cfg)        # TrainerConfig: the objective's loss, the run's steps, the temperature
    rollout_cfg = rollout_config(cfg)        # RolloutConfig: how the training episodes play
    loss_temperature(cfg, LossKind.SFT)      # the temperature a loss divides logits by
    check_run(cfg)                           # combinations no single section can judge: ValueError naming the keys

Validation of the config tree calls `check_run` (so `load_config` refuses a run that cannot work before any model
loads); the runner calls `trainer_config` and `loss_temperature` and hands the parts below it typed settings.
Nothing below the runner imports this module (tests/test_layout.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentopd.kinds import BackendKind, EmbeddedSize
from agentopd.objectives import Objective
from agentopd.rollout import RolloutConfig
from agentopd.teacher.base import is_server
from agentopd.trainer.config import LossKind, TrainerConfig

if TYPE_CHECKING:
    from agentopd.config import Config


def trainer_config(cfg: Config) -> TrainerConfig:
    """The run's TrainerConfig: the `trainer` section with the objective's loss, the run's steps and the loss
    temperature (`loss_temperature`); the `trainer` section only accepts the losses a run trains with."""
    trainer: TrainerConfig = cfg.trainer.build()
    trainer.loss = Objective(cfg.run.objective).loss or trainer.loss
    trainer.total_steps = max(cfg.run.steps, 1)
    trainer.temperature = loss_temperature(cfg, trainer.loss)
    return trainer


def rollout_config(cfg: Config) -> RolloutConfig:
    """The run's RolloutConfig: the `rollout` section (its tasks_per_step and n are the plan's, not the loop's)."""
    rollout: RolloutConfig = cfg.rollout.build()
    return rollout


def loss_temperature(cfg: Config, loss: LossKind) -> float:
    """The temperature `loss` divides logits by.

    Losses on sampled tokens (sampled_k1, grpo, topk_forward_kl) compare the student with the sampler, so they use
    the rollout's temperature (trainer.temperature is not used). Full-vocabulary distillation (forward_kl,
    reverse_kl, jsd) compares the student's and the teacher's distributions at `trainer.temperature` (default 1:
    the models' own distributions), whatever temperature explores; at T=0.5 a tiny student's copy errors cost
    10-25 nats per token and training at lr >= 1e-3 collapsed (benchmarks/results/default_run.md). sft is
    cross-entropy at T=1.
    """
    from agentopd.engines.base import logprob_temperature

    sampler = logprob_temperature(cfg.rollout.temperature)  # greedy rollouts report T=1 logprobs
    if loss == LossKind.SFT:
        return 1.0
    if not LossKind(loss).is_full_vocab:
        return sampler
    if cfg.trainer.task_reward_coef > 0 and cfg.trainer.temperature != sampler:
        raise ValueError(
            f"trainer.task_reward_coef={cfg.trainer.task_reward_coef} adds a policy-gradient term whose importance "
            f"ratio compares with the sampler: set trainer.temperature={cfg.trainer.temperature} equal to "
            f"rollout.temperature={sampler}"
        )
    return cfg.trainer.temperature


def server_teachers(cfg: Config) -> list[str]:
    """The teachers given as http(s) URLs: vLLM servers that score tokens and cannot play."""
    return [ref for ref in (*cfg.mix.teachers.values(), cfg.teacher.path) if is_server(ref)]


def teacher_count(cfg: Config) -> int:
    """How many teachers score the run's episodes (agentopd.routing.Router routes among them)."""
    if cfg.mix.teachers:
        return len(cfg.mix.teachers)
    if cfg.env.mixed and cfg.teacher.path == "builtin":  # each env's own built-in teacher
        return len({entry.name or key for key, entry in cfg.mix.envs.items()})
    return 1


def check_run(cfg: Config) -> None:
    """Combinations no single section can judge: each a ValueError naming the keys."""
    if cfg.async_.enabled and cfg.async_.max_staleness == 0:
        raise ValueError(
            "async.max_staleness=0 with async.enabled=true: every episode would be one step stale and dropped; "
            "set async.enabled=false for synchronous training, or async.max_staleness >= 1"
        )
    if cfg.ray.engine_sleep and cfg.async_.enabled:
        raise ValueError(
            "ray.engine_sleep with async.enabled=true: the engines play the next step while the trainer runs, so "
            "they cannot free their KV pool then; turn one off"
        )
    # each backend has its own key for the engines' sleep; the other one's would be silently ignored
    if cfg.engine.sleep is True and cfg.run.backend == BackendKind.RAY:
        raise ValueError(
            "engine.sleep=true on run.backend=ray: that key is the local backend's; Ray's rollout engines free their KV "
            "pool while the trainer runs with ray.engine_sleep=true (for a trainer sharing their GPU)"
        )
    if cfg.ray.engine_sleep and cfg.run.backend == BackendKind.LOCAL:
        raise ValueError(
            "ray.engine_sleep=true on run.backend=local: that key is the Ray backend's; the local engine frees its KV pool "
            "while the teacher scores and the trainer steps with engine.sleep=true (or auto: when the memory plan needs it)"
        )
    if cfg.trainer.cpu_offload and cfg.run.backend == BackendKind.LOCAL:
        raise ValueError(
            "trainer.cpu_offload=true on run.backend=local: the offload is FSDP2's, which needs the trainer in a process "
            "group; run.backend=ray starts its trainer ranks in one (ray.trainer_workers=1 will do)"
        )
    if cfg.async_.enabled and cfg.run.backend == BackendKind.LOCAL:
        raise ValueError("async.enabled=true needs run.backend=ray (the local backend runs one stage at a time)")
    _check_overlap(cfg)
    _check_fp8_teacher(cfg)
    _check_installed(cfg)
    _check_teacher_recipes(cfg)
    _check_groups(cfg)
    _check_intervene(cfg)
    _check_embedded(cfg)
    if cfg.recipe.horizon_turns is not None and cfg.recipe.horizon_turns[1] > cfg.rollout.max_turns:
        raise ValueError(f"recipe.horizon_turns={list(cfg.recipe.horizon_turns)} ends past rollout.max_turns={cfg.rollout.max_turns}: "
                         "the episodes stop there anyway; end it at rollout.max_turns or below")  # fmt: skip
    trainer = trainer_config(cfg)  # the loss, its temperature and the teachers must fit together
    if cfg.teacher.privileged is not None:
        _check_privileged(cfg, trainer)
    if trainer.loss.is_cross_tokenizer:
        _check_cross_tokenizer(cfg, trainer)
    _check_temperature(cfg, trainer)
    servers = server_teachers(cfg)
    if servers:
        _check_server_teacher(cfg, servers[0], trainer)


def _check_fp8_teacher(cfg: Config) -> None:
    """teacher.linear_dtype=fp8 quantizes a teacher loaded here, for a GPU's fp8 tensor cores (the device itself is
    judged when the teacher is built: backends.stages.check_fp8_device)."""
    if cfg.teacher.linear_dtype != "fp8":
        return
    if cfg.run.device == "cpu":
        raise ValueError("teacher.linear_dtype=fp8 with run.device=cpu: fp8 projections are for a GPU's fp8 tensor cores "
                         "(H100/H200); on a CPU they are slower than the run's dtype: set teacher.linear_dtype=auto")  # fmt: skip
    servers = server_teachers(cfg)
    if servers:
        raise ValueError(f"teacher.linear_dtype=fp8 with a teacher served at {servers[0]}: the precision of a served "
                         "teacher is its server's (vLLM's --quantization fp8); set teacher.linear_dtype=auto")  # fmt: skip


def _check_overlap(cfg: Config) -> None:
    """teacher.overlap scores the streams as played, on the local backend, with the teacher resident."""
    if not cfg.teacher.overlap:
        return
    if cfg.run.backend != BackendKind.LOCAL:
        raise ValueError("teacher.overlap=true is the local backend's; on run.backend=ray the teachers score each work item "
                         "as it is played with async.enabled=true (async.score_ahead)")  # fmt: skip
    if cfg.teacher.offload is True:
        raise ValueError("teacher.overlap=true with teacher.offload=true: the teacher scores during the rollout, so it "
                         "stays on the GPU; set teacher.offload=false (or auto) or teacher.overlap=false")  # fmt: skip
    changes = [key for on, key in ((cfg.recipe.intervene_below is not None, "recipe.intervene_below"),
                                   (cfg.teacher.privileged is not None, "teacher.privileged"),
                                   (LossKind(cfg.trainer.loss).is_cross_tokenizer, f"trainer.loss={cfg.trainer.loss}")) if on]  # fmt: skip
    if changes:
        raise ValueError(f"teacher.overlap=true with {changes[0]}: the teacher then reads other streams than the ones "
                         "played, which exist only after the rollout; turn one off")  # fmt: skip


def _check_embedded(cfg: Config) -> None:
    """embedded.size=gpu runs on a GPU: its ~150M-parameter teacher takes hours to build on a laptop's CPU, which is
    not what a user asking for it wants; embedded.allow_cpu=true says it is."""
    if cfg.embedded.size != EmbeddedSize.GPU or cfg.embedded.allow_cpu:
        return
    import torch

    if cfg.run.device == "cpu" or (cfg.run.device == "auto" and not torch.cuda.is_available()):
        raise ValueError(
            f"embedded.size=gpu on the CPU (run.device={cfg.run.device}): the gpu pair (a ~150M-parameter teacher, a ~25M "
            "student) is built and trained on one GPU; run on a GPU (run.device=cuda), use embedded.size=tiny (the CPU "
            "default), or set embedded.allow_cpu=true to build and run it on the CPU anyway (hours, not minutes)"
        )


def _check_cross_tokenizer(cfg: Config, trainer: TrainerConfig) -> None:
    """A cross-tokenizer loss: the teacher reads the student's episodes re-rendered in its own tokenizer (a server teacher's:
    teacher.tokenizer); it never plays in the student's engines (eval.teacher is skipped), and what reads its per-token
    logprobs directly is not wired."""
    problems = []
    if cfg.recipe.teacher_fraction > 0 or cfg.recipe.intervene_below is not None:  # (sft_steps: agentopd.crosstok.retokenize)
        problems.append("recipe.teacher_fraction / intervene_below (the teacher's turns would join the student's episodes "
                        "in the student's tokenizer)")
    if cfg.recipe.turn_support_below is not None:
        problems.append("recipe.turn_support_below (reads per-token teacher logprobs; spans are not wired there yet)")
    if server_teachers(cfg) and cfg.teacher.tokenizer is None:
        problems.append(f"teacher={server_teachers(cfg)[0]} without teacher.tokenizer (a server's tokenizer: the folder or hub "
                        "id of the model it serves, to re-render the episodes in)")
    if problems:
        raise ValueError(f"trainer.loss={trainer.loss} cannot run with " + "; ".join(problems))


def _check_privileged(cfg: Config, trainer: TrainerConfig) -> None:
    """teacher.privileged: the teacher scores the student's tokens after a privileged prompt (agentopd.privileged); it
    must not play (its own turns would need the context too) and must read the student's tokens."""
    r, problems = cfg.recipe, []
    if cfg.run.objective != Objective.OPD:
        problems.append(f"objective={cfg.run.objective} (needs objective=opd: the teacher scores, never plays)")
    if r.teacher_fraction > 0 or r.sft_steps > 0 or r.intervene_below is not None:
        problems.append("recipe.teacher_fraction / sft_steps / intervene_below (the teacher would play without its context)")
    if trainer.loss.is_cross_tokenizer:
        problems.append(f"trainer.loss={trainer.loss} (another tokenizer reads its own rendering, not the student's tokens)")
    if problems:
        raise ValueError(f"teacher.privileged={cfg.teacher.privileged} cannot run with " + "; ".join(problems))


def _check_teacher_recipes(cfg: Config) -> None:
    """recipe.teacher_fraction and recipe.sft_steps: the teacher plays some of the training episodes."""
    r, used = cfg.recipe, []
    if r.teacher_fraction > 0:
        used.append(f"recipe.teacher_fraction={r.teacher_fraction}")
    if r.sft_steps > 0:
        used.append(f"recipe.sft_steps={r.sft_steps}")
        if r.sft_steps >= cfg.run.steps:
            raise ValueError(f"recipe.sft_steps={r.sft_steps} leaves none of run.steps={cfg.run.steps} to {cfg.run.objective} (use objective=sft for SFT alone)")
        if cfg.async_.enabled:
            raise ValueError("recipe.sft_steps with async.enabled=true: rollouts submitted ahead would cross the switch; turn one off")
    if used and cfg.run.objective != Objective.OPD:
        raise ValueError(f"{' and '.join(used)} need{'s' if len(used) == 1 else ''} objective=opd (got objective={cfg.run.objective})")


def _check_installed(cfg: Config) -> None:
    """Optional packages a setting needs, looked for before any model loads or any run folder is made (the run would
    otherwise fail minutes in, after building its models)."""
    from importlib.util import find_spec

    if cfg.engine.kind == "vllm" and find_spec("vllm") is None:
        from agentopd.engines.vllm import INSTALL_HINT

        raise ValueError(f"engine.kind=vllm: {INSTALL_HINT}")
    for key, package in (("wandb", "wandb"), ("mlflow", "mlflow")):
        if getattr(cfg.log, key) and find_spec(package) is None:
            raise ValueError(f"log.{key}=true but {package} is not installed: pip install {package}")


def _check_groups(cfg: Config) -> None:
    """objective=grpo learns from a task's episodes against each other (agentopd.losses.grpo_advantages): with one
    episode a task every advantage is 0, the gradient is 0 at every step, and the run would train nothing."""
    n, tasks = cfg.rollout.n, cfg.rollout.tasks_per_step
    if cfg.run.objective == Objective.GRPO and n < 2:
        raise ValueError(
            f"objective=grpo with rollout.n={n}: GRPO's advantage compares the episodes of one task, so with one episode a "
            f"task every advantage is 0 and nothing is learned; set rollout.n=4 (rollout.n=4 "
            f"rollout.tasks_per_step={max(1, tasks // 4)} keeps {tasks * n} episodes a step). Groups are needed, not enough: "
            f"on the embedded sql_db pair GRPO at the presets' learning rate still collapsed (8% -> 0%; docs/guides/recipes.md)"
        )


def _check_intervene(cfg: Config) -> None:
    """recipe.intervene_below: the local backend replaces student turns with turns one teacher plays in-process."""
    r = cfg.recipe
    if r.intervene_below is None:
        return
    servers = server_teachers(cfg)
    problems = []
    if cfg.run.backend != BackendKind.LOCAL:
        problems.append(f"run.backend={cfg.run.backend} (only the local backend intervenes)")
    if cfg.run.objective != Objective.OPD:
        problems.append(f"objective={cfg.run.objective} (it replaces turns the student plays: objective=opd)")
    if servers:
        problems.append(f"teacher={servers[0]}, a server that scores tokens but cannot play turns")
    if teacher_count(cfg) > 1:
        problems.append(f"{teacher_count(cfg)} teachers (it needs exactly one)")
    if problems:
        raise ValueError(f"recipe.intervene_below={r.intervene_below} cannot run with " + "; ".join(problems))


def _check_server_teacher(cfg: Config, url: str, trainer: TrainerConfig) -> None:
    """A teacher behind a vLLM server returns prompt logprobs at temperature 1 and nothing else."""
    problems = []
    if trainer.loss.is_full_vocab:
        problems.append(f"trainer.loss={trainer.loss} needs the teacher's hidden states (use sampled_k1 or topk_forward_kl)")
    if Objective(cfg.run.objective).teacher_plays:
        problems.append("objective=sft needs the teacher to play episodes")
    if cfg.recipe.teacher_fraction > 0 or cfg.recipe.sft_steps > 0:
        problems.append("recipe.teacher_fraction and recipe.sft_steps need the teacher to play episodes")
    if cfg.eval.teacher:
        problems.append("eval.teacher=true plays the teacher on the eval tasks (set eval.teacher=false)")
    if cfg.rollout.temperature not in (0.0, 1.0):
        problems.append(f"rollout.temperature={cfg.rollout.temperature}: prompt logprobs are at temperature 1 only")
    if problems:
        raise ValueError(f"teacher={url} is a server that scores tokens only: " + "; ".join(problems))


def score_temperature(cfg: Config) -> float:
    """The temperature the teachers score sampled tokens at: the sampler's (rollout.temperature; 1 for greedy), for
    every loss. Sampled-token losses compare the teacher's log-probability with the sampler's on the same token, so
    both must be at one temperature; full-vocabulary losses take the teacher's hidden states (no temperature) and
    apply trainer.temperature themselves, while its sampled-token log-probabilities feed kl/* beside the sampler's."""
    from agentopd.engines.base import logprob_temperature

    return logprob_temperature(cfg.rollout.temperature)


def _check_temperature(cfg: Config, trainer: TrainerConfig) -> None:
    """teacher.temperature, where given, must be the rule's (`score_temperature`) for the run's loss (verl#5592: a
    teacher scored at another temperature than the loss assumes trains the student toward the wrong distribution)."""
    rule = score_temperature(cfg)
    given = cfg.teacher.temperature
    if given is None or given == rule:
        return
    if trainer.loss.is_full_vocab:
        why = (f"trainer.loss={trainer.loss.value} compares full distributions at trainer.temperature={trainer.temperature} "
               f"from the teacher's hidden states, and the teacher's sampled-token log-probabilities (kl/*) sit beside the "
               f"sampler's at {rule}")  # fmt: skip
    else:
        why = (f"trainer.loss={trainer.loss.value} compares the teacher's log-probability of each sampled token with the "
               f"sampler's, at rollout.temperature's {rule}")  # fmt: skip
    raise ValueError(f"teacher.temperature={given} disagrees with the loss: {why}; leave teacher.temperature unset "
                     f"(or set it to {rule}), or change rollout.temperature")  # fmt: skip
