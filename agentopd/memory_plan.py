"""The memory plan: what each role of a run holds on each GPU, per phase, before any model loads.

    shapes = {"student": ModelShape.from_hf_config(cfg_json), "teacher": ...}   # config.json only, no weights
    plan = plan_memory(cfg, shapes, gpus_gib=[80.0])     # or gpus_gib=cuda_gpus() (torch.cuda.mem_get_info)
    print(plan.table())
    plan.check()                                         # MemoryPlanError (a ValueError) when it cannot fit
    plan.kv_cache_gib, plan.engine_sleep, plan.teacher_offload   # what the run does about it (engine.kv_cache_*,
                                                                 # engine.sleep, teacher.offload)

`agentopd plan-memory --env sql_db [overrides]` prints it; `agentopd run` refuses a run that cannot fit
with it, before any model loads. A CUDA out-of-memory during a run names its phase and this plan
(`OutOfMemory`). Sizes are GiB (2**30 bytes). All of it is arithmetic over the config and the models'
`config.json`: estimates whose constants come from the code named below, to be checked against measured
peaks (`benchmarks/memory_gpu.py`).

Shapes. P = parameters (embeddings once when tied), L layers, H hidden, q = heads x head_dim,
kv = kv_heads x head_dim, I = MLP intermediate, V = vocabulary rows. A student of W trainer ranks
(FSDP2, `ray.trainer_workers`) shards its fp32 state W ways.

Roles and formulas (bytes):
- trainer (agentopd/trainer/core.py): fp32 master weights 4P/W; AdamW exp_avg + exp_avg_sq 8P/W (kept
  between steps); fp32 gradients 4P/W (train phase only: `zero_grad(set_to_none=True)`); bf16 compute
  copies 2P (one process: autocast caches the cast of each weight for the step; FSDP2: 2P/W + the root
  unit's 2VH, gathered). With `trainer.cpu_offload` (FSDP2's CPUOffloadPolicy, Ray trainer ranks only) the
  master weights, AdamW state and gradients live in pinned host memory (16P/W a rank, in the plan's notes)
  and the GPU holds what a unit computes with while it runs: the root unit's embeddings and head (E = VH, 2VH
  untied) as bf16 parameters and fp32 gradients, 6E, and two decoder layers' (one running, one prefetched),
  2 x 6P_l; modelled from FSDP2's documented behaviour, not yet checked against a GPU's measured peak.
- activations at T = `trainer.micro_batch_tokens` (train phase). Per token and decoder layer, what
  backward keeps: a = 2rH (the two RMSNorm inputs, r = 4 bytes in one process, where autocast leaves the
  residual stream fp32; 2 under FSDP2's bf16 parameters) + 4H (the norms' bf16 outputs) + 6q + 6kv
  (q/k before and after norm+RoPE, v, the attention output: bf16) + 8I (gate, up, silu(gate),
  silu(gate)*up: bf16). Without checkpointing: T x L x a. With `trainer.activation_checkpointing` every
  k-th layer (`trainer.checkpoint_every`, ceil(L/k) layers checkpointed): T x (ceil(L/k) x rH +
  (L - ceil(L/k)) x a + a), the last a being one layer recomputed in backward. Plus the final hidden
  states and their gathered loss rows: T x H x (r + 4).
- the full-vocabulary loss (agentopd/losses/fused.py, chunk C = min(`trainer.chunk_size`, T)): two
  C x V bf16 logit buffers 4CV, the head gradient kept from the forward with its fp32 accumulator
  4VH, the hidden gradient 2TH; with a teacher (`HIDDEN` mode) its head on the trainer's GPU 2VH_t and
  the micro-batch's teacher hidden rows 2TH_t. Sampled-token losses (chunked.py) keep C x V fp32
  logits and their softmax: 8CV.
- the rollout engine (agentopd/engines/fast/engine.py): bf16 weights 2P; the KV pool
  (`engine.kv_cache_gib`, else `engine.kv_cache_fraction` of what the plan leaves free on its GPU at its
  peak, else 16 GiB, the fast engine's long-standing default; 2 x L x kv x 2 bytes per token:
  kv_cache.py `KVPool.bytes_per_token`); sampling work: 2 x max_batch_size x V fp32 logits.
  `engine.sleep` frees the pool (and its CUDA graphs) while the teacher scores and the trainer steps.
- the teacher (agentopd/teacher/hf.py): bf16 weights 2P_t, on the GPU only while it scores when offloaded
  (`teacher.offload`; auto: resident when the plan fits with it there in every phase); scoring at
  16,384 packed tokens (`max_tokens_per_batch`): one layer's inference work 2 x 16,384 x (4H_t + 2q +
  2kv + 3I), the gathered hidden rows 2 x 16,384 x H_t, three fp32 head_chunk x V buffers (logits,
  log-softmax, top-k) 12 x 1,024 x V. The head is never copied to fp32 whole (it is cast in row blocks).
- the teacher self-test's scorer of the student (agentopd.step.selftest, where `runs_selftest`: `teacher.selftest`), in
  the driver's process on the run's device (GPU 0): bf16 weights 2P and its scoring work (the teacher's formula with the
  student's shape) beyond the teacher's on that GPU, in the teacher phase (of the first step: it loads after the
  teachers scored the pre-flight's probe and is dropped after it).
- the teacher's eval (`eval.teacher`, before training): a second engine on the teacher (2P_t + its own KV
  pool: `engine.kv_cache_gib`, or less where that would not fit the eval phase, down to one context of
  `rollout.max_context`; the eval then plays with fewer episodes' K/V at once). Both backends close it after that
  eval (and the local student's engine sleeps through it when `engine.sleep` is on); a run whose
  `recipe.intervene_below` guide generates with it keeps it, its pool as large. Not counted for a
  cross-tokenizer loss (its eval.teacher is skipped).
- a teacher that plays training episodes (`objective=sft`, `recipe.sft_steps`, `recipe.teacher_fraction`:
  objectives.teacher_plays) does it on an engine of its own beside the student's: 2P_t and a KV pool of the same size,
  in every phase; under `objective=sft` no scorer of it loads (backends.stages.Scorers), so its weights are not counted
  as the teacher's above.
- every process on a GPU: 1 GiB of CUDA context, cuBLAS workspace and allocator slack.

Placement follows `run.backend`: local puts every role on one GPU (`run.device`); ray places the trainer ranks,
rollout workers and teacher replicas (of each local teacher) by their `ray.gpus_per_*` shares as Ray places the
run's bundles (agentopd.backends.placement: whole GPUs to trainer ranks first, then a rollout worker and each
teacher's replica in turn, a fraction to the GPU it fills best). A GPU fits when its peak phase stays within 95% of
its memory (fragmentation). vLLM sizes its own memory: the plan counts `engine.vllm.gpu_memory_utilization` of the
GPU for it, in every phase. Not modelled: async overlap, the teacher's eval engine under vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from agentopd.shape import ModelShape  # re-exported: the plan's callers name it here

if TYPE_CHECKING:
    from agentopd.config import Config

GIB = 2**30
HEADROOM = 0.95  # the share of a GPU a plan may fill
CONTEXT_GIB = 1.0  # per process per GPU: CUDA context, cuBLAS workspace, allocator slack
DEFAULT_KV_GIB = 16.0  # FastEngine(kv_cache_gb=16.0): the pool size when no key sets it
TEACHER_TOKENS = 16384  # HFTeacher(max_tokens_per_batch=16384)
TEACHER_HEAD_CHUNK = 1024  # HFTeacher(head_chunk=1024)
MIN_MICRO_BATCH = 512  # the smallest micro-batch a plan lowers trainer.micro_batch_tokens to (this one and the host plan)


class Phase(StrEnum):
    ROLLOUT = "rollout"
    TEACHER = "teacher"
    TRAIN = "train"
    EVAL = "eval"


ALL = tuple(Phase)


@dataclass
class Item:
    """One thing a role holds on one GPU, in the phases it is resident."""

    role: str
    what: str
    gib: float
    gpu: int
    phases: tuple[Phase, ...] = ALL


@dataclass
class MemoryPlan:
    """Per GPU and phase, what is held (see the module docstring); `fits` and the decisions taken."""

    gpus_gib: list[float]
    items: list[Item]
    kv_cache_gib: float
    engine_sleep: bool
    # the trainer's settings it planned with: the configured ones, or checkpointing and a smaller micro-batch where those did not fit
    micro_batch_tokens: int
    activation_checkpointing: bool
    teacher_offload: bool = True
    teacher_eval_kv_gib: float | None = None  # the teacher's eval engine's pool where smaller than kv_cache_gib
    notes: list[str] = field(default_factory=list)
    changes: tuple[str, ...] = ()  # the keys a refusal offers: MemoryPlanError.KEYS less what the run already has

    def peak(self, gpu: int, phase: Phase) -> float:
        return sum(i.gib for i in self.items if i.gpu == gpu and phase in i.phases)

    def peaks(self) -> list[dict[Phase, float]]:
        return [{p: self.peak(g, p) for p in Phase} for g in range(len(self.gpus_gib))]

    @property
    def fits(self) -> bool:
        return all(max(pk.values()) <= HEADROOM * cap for pk, cap in zip(self.peaks(), self.gpus_gib))

    def table(self) -> str:
        """The plan as a plain-text table: one row per item, a peak row per GPU and phase."""
        lines = [f"{'gpu':>3}  {'role':<8} {'what':<40} {'GiB':>7}  phases"]
        for i in sorted(self.items, key=lambda i: i.gpu):
            phases = "all" if i.phases == ALL else ",".join(i.phases)
            lines.append(f"{i.gpu:>3}  {i.role:<8} {i.what:<40} {i.gib:>7.2f}  {phases}")
        for g, (pk, cap) in enumerate(zip(self.peaks(), self.gpus_gib)):
            by_phase = "  ".join(f"{p} {v:.1f}" for p, v in pk.items())
            ok = "fits" if max(pk.values()) <= HEADROOM * cap else "DOES NOT FIT"
            lines.append(f"{g:>3}  peak     {by_phase}  of {cap:.1f} GiB ({HEADROOM:.0%}: {HEADROOM * cap:.1f}): {ok}")
        lines.append(f"engine KV pool {self.kv_cache_gib:.1f} GiB; engine.sleep {'on' if self.engine_sleep else 'off'}; "
                     f"teacher.offload {'on' if self.teacher_offload else 'off'}")
        lines += self.notes
        return "\n".join(lines)

    def check(self) -> None:
        if not self.fits:
            raise MemoryPlanError(self)


class MemoryPlanError(ValueError):
    """A run that cannot fit its GPUs: one line, the plan, the keys to change."""

    KEYS = ("trainer.micro_batch_tokens", "trainer.activation_checkpointing=true", "engine.kv_cache_gib",
            "engine.sleep=true", "teacher.offload=true", "eval.teacher=false", "run.backend=ray with ray.gpus_per_*",
            "trainer.cpu_offload=true (run.backend=ray)", "a smaller student or teacher")

    TRAIN_KEYS = ("trainer.micro_batch_tokens", "trainer.activation_checkpointing=true")  # they shrink the train phase alone

    def __init__(self, plan: MemoryPlan) -> None:
        self.plan = plan
        worst = max(range(len(plan.gpus_gib)), key=lambda g: max(plan.peaks()[g].values()) / plan.gpus_gib[g])
        pk = plan.peaks()[worst]
        phase = max(pk, key=pk.get)
        train_fits = all(p[Phase.TRAIN] <= HEADROOM * cap for p, cap in zip(plan.peaks(), plan.gpus_gib))
        keys = [k for k in plan.changes or self.KEYS if not (train_fits and k in self.TRAIN_KEYS)]
        super().__init__(
            f"this run does not fit its GPUs: GPU {worst} needs {pk[phase]:.1f} GiB in the {phase} phase, "
            f"{HEADROOM:.0%} of {plan.gpus_gib[worst]:.1f} GiB is {HEADROOM * plan.gpus_gib[worst]:.1f}; "
            f"keys to change: {', '.join(keys)}\n{plan.table()}"
        )


class OutOfMemory(RuntimeError):
    """A CUDA out-of-memory during a run: the phase it struck in and the plan (agentopd.runner)."""


class PhaseMemory(NamedTuple):
    """What a phase took on a GPU, measured: peak reserved and peak allocated GiB, and the caching allocator's
    retries (a cudaMalloc that failed, the allocator's cache freed, tried again: a synchronising stall, the sign
    of a GPU run within a few GiB of its memory)."""

    reserved: float
    allocated: float
    retries: int = 0

    def __add__(self, other: PhaseMemory) -> PhaseMemory:  # actors sharing a GPU (each its own peak: an upper bound)
        return PhaseMemory(self.reserved + other.reserved, self.allocated + other.allocated, self.retries + other.retries)


_retries_seen: dict[int, int] = {}


def measure_since_last(device: Any = None) -> PhaseMemory:
    """This process's PhaseMemory on `device` (the current CUDA device) since the last call, then reset; zeros where
    CUDA is absent or not yet used."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return PhaseMemory(0.0, 0.0)
    given = torch.device(device) if device is not None else None
    index = given.index if given is not None and given.index is not None else torch.cuda.current_device()
    retries = int(torch.cuda.memory_stats(index).get("num_alloc_retries", 0))
    peak = PhaseMemory(torch.cuda.max_memory_reserved(index) / GIB, torch.cuda.max_memory_allocated(index) / GIB,
                       retries - _retries_seen.get(index, 0))  # fmt: skip
    _retries_seen[index] = retries
    torch.cuda.reset_peak_memory_stats(index)
    return peak


def cuda_gpus() -> list[float]:
    """Total memory of each visible CUDA device in GiB ([] without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.mem_get_info(i)[1] / GIB for i in range(torch.cuda.device_count())]


def _gib(nbytes: float) -> float:
    return nbytes / GIB


def _placement(cfg: Config, teachers: int = 1) -> tuple[list[int], list[int], list[int]]:
    """GPU index of each trainer rank, rollout worker and teacher replica (of `teachers` local teachers; replicas of
    the first teacher first), -1 for an actor on CPU: Ray's placement of the run's bundles
    (agentopd.backends.placement.gpu_index; a server teacher's replicas take no GPU, so they move no other)."""
    from agentopd.backends.base import BackendKind
    from agentopd.backends.placement import ROLLOUT, TRAINER, gpu_index, gpu_roles, teacher_role

    names = [str(k) for k in range(teachers)]
    if cfg.run.backend == BackendKind.LOCAL:
        return [0], [0], [0] * len(names)
    r = cfg.ray
    gpu = gpu_index(gpu_roles(r, names))
    return ([gpu.get((TRAINER, i), -1) for i in range(r.trainer_workers)],
            [gpu.get((ROLLOUT, i), -1) for i in range(r.rollout_workers)],
            [gpu.get((teacher_role(t), i), -1) for t in names for i in range(r.teacher_replicas)])  # fmt: skip


def plan_memory(cfg: Config, shapes: dict[str, ModelShape], gpus_gib: list[float], teachers: int = 1) -> MemoryPlan:
    """The plan for `cfg` with `shapes["student"]` and (when it scores) `shapes["teacher"]` (the largest of `teachers`
    local ones) on GPUs of `gpus_gib`. What `auto` decides, cheapest first: a resident teacher (no copy of its weights
    a step) before an offloaded one, an awake engine (no CUDA graphs captured again a step) before a sleeping one; the
    first choice that fits is taken. `teacher.offload=auto` offloads several local teachers (one is on the GPU at a
    time) and, with `engine.kv_cache_fraction`, leaves the room to the KV pool. Where no choice fits, the trainer's
    activations shrink until one does, as the host plan's do on a CPU, rather than a refusal: activation checkpointing
    first (at 1.7B on an H200 it cost about what a halved micro-batch costs, and saves more: realsize_profile.md,
    2e7c464), then the micro-batch halved (down to MIN_MICRO_BATCH tokens; the same gradient in more micro-batches).
    A refusal shows the plan with the configured settings."""
    from agentopd.backends.base import BackendKind

    sleep = cfg.engine.sleep if cfg.run.backend == BackendKind.LOCAL else cfg.ray.engine_sleep
    offload = cfg.teacher.offload
    if offload == "auto" and (teachers > 1 or (cfg.engine.kv_cache_fraction is not None and not _vllm(cfg))):
        offload = True
    if cfg.teacher.overlap:  # it scores during the rollout: resident (teacher.offload=true is refused at config load)
        offload = False
    choices = [(s, o) for s in ((False, True) if sleep == "auto" else (bool(sleep),))
               for o in ((False, True) if offload == "auto" else (bool(offload),))]  # fmt: skip

    def first_fit(trainer) -> MemoryPlan:  # the first choice that fits with these trainer settings, else the last one
        for engine_sleep, teacher_offload in choices:
            plan = _sized(cfg, shapes, gpus_gib, engine_sleep=engine_sleep, teacher_offload=teacher_offload, teachers=teachers,
                          trainer=trainer)  # fmt: skip
            if plan.fits:
                break
        return plan

    tc = cfg.trainer
    plan = first_fit(tc)
    fallbacks = [] if tc.activation_checkpointing else [tc.model_copy(update={"activation_checkpointing": True})]
    tokens = tc.micro_batch_tokens
    while tokens // 2 >= MIN_MICRO_BATCH:
        tokens //= 2
        fallbacks.append(tc.model_copy(update={"activation_checkpointing": True, "micro_batch_tokens": tokens}))
    for trainer in fallbacks if not plan.fits else ():
        if (fitted := first_fit(trainer)).fits:
            plan = fitted
            break
    if plan.activation_checkpointing and not tc.activation_checkpointing:
        plan.notes.append("trainer.activation_checkpointing false -> true: the train phase did not fit without it")
    if plan.micro_batch_tokens != tc.micro_batch_tokens:
        plan.notes.append(f"trainer.micro_batch_tokens {tc.micro_batch_tokens} -> {plan.micro_batch_tokens}: the train phase "
                          f"did not fit at {tc.micro_batch_tokens} (the same gradient: more micro-batches a step)")  # fmt: skip
    if sleep == "auto" and plan.engine_sleep:
        plan.notes.append("engine.sleep=auto: on (the KV pool would not fit beside the teacher and the trainer)")
    if offload == "auto" and plan.teacher_offload and "teacher" in shapes:
        plan.notes.append("teacher.offload=auto: on (the teacher would not fit resident beside the trainer and the engine)")
    return plan


def _sized(cfg: Config, shapes: dict[str, ModelShape], gpus_gib: list[float], *, engine_sleep: bool, teacher_offload: bool = True,
           teachers: int = 1, trainer: Any = None) -> MemoryPlan:
    """The plan with the KV pool `engine.kv_cache_gib`, or the largest `engine.kv_cache_fraction` of what the rest
    leaves: every phase's peak is base + pools x kv, so kv = fraction x min over phases of (95% x GPU - base) / pools."""
    fraction = cfg.engine.kv_cache_fraction
    if fraction is None or _vllm(cfg):
        return _plan(cfg, shapes, gpus_gib, engine_sleep=engine_sleep, kv=_kv_gib(cfg), teacher_offload=teacher_offload,
                     teachers=teachers, trainer=trainer)
    base, unit = (_plan(cfg, shapes, gpus_gib, engine_sleep=engine_sleep, kv=k, teacher_offload=teacher_offload,
                        teachers=teachers, trainer=trainer) for k in (0.0, 1.0))
    room = [(HEADROOM * cap - base.peak(g, p)) / (unit.peak(g, p) - base.peak(g, p))
            for g, cap in enumerate(gpus_gib) for p in Phase if unit.peak(g, p) > base.peak(g, p)]  # fmt: skip
    kv = max(0.0, fraction * min(room))
    plan = _plan(cfg, shapes, gpus_gib, engine_sleep=engine_sleep, kv=kv, teacher_offload=teacher_offload, teachers=teachers,
                 trainer=trainer)
    plan.notes.append(f"engine.kv_cache_fraction={fraction:g}: a pool of {kv:.1f} GiB ({min(room):.1f} GiB would fill the GPU)")
    return plan


def _plan(cfg: Config, shapes: dict[str, ModelShape], gpus_gib: list[float], *, engine_sleep: bool, kv: float,
          teacher_offload: bool = True, teachers: int = 1, trainer: Any = None) -> MemoryPlan:
    """The plan with the KV pool `kv` (GiB); `trainer`: the `trainer` section to plan with (cfg's by default)."""
    from agentopd.backends.base import BackendKind
    from agentopd.objectives import (
        loads_scorer,
        runs_selftest,
        teacher_evals,
        teacher_plays,
    )
    from agentopd.trainer.config import LossKind

    s, t = shapes["student"], shapes.get("teacher")
    local = cfg.run.backend == BackendKind.LOCAL
    tr, ro, te = _placement(cfg, teachers)
    if max(tr + ro + te) >= len(gpus_gib):
        raise ValueError(f"the placement needs {max(tr + ro + te) + 1} GPUs (ray.gpus_per_*), {len(gpus_gib)} present")
    items: list[Item] = []
    eval_pools: list[tuple[int, int]] = []  # (GPU, engines) of a teacher's eval engine whose pool is sized last
    world = len(tr)
    tc, P = trainer or cfg.trainer, s.params
    train_only = (Phase.TRAIN,)
    notes = []
    if tc.cpu_offload and tr:
        notes.append(f"trainer.cpu_offload: fp32 master weights, AdamW state and gradients in pinned host memory, "
                     f"{_gib(16 * P / world):.1f} GiB a trainer rank")  # fmt: skip
    for g in sorted(set(tr) - {-1}):
        if tc.cpu_offload:
            E = s.vocab * s.hidden * (1 if s.tied else 2)
            per_layer = (P - E) / s.layers
            items += [Item("trainer", "offloaded: root unit bf16 + fp32 grads", _gib(6 * E), g, train_only),
                      Item("trainer", "offloaded: 2 layers bf16 + fp32 grads", _gib(2 * 6 * per_layer), g, train_only)]  # fmt: skip
        else:
            items += [Item("trainer", f"fp32 master weights ({P / 1e9:.2f}B / {world})", _gib(4 * P / world), g),
                      Item("trainer", "AdamW state (2 x fp32)", _gib(8 * P / world), g),
                      Item("trainer", "fp32 gradients", _gib(4 * P / world), g, train_only)]  # fmt: skip
            copies = 2 * P if world == 1 else 2 * P / world + 2 * s.vocab * s.hidden
            items.append(Item("trainer", "bf16 compute copies", _gib(copies), g, train_only))
        T, r = tc.micro_batch_tokens, 4 if world == 1 else 2
        a = s.layer_activation_bytes(r)
        if tc.activation_checkpointing:
            kept = -(-s.layers // tc.checkpoint_every)
            act = T * (kept * r * s.hidden + (s.layers - kept) * a + a)
            what = f"activations, {T} tok, checkpointed 1/{tc.checkpoint_every}"
        else:
            act, what = T * s.layers * a, f"activations, {T} tok, no checkpointing"
        act += T * s.hidden * (r + 4)
        items.append(Item("trainer", what, _gib(act), g, train_only))
        C, V = min(tc.chunk_size, T), s.vocab
        full_vocab = tc.loss in (LossKind.REVERSE_KL, LossKind.FORWARD_KL, LossKind.JSD)
        loss = 4 * C * V + 4 * V * s.hidden + 2 * T * s.hidden if full_vocab else 8 * C * V
        items.append(Item("trainer", f"loss buffers (chunk {C}, V {V})", _gib(loss), g, train_only))
        if full_vocab and t is not None:
            items.append(Item("trainer", "teacher head + hidden rows", _gib(2 * V * t.hidden + 2 * T * t.hidden), g, train_only))
    for g in sorted(set(ro) - {-1}):
        workers = ro.count(g)
        if _vllm(cfg):  # vLLM takes its share of the GPU for weights, KV cache and graphs (stages.vllm_options)
            from agentopd.backends.stages import vllm_options

            share = vllm_options(cfg)["gpu_memory_utilization"]
            items.append(Item("engine", f"vLLM: gpu_memory_utilization {share:g} x{workers}", share * gpus_gib[g] * workers, g))
            continue
        awake = (Phase.ROLLOUT, Phase.EVAL) if engine_sleep else ALL
        items += [Item("engine", f"student bf16 weights x{workers}", _gib(2 * P) * workers, g),
                  Item("engine", f"KV pool x{workers}", kv * workers, g, awake),
                  Item("engine", "sampling logits", _gib(8 * cfg.engine.max_batch_size * s.vocab) * workers, g, awake)]  # fmt: skip
        guide = cfg.recipe.intervene_below is not None  # the teacher's engine guides every rollout
        plays = teacher_plays(cfg) and not guide  # it plays training episodes on an engine of its own (its KV pool as large)
        if plays and t is not None:
            items.append(Item("engine", f"teacher's play engine: bf16 weights + KV x{workers}", (_gib(2 * t.params) + kv) * workers,
                              g))  # fmt: skip
        elif guide and t is not None:  # the teacher's engine guides every rollout: kept, its pool as large
            items.append(Item("eval", f"teacher's engine: bf16 weights + KV x{workers}", (_gib(2 * t.params) + kv) * workers, g))
        elif teacher_evals(cfg) and t is not None:  # closed after the teacher's eval: its pool sized below
            items.append(Item("eval", f"teacher's engine: bf16 weights x{workers}", _gib(2 * t.params) * workers, g, (Phase.EVAL,)))
            eval_pools.append((g, workers))
    work = 0.0  # the teacher's scoring work on GPU 0
    if t is not None and loads_scorer(cfg):
        work = _scoring_work(t) if 0 in te else 0.0
        resident = (Phase.TEACHER,) if teacher_offload else ALL
        scoring = (Phase.ROLLOUT, Phase.TEACHER) if cfg.teacher.overlap else (Phase.TEACHER,)  # teacher.overlap: beside it
        for g in sorted(set(te) - {-1}):
            # one process per teacher replica on Ray; the local backend's one process holds every local teacher
            # while they stay resident (offloaded, one at a time); each counted at the largest's size
            n = te.count(g) if not local else 1 if teacher_offload else teachers
            fp8 = cfg.teacher.linear_dtype == "fp8"
            what = "fp8 projections + bf16 rest" if fp8 else "bf16 weights"
            items += [Item("teacher", f"{what} ({t.params / 1e9:.2f}B) x{n}", _gib(teacher_weight_bytes(t, cfg.teacher.linear_dtype)) * n,
                           g, resident),
                      Item("teacher", "scoring work (16k tokens)", _gib(_scoring_work(t, fp8)) * n, g, scoring)]  # fmt: skip
    if runs_selftest(cfg):  # the driver's scorer of the student, on the run's device; the teacher's buffers are free by then
        items.append(Item("selftest", "student scorer, pre-flight: bf16 weights + work", _gib(2 * P + max(0.0, _scoring_work(s) - work)),
                          0, (Phase.TEACHER,)))  # fmt: skip
    procs = {g: tr.count(g) + ro.count(g) + te.count(g) for g in range(len(gpus_gib))} if not local else {0: 1}
    for g, n in procs.items():
        if n:
            items.append(Item("cuda", f"context + slack x{n}", CONTEXT_GIB * n, g))
    kv_bytes = 1 if cfg.engine.kv_cache_dtype == "fp8" else 2

    def one_context(shape: ModelShape) -> float:  # GiB of K/V for one rollout.max_context of `shape`
        return _gib(shape.kv_bytes_per_token(kv_bytes) * min(cfg.rollout.max_context, 1 << 20))

    teacher_eval_kv = None
    for g, workers in eval_pools:  # after every other item on its GPU: what the eval phase leaves, at most kv
        room = (HEADROOM * gpus_gib[g] - sum(i.gib for i in items if i.gpu == g and Phase.EVAL in i.phases)) / workers
        pool = min(kv, max(room, one_context(t)))
        if pool < kv:
            teacher_eval_kv = pool if teacher_eval_kv is None else min(teacher_eval_kv, pool)
        items.append(Item("eval", f"teacher's engine: KV pool x{workers}", pool * workers, g, (Phase.EVAL,)))
    if teacher_eval_kv is not None:
        notes.append(f"the teacher's eval engine: a KV pool of {teacher_eval_kv:.1f} GiB (engine.kv_cache_gib's {kv:.1f} would "
                     "not fit beside the eval phase's other holders)")  # fmt: skip
    in_effect = {key for on, key in ((tc.activation_checkpointing, "trainer.activation_checkpointing=true"), (engine_sleep, "engine.sleep=true"),
                                     (teacher_offload and t is not None, "teacher.offload=true"), (not cfg.eval.teacher, "eval.teacher=false"),
                                     (tc.cpu_offload, "trainer.cpu_offload=true (run.backend=ray)")) if on}  # fmt: skip
    renamed = {} if local else {"engine.sleep=true": "ray.engine_sleep=true"}  # the Ray backend's key for it
    changes = tuple(renamed.get(k, k) for k in MemoryPlanError.KEYS if k not in in_effect)
    plan = MemoryPlan(gpus_gib=list(gpus_gib), items=items, kv_cache_gib=kv, engine_sleep=engine_sleep, teacher_offload=teacher_offload,
                      teacher_eval_kv_gib=teacher_eval_kv, notes=notes, changes=changes, micro_batch_tokens=tc.micro_batch_tokens,
                      activation_checkpointing=tc.activation_checkpointing)  # fmt: skip
    need = one_context(s)
    if need > plan.kv_cache_gib:
        plan.notes.append(f"the KV pool cannot hold one context of rollout.max_context={cfg.rollout.max_context} "
                          f"({need:.2f} GiB): raise engine.kv_cache_gib")  # fmt: skip
    if cfg.rollout.concurrency < cfg.engine.max_batch_size:  # the README's example decoded ~54 rows of 256 (realsize_profile.md)
        plan.notes.append(f"rollout.concurrency={cfg.rollout.concurrency} episodes in flight: the engine never decodes more "
                          f"rows at once than that, of engine.max_batch_size={cfg.engine.max_batch_size}; raise "
                          "rollout.concurrency to fill it")  # fmt: skip
    return plan


def _scoring_work(t: ModelShape, fp8: bool = False) -> float:
    """Bytes an HFTeacher of shape `t` allocates while it scores (the module docstring's formula); `fp8`
    (teacher.linear_dtype): + a projection's input scaled (bf16) and quantized (1 byte), at its widest (the MLP's)."""
    Tt = TEACHER_TOKENS
    work = 2 * Tt * (4 * t.hidden + 2 * t.q + 2 * t.kv + 3 * t.intermediate) + 2 * Tt * t.hidden + 12 * TEACHER_HEAD_CHUNK * t.vocab
    return work + (3 * Tt * t.intermediate if fp8 else 0)


def teacher_weight_bytes(t: ModelShape, linear_dtype: str = "auto") -> float:
    """A local teacher's weights in bf16, or with its decoder projections in float8 (one byte; teacher.linear_dtype=fp8,
    agentopd.teacher.fp8) and their per-row fp32 scales."""
    if linear_dtype != "fp8":
        return 2 * t.params
    scales = 4 * t.layers * (t.q + 2 * t.kv + t.hidden + 2 * t.intermediate + t.hidden)  # one per output row
    return 2 * t.params - t.linear_params + scales


def _vllm(cfg: Config) -> bool:
    """Whether the run's engine is vLLM: engine.kind=vllm, or auto where vLLM and CUDA are installed (engines.resolve_kind)."""
    if cfg.engine.kind != "auto":
        return cfg.engine.kind == "vllm"
    import importlib.util

    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


def _kv_gib(cfg: Config) -> float:
    return cfg.engine.kv_cache_gib if cfg.engine.kv_cache_gib is not None else DEFAULT_KV_GIB


def shapes_of(refs: dict[str, Path | str]) -> dict[str, ModelShape]:
    """Shapes from local model folders' config.json (a hub id's config through transformers' cache)."""
    return {role: ModelShape.from_ref(ref) for role, ref in refs.items()}


def run_plan(cfg: Config, device: Any, student_ref: Path | str, teacher_refs: dict[str, Path | str]) -> MemoryPlan | None:
    """A run's memory plan on CUDA `device` (None elsewhere), checked: MemoryPlanError when it cannot fit. The GPUs
    are the run's own one (run.backend=local) or the cluster's; of several teachers the largest counts (one is on a
    GPU at a time, unless teacher.offload=false keeps them all); a teacher behind a server holds nothing here."""
    import torch

    from agentopd.backends.base import BackendKind
    from agentopd.teacher.base import is_server

    if device.type != "cuda":
        return None
    if cfg.run.backend == BackendKind.LOCAL:
        index = device.index if device.index is not None else torch.cuda.current_device()
        gpus = [torch.cuda.mem_get_info(index)[1] / 2**30]
    else:
        gpus = cuda_gpus()
    local = {name: ref for name, ref in teacher_refs.items() if not is_server(ref)}
    shapes = shapes_of({"student": student_ref, **local})
    teachers = [shapes.pop(name) for name in local]
    if teachers:
        shapes["teacher"] = max(teachers, key=lambda t: t.params)
    plan = plan_memory(cfg, shapes, gpus, teachers=max(1, len(teachers)))
    plan.check()
    return plan

