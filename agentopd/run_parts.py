"""The run's parts that set-up builds from the config and the resolved models (agentopd.runner's `_setup`).

    own = own_tokenizer_teachers(cfg, models, loss)              # teachers of another vocabulary that play SFT episodes
    check_pairs(cfg, models, cross=False)                       # the cheap parts of `agentopd check-pair`
    scorer = cross_scorer(cfg, models, tokenizer, loss)         # a cross-tokenizer loss: scoring through the alignment
    view = privileged_view(cfg, mixture, tokenizer)             # teacher.privileged: checked on every source
    trainer_cfg, line, host_plan = fit_memory(cfg, models, device, memory_plan, trainer_cfg)  # what the plans fitted
    ctx = run_context(cfg, mixture, models, trainer_cfg, rollout_cfg, device, dtype, tokenizer, memory_plan)

Each refuses a run it cannot serve with a ValueError, before any model loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentopd.backends.stages import RunContext
from agentopd.pair import RUN_CHECKS, require_pair
from agentopd.teacher.base import is_server

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from agentopd.config import Config
    from agentopd.crosstok.score import CrossScorer
    from agentopd.memory_host import HostPlan
    from agentopd.memory_plan import MemoryPlan
    from agentopd.plan import Mixture
    from agentopd.privileged import PrivilegedView
    from agentopd.rollout import RolloutConfig
    from agentopd.run_models import RunModels
    from agentopd.trainer.config import LossKind, TrainerConfig


def check_pairs(cfg: Config, models: RunModels, *, cross: bool) -> None:
    """Each local teacher against the student: vocabulary and chat template (a cross-tokenizer loss: context only).
    A server's tokenizer is the user's promise (its echo of the ids is checked)."""
    thinking = cfg.rollout.enable_thinking  # the run renders with it: so does the check
    for ref in models.teachers.values():
        if not is_server(ref):
            require_pair(models.student, ref, checks=("max_context",) if cross else RUN_CHECKS,
                         template_kwargs=None if thinking is None else {"enable_thinking": thinking},
                         teacher_template=cfg.teacher.chat_template)  # fmt: skip


def own_tokenizer_teachers(cfg: Config, models: RunModels, loss: LossKind) -> frozenset[str]:
    """The local teachers of another vocabulary that play SFT episodes with their own tokenizer and template, each
    episode re-rendered for the student (agentopd.crosstok.retokenize): where the teachers play only to be imitated
    (run.objective=sft, or recipe.sft_steps before a cross-tokenizer loss). Elsewhere a teacher of another vocabulary
    is the pair check's refusal."""
    from agentopd.objectives import Objective
    from agentopd.pair import check_pair

    if not (Objective(cfg.run.objective).teacher_plays or (cfg.recipe.sft_steps > 0 and loss.is_cross_tokenizer)):
        return frozenset()
    return frozenset(name for name, ref in models.teachers.items()
                     if not is_server(ref) and not check_pair(models.student, ref, only=("vocabulary",), self_score=False).ok)  # fmt: skip


def cross_scorer(cfg: Config, models: RunModels, tokenizer: PreTrainedTokenizerBase, loss: LossKind) -> CrossScorer | None:
    """A cross-tokenizer loss: each teacher reads the episodes re-rendered in its own template (agentopd.crosstok)."""
    if not loss.is_cross_tokenizer:
        return None
    from transformers import AutoTokenizer

    from agentopd.crosstok.score import CrossScorer
    from agentopd.trainer.config import LossKind

    teacher_toks = {name: AutoTokenizer.from_pretrained(cfg.teacher.tokenizer if is_server(ref) else ref)
                    for name, ref in models.teachers.items()}  # fmt: skip  # a server's: teacher.tokenizer (policy.check_run)
    return CrossScorer(tokenizer, teacher_toks, full=loss == LossKind.XTOK_FULL)


def privileged_view(cfg: Config, mixture: Mixture, tokenizer: PreTrainedTokenizerBase) -> PrivilegedView | None:
    """teacher.privileged: every env must give the context (checked here, before any model)."""
    if cfg.teacher.privileged is None:
        return None
    from agentopd.privileged import PrivilegedView

    view = PrivilegedView(mixture, tokenizer, cfg.teacher.privileged)
    view.check()
    return view


def run_context(cfg: Config, mixture: Mixture, models: RunModels, trainer_cfg: TrainerConfig, rollout_cfg: RolloutConfig,
                device: torch.device, dtype: torch.dtype, tokenizer: PreTrainedTokenizerBase,
                memory_plan: MemoryPlan | None, own_tokenizer: frozenset[str] = frozenset(),
                host_plan: HostPlan | None = None) -> RunContext:  # fmt: skip
    """What the backend's stages build their parts from; the memory plan (CUDA) sizes the KV pool and decides the
    engine's sleep and the teacher's offload; without one (CPU) engine.sleep=true still does what it says, and the host
    plan sizes the teachers' scoring passes."""
    from agentopd.engines import EngineKind, resolve_kind

    ctx = RunContext(cfg, mixture, models.student, models.teachers, trainer_cfg, rollout_cfg, device, dtype,
                     vocab_size=len(tokenizer), own_tokenizer=own_tokenizer)  # fmt: skip
    sleeps = resolve_kind(cfg.engine.kind, device) != EngineKind.VLLM  # vLLM sizes its own memory
    if host_plan is not None:  # a CPU run: the teachers' scoring sizes it fits with (agentopd.memory_host)
        ctx.teacher_tokens, ctx.teacher_head_chunk = host_plan.teacher_tokens, host_plan.teacher_head_chunk
        ctx.engine_max_batch = host_plan.engine_max_batch  # and the engines' batch, where it lowered it
    if memory_plan is not None:
        ctx.kv_cache_gib = memory_plan.kv_cache_gib
        ctx.teacher_eval_kv_gib = memory_plan.teacher_eval_kv_gib
        ctx.engine_sleep = memory_plan.engine_sleep and sleeps
        ctx.teacher_offload = memory_plan.teacher_offload
    else:
        ctx.engine_sleep = cfg.engine.sleep is True and sleeps
        ctx.teacher_offload = cfg.teacher.offload is not False
    return ctx


def fit_memory(cfg: Config, models: RunModels, device: torch.device, plan: MemoryPlan | None,
               trainer_cfg: TrainerConfig) -> tuple[TrainerConfig, str | None, HostPlan | None]:
    """The trainer settings the run's memory plan fitted, the line saying so (None: nothing to say) and, on a CPU, the
    host plan: fit_host there (which refuses a run that cannot fit), fit_gpu elsewhere (`plan`: the GPU plan, None
    off CUDA)."""
    if device.type == "cpu":
        return fit_host(cfg, models, trainer_cfg)
    return *fit_gpu(plan, trainer_cfg), None


def fit_gpu(plan: MemoryPlan | None, trainer_cfg: TrainerConfig) -> tuple[TrainerConfig, str | None]:
    """A CUDA run (a plan): the trainer settings the plan fitted (activation checkpointing turned on, then the
    micro-batch halved, where the train phase did not fit otherwise: agentopd.memory_plan) and the plan's lines saying
    so; else the settings as given and None."""
    import dataclasses

    if plan is None:
        return trainer_cfg, None
    fitted = dataclasses.replace(trainer_cfg, micro_batch_tokens=plan.micro_batch_tokens,
                                 activation_checkpointing=trainer_cfg.activation_checkpointing or plan.activation_checkpointing)  # fmt: skip
    if fitted == trainer_cfg:
        return trainer_cfg, None
    lines = [n for n in plan.notes if n.startswith(("trainer.activation_checkpointing", "trainer.micro_batch_tokens"))]
    return fitted, "memory (GPU): " + "; ".join(lines)


def fit_host(cfg: Config, models: RunModels, trainer_cfg: TrainerConfig) -> tuple[TrainerConfig, str, HostPlan]:
    """A CPU run against this machine's memory (agentopd.memory_host): HostMemoryError (one line, then the plan) when it
    cannot fit, before any model loads; else the trainer settings it fits with (the micro-batch the plan took) and a line
    saying so for the terminal, and the plan (its phases' figures are logged beside the measured ones)."""
    import dataclasses

    from agentopd.memory_host import HostPhase, host_plan

    plan = host_plan(cfg, models.student, models.teachers)
    plan.check()
    peaks = ", ".join(f"{p} {plan.peak(p):.1f}" for p in HostPhase)
    line = (f"memory (CPU): peak {plan.peak(plan.worst):.1f} GiB in the {plan.worst} phase of {plan.available_gib:.1f} GiB "
            f"available ({peaks}; agentopd plan-memory shows the table)")  # fmt: skip
    if plan.notes:  # what the plan lowered to fit: the micro-batch, activation checkpointing, the teachers' passes, the engines' batch
        line += "\n" + "\n".join(plan.notes)
    trainer_cfg = dataclasses.replace(trainer_cfg, micro_batch_tokens=plan.micro_batch_tokens,
                                      activation_checkpointing=trainer_cfg.activation_checkpointing or plan.activation_checkpointing)  # fmt: skip
    return trainer_cfg, line, plan
