"""The host-memory plan of a CPU run: what the trainer, the rollout engine and the teachers hold in RAM per phase,
against the memory this machine has available, before any model loads; and the micro-batch that makes it fit.

    plan = plan_host(cfg, shapes, dtype_bytes, available_gib=available_host_gib())
    print(plan.table())
    plan.check()                       # HostMemoryError (a ValueError) naming the phase and the shortfall
    plan.micro_batch_tokens            # what the trainer uses: the configured size, halved until the train phase fits
                                       # and its activations take at most a quarter of the available memory

`agentopd run` on a CPU prints it and refuses a run that cannot fit in seconds (a 0.5B student with a 1.5B teacher
was killed by the kernel's OOM killer at 23.5 GB after minutes, with nothing said). Sizes are GiB (2**30 bytes). Like
agentopd.memory_plan for GPUs it is arithmetic over the config and the models' config.json; the terms (bytes, P =
parameters, L layers, H hidden, q/kv attention widths, I MLP width, V vocabulary rows, T = micro-batch tokens):
- trainer (fp32 on a CPU: agentopd.trainer.core picks fp32 there): weights 4P and AdamW's two moments 8P between
  steps; fp32 gradients 4P in the train phase.
- activations at T, train phase: what backward keeps per token and layer is agentopd.memory_plan's `a` with every
  bf16 term doubled (fp32 throughout), T x L x a; with `trainer.activation_checkpointing` T x (L x 4H + a). Plus the
  chunked loss's fp32 logits and softmax over C = min(chunk_size, T) rows, 8CV, and the teacher's hidden rows 4TH_t.
- the rollout engine: weights in the dtype the checkpoint is stored in (bf16 for real checkpoints, fp32 for the
  embedded models: RunContext.inference_dtype), the part of its CPU KV pool the run's episodes can fill (the pool holds
  engine.max_batch_size contexts of up to 2,048 tokens, agentopd.engines.fast, but pages never written take no
  memory: min(max_batch_size, episodes of a step or an eval) x min(rollout.max_context, 2,048) tokens), and its
  sampling logits 2 x max_batch_size x V fp32.
- each local teacher, where it scores (not under objective=sft: agentopd.backends.stages.Scorers loads a scorer on
  first use): weights as the engine's; scoring work in the score phase (one layer's inference work over
  TEACHER_TOKENS tokens and its hidden rows, three fp32 head_chunk x V chunks: agentopd.teacher.hf); where it plays
  training episodes (agentopd.objectives.teacher_plays), its play engine (weights and a KV pool) — in a run of SFT steps then OPD only
  what the engine holds beyond the scorer, as it closes before the scorer loads; with `eval.teacher` the eval phase
  before training adds an engine on the teacher (its weights again and a KV pool).
- the teacher self-test's scorer of the student (agentopd.step.selftest, where `runs_selftest`: `teacher.selftest`):
  loaded after the teachers scored the pre-flight's probe and dropped after it, so in the score phase (of the first
  step): the student's weights again (as the engine holds them) and its scoring work beyond the teachers' (the
  teachers' buffers are free by then: only a larger student's work adds).
- the process itself (Python, torch, transformers, tokenizers, the envs, mapped model files): RUNTIME_GIB, calibrated
  on one measured real-pair run (benchmarks/results/real_cpu_memory.md).
The plan fits when every phase stays within HEADROOM of what /proc/meminfo calls available at start (or of
`run.host_memory_gib`, for a run that must leave room to other work).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from agentopd.memory_plan import MIN_MICRO_BATCH, ModelShape
from agentopd.shape import stored_in_bf16

if TYPE_CHECKING:
    from agentopd.config import Config

HEADROOM = 0.9  # of MemAvailable: page cache of the model files, allocator slack, the episode store
# the process beside the models: ~1.5 GiB before any model loads (torch, transformers, tokenizers imported), and ~1.5
# more measured on a real pair (0.5B student, 1.5B teacher, 3 steps, 2026-11-29: RSS peak 19.0 GiB where the terms
# above summed to 17.5), most likely the model files' pages that loading maps and leaves resident
RUNTIME_GIB = 3.0
CPU_CONTEXT = 2048  # the fast engine's CPU pool: max_batch_size contexts of up to this many tokens
TEACHER_TOKENS = 16_384  # HFTeacher's max_tokens_per_batch
TEACHER_HEAD_CHUNK = 1024  # and head_chunk
MIN_TEACHER_TOKENS, MIN_TEACHER_HEAD_CHUNK = 2048, 128  # the smallest scoring sizes the plan lowers the teacher's to
ACTIVATION_SHARE = 0.25  # of the available memory, at most, for a micro-batch's activations
MIN_ENGINE_BATCH = 4  # the fewest episodes an engine plays at once where the plan lowers engine.max_batch_size


class HostPhase(StrEnum):
    EVAL = "eval"  # the teacher's eval before training (eval.teacher): a second engine, on the teacher
    ROLLOUT = "rollout"
    SCORE = "score"
    TRAIN = "train"


@dataclass
class HostItem:
    role: str
    what: str
    gib: float
    phases: tuple[HostPhase, ...] = tuple(HostPhase)


@dataclass
class HostPlan:
    available_gib: float
    items: list[HostItem]
    micro_batch_tokens: int
    notes: list[str] = field(default_factory=list)
    # what the plan chose to fit (plan_host): the run takes these (run_parts.fit_host)
    activation_checkpointing: bool = False
    teacher_tokens: int = TEACHER_TOKENS
    teacher_head_chunk: int = TEACHER_HEAD_CHUNK
    engine_max_batch: int | None = None  # engine.max_batch_size where the plan lowered it (None: the config's)

    def peak(self, phase: HostPhase) -> float:
        return sum(i.gib for i in self.items if phase in i.phases)

    @property
    def worst(self) -> HostPhase:
        return max(HostPhase, key=self.peak)

    @property
    def fits(self) -> bool:
        return self.peak(self.worst) <= HEADROOM * self.available_gib

    def table(self) -> str:
        lines = [f"{'role':<8} {'what':<44} {'GiB':>7}  phases"]
        for i in self.items:
            phases = "all" if i.phases == tuple(HostPhase) else ",".join(i.phases)
            lines.append(f"{i.role:<8} {i.what:<44} {i.gib:>7.2f}  {phases}")
        peaks = "  ".join(f"{p} {self.peak(p):.1f}" for p in HostPhase)
        cap = HEADROOM * self.available_gib
        lines.append(f"peak     {peaks}  of {self.available_gib:.1f} GiB available ({HEADROOM:.0%}: {cap:.1f}): "
                     f"{'fits' if self.fits else 'DOES NOT FIT'}")  # fmt: skip
        return "\n".join([*lines, *self.notes])

    def check(self) -> None:
        if not self.fits:
            raise HostMemoryError(self)


class HostMemoryError(ValueError):
    """A CPU run that cannot fit this machine's memory: one line naming the phase and the shortfall, then the plan."""

    def __init__(self, plan: HostPlan) -> None:
        phase = plan.worst
        need, cap = plan.peak(phase), HEADROOM * plan.available_gib
        super().__init__(
            f"this run does not fit this machine's memory: the {phase} phase needs {need:.1f} GiB, {HEADROOM:.0%} of the "
            f"{plan.available_gib:.1f} GiB available is {cap:.1f} (short by {need - cap:.1f}), with "
            f"trainer.micro_batch_tokens={plan.micro_batch_tokens}; {self.left(plan, phase)}, or use a smaller student "
            f"or teacher (agentopd plan-memory shows this plan)\n{plan.table()}"
        )

    @staticmethod
    def left(plan: HostPlan, phase: HostPhase) -> str:
        """What the user can still change for `phase`: the plan's own levers (micro-batch, activation checkpointing, the
        teachers' passes, the engines' batch) are at their limits by now, so only what they do not touch."""
        keys = ["rollout.max_context (each engine's KV pool holds its episodes' contexts, in every phase)"]
        if phase is HostPhase.EVAL:
            keys.insert(0, "eval.teacher=false (no engine on the teacher before training) or eval.num_tasks")
        if phase is HostPhase.TRAIN and not plan.activation_checkpointing:
            keys.insert(0, "trainer.activation_checkpointing=true")
        return "change " + ", or ".join(keys)


def available_host_gib() -> float:
    """MemAvailable of /proc/meminfo, GiB (what the kernel can hand out without swapping)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / 2**30
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def _gib(nbytes: float) -> float:
    return nbytes / 2**30


def _activations(s: ModelShape, tokens: int, checkpointing: bool) -> float:
    a = 2 * s.layer_activation_bytes(4)  # fp32: the bf16 terms of the GPU formula doubled
    per_token = s.layers * 4 * s.hidden + a if checkpointing else s.layers * a
    return tokens * per_token


@dataclass(frozen=True)
class HostRun:
    """What of a run's config the host plan reads."""

    micro_batch_tokens: int
    chunk_size: int
    activation_checkpointing: bool
    engine_max_batch: int
    teacher_eval: bool = False
    in_flight: int | None = None  # episodes that can hold KV pages at once (None: engine_max_batch)
    context: int = CPU_CONTEXT  # tokens an episode can hold (rollout.max_context, at most CPU_CONTEXT)
    selftest: bool = False  # the teacher self-test's pre-flight loads a scorer of the student (agentopd.objectives.runs_selftest)
    teacher_scores: bool = True  # a scorer of each local teacher is loaded (not under objective=sft: backends.stages.Scorers)
    # the teachers play training episodes on an engine of their own: "" never; "alone" (objective=sft: no scorer);
    # "before" (SFT steps, then OPD: its engine closes before its scorer loads); "beside" (at once: teacher_fraction,
    # intervene_below)
    teacher_plays: str = ""
    teacher_tokens: int = TEACHER_TOKENS  # the teachers' scoring sizes (HFTeacher max_tokens_per_batch, head_chunk)
    teacher_head_chunk: int = TEACHER_HEAD_CHUNK

    train_in_flight: int | None = None  # training episodes of a step (tasks x n): all a teacher's play engine holds
    # a teacher's engines run on its scorer's weights (agentopd.backends.teacher_weights): they add their KV pools only
    teacher_shares: bool = False
    teacher_overlap: bool = False  # teacher.overlap: the teachers score (and keep their hidden rows) during the rollout

    def kv_tokens(self, in_flight: int | None = None) -> int:
        """KV-pool tokens the run's episodes can fill (`in_flight` of them, default the student's engine's: a step's or
        an eval's): the pool's pages are allocated, untouched ones take no memory."""
        episodes = in_flight or self.in_flight or self.engine_max_batch
        return min(self.engine_max_batch, episodes) * min(self.context, CPU_CONTEXT)


def plan_host(run: HostRun, student: ModelShape, student_bytes: int, teachers: list[tuple[ModelShape, int]],
              available_gib: float) -> HostPlan:  # fmt: skip
    """The plan at the largest micro-batch (the configured one, halved down to MIN_MICRO_BATCH) whose train phase fits
    and whose activations stay within ACTIVATION_SHARE of the available memory (on a CPU a larger micro-batch buys
    little speed: the matmuls are already large at a few thousand tokens). Where that does not fit, what else makes the
    phase that does not fit smaller: the train phase, activation checkpointing (recomputes the forward: ~1.3x the
    train phase's compute); the score phase, the teachers' scoring sizes halved (their hidden work and fp32 head
    chunks: more, smaller passes) down to MIN_TEACHER_TOKENS and MIN_TEACHER_HEAD_CHUNK; then any phase, the engines'
    batch (engine.max_batch_size: their KV pools, in every phase) halved down to MIN_ENGINE_BATCH episodes at once.
    Whether the plan it ends with fits is check()'s.""" 
    configured = run
    plan = _sized(run, student, student_bytes, teachers, available_gib)
    notes = []
    while not plan.fits:
        cap = HEADROOM * available_gib
        if plan.peak(HostPhase.TRAIN) > cap and not run.activation_checkpointing:
            run = replace(run, activation_checkpointing=True)
            notes.append("trainer.activation_checkpointing false -> true: the train phase did not fit without it")
        elif plan.peak(HostPhase.SCORE) > cap and teachers and (run.teacher_tokens > MIN_TEACHER_TOKENS
                                                              or run.teacher_head_chunk > MIN_TEACHER_HEAD_CHUNK):  # fmt: skip
            run = replace(run, teacher_tokens=max(MIN_TEACHER_TOKENS, run.teacher_tokens // 2),
                          teacher_head_chunk=max(MIN_TEACHER_HEAD_CHUNK, run.teacher_head_chunk // 2))  # fmt: skip
        elif (played := min(run.engine_max_batch, run.in_flight or run.engine_max_batch)) > MIN_ENGINE_BATCH:
            # the engines' KV pools are in every phase: fewer episodes at once (a slower rollout) where nothing else is left
            run = replace(run, engine_max_batch=max(MIN_ENGINE_BATCH, played // 2))
        else:
            break
        plan = _sized(run, student, student_bytes, teachers, available_gib)
    if run.teacher_tokens != TEACHER_TOKENS or run.teacher_head_chunk != TEACHER_HEAD_CHUNK:
        notes.append(f"teacher scoring {TEACHER_TOKENS} tokens / head chunks of {TEACHER_HEAD_CHUNK} rows -> "
                     f"{run.teacher_tokens} / {run.teacher_head_chunk}: the score phase did not fit")  # fmt: skip
    if run.engine_max_batch != configured.engine_max_batch:
        notes.append(f"engine.max_batch_size {configured.engine_max_batch} -> {run.engine_max_batch}: the engines' KV pools "
                     "(every phase) did not fit with more episodes at once")  # fmt: skip
        plan.engine_max_batch = run.engine_max_batch
    plan.notes[:0] = notes
    return plan


def _sized(run: HostRun, student: ModelShape, student_bytes: int, teachers: list[tuple[ModelShape, int]],
           available_gib: float) -> HostPlan:  # fmt: skip
    """The plan at the largest micro-batch that fits (plan_host's first rule)."""
    tokens = run.micro_batch_tokens
    while True:
        plan = _plan(run, tokens, student, student_bytes, teachers, available_gib)
        train_fits = plan.peak(HostPhase.TRAIN) <= HEADROOM * available_gib
        small = _gib(_activations(student, tokens, run.activation_checkpointing)) <= ACTIVATION_SHARE * available_gib
        if (train_fits and small) or tokens // 2 < MIN_MICRO_BATCH:
            break
        tokens //= 2
    if tokens != run.micro_batch_tokens:
        plan.notes.append(f"trainer.micro_batch_tokens {run.micro_batch_tokens} -> {tokens}: activations within "
                          f"{ACTIVATION_SHARE:.0%} of the available memory (the same gradient: more micro-batches a step)")  # fmt: skip
    return plan


def _plan(run: HostRun, tokens: int, s: ModelShape, student_bytes: int, teachers: list[tuple[ModelShape, int]],
          available_gib: float) -> HostPlan:  # fmt: skip
    train = (HostPhase.TRAIN,)
    p = s.params
    items = [
        HostItem("process", "Python, torch, transformers, mapped files", RUNTIME_GIB),
        HostItem("trainer", "fp32 weights + AdamW moments (12 B/param)", _gib(12 * p)),
        HostItem("trainer", "fp32 gradients", _gib(4 * p), train),
        HostItem("trainer", f"activations at {tokens} tokens" + (", checkpointed" if run.activation_checkpointing else ""),
                 _gib(_activations(s, tokens, run.activation_checkpointing)), train),
        HostItem("trainer", f"loss: fp32 logits of {min(run.chunk_size, tokens)} rows", _gib(8 * min(run.chunk_size, tokens) * s.vocab), train),
        HostItem("engine", f"weights ({student_bytes} B/param)", _gib(student_bytes * p)),
        HostItem("engine", f"KV pool ({run.kv_tokens():,} tokens filled) + sampling logits",
                 _gib(_pool(run, s, student_bytes))),
    ]  # fmt: skip
    for i, (t, nbytes) in enumerate(teachers):
        name = "teacher" if len(teachers) == 1 else f"teacher{i}"
        weights = nbytes * t.params
        engine = weights + _pool(run, t, nbytes)  # an eval engine
        # its play engine plays training episodes only (a step's at most), never the evals
        player = weights + _pool(run, t, nbytes, run.train_in_flight)
        if run.teacher_scores:
            beside = (HostPhase.ROLLOUT,) if run.teacher_overlap else ()  # teacher.overlap: scoring while the rollout plays
            items += [HostItem(name, f"scorer: weights ({nbytes} B/param)", _gib(weights)),
                      HostItem(name, "scoring work", _gib(_scoring_work(t, nbytes, run.teacher_tokens, run.teacher_head_chunk)),
                           (*beside, HostPhase.SCORE)),
                      HostItem(name, f"hidden rows of {tokens} tokens for the loss", _gib(4 * tokens * t.hidden), (*beside, *train))]  # fmt: skip
        shared = run.teacher_shares and run.teacher_scores  # the engines' weights are the scorer's
        if shared and run.teacher_plays:
            items.append(HostItem(name, "play engine: KV pool (the scorer's weights)", _gib(player - weights)))
        elif run.teacher_plays == "before" and run.teacher_scores:  # never beside the scorer: what it holds beyond it
            items.append(HostItem(name, "play engine, SFT steps: beyond the scorer", _gib(max(0.0, player - weights))))
        elif run.teacher_plays:
            items.append(HostItem(name, "play engine: weights + KV pool", _gib(player)))
        if run.teacher_eval:  # closed after that eval
            items.append(HostItem(name, "its eval engine: KV pool (the scorer's weights)" if shared else
                                  "its eval engine: weights + KV pool", _gib(engine - weights if shared else engine), (HostPhase.EVAL,)))
    if run.selftest:  # dropped after the pre-flight; the teachers' scoring buffers are free while it scores
        teachers_work = max((_scoring_work(t, n, run.teacher_tokens, run.teacher_head_chunk) for t, n in teachers), default=0)
        extra = max(0, _scoring_work(s, student_bytes) - teachers_work)  # the self-test's scorer: the default sizes
        items.append(HostItem("selftest", f"student scorer, pre-flight: weights + work ({student_bytes} B/param)",
                              _gib(student_bytes * p + extra), (HostPhase.SCORE,)))  # fmt: skip
    return HostPlan(available_gib, items, tokens, activation_checkpointing=run.activation_checkpointing,
                    teacher_tokens=run.teacher_tokens, teacher_head_chunk=run.teacher_head_chunk)


def _pool(run: HostRun, m: ModelShape, nbytes: int, in_flight: int | None = None) -> float:
    """An engine's KV pool over what `in_flight` episodes fill (HostRun.kv_tokens) and its sampling logits."""
    return run.kv_tokens(in_flight) * 2 * m.layers * m.kv * nbytes + 8 * run.engine_max_batch * m.vocab


def _scoring_work(t: ModelShape, nbytes: int, tokens: int = TEACHER_TOKENS, head_chunk: int = TEACHER_HEAD_CHUNK) -> float:
    """What an HFTeacher of shape `t` allocates while it scores (agentopd.teacher.hf): one layer's inference work over
    `tokens` tokens (max_tokens_per_batch) and their hidden rows, three fp32 `head_chunk` x V head chunks."""
    return tokens * (4 * t.hidden + 2 * t.q + 2 * t.kv + 3 * t.intermediate + t.hidden) * nbytes + 12 * head_chunk * t.vocab


def stored_bytes(ref: Path | str) -> int:
    """Bytes a parameter of `ref` takes where an engine or teacher holds it on a CPU (RunContext.inference_dtype: bf16
    as stored, else fp32)."""
    return 2 if stored_in_bf16(ref) else 4


def host_run(cfg: Config) -> HostRun:
    """What of `cfg` the host plan reads."""
    from agentopd.backends.teacher_weights import shares_teacher_weights
    from agentopd.objectives import loads_scorer, runs_selftest, teacher_evals, teacher_plays

    return HostRun(micro_batch_tokens=cfg.trainer.micro_batch_tokens, chunk_size=cfg.trainer.chunk_size,
                   activation_checkpointing=cfg.trainer.activation_checkpointing, engine_max_batch=cfg.engine.max_batch_size,
                   teacher_eval=teacher_evals(cfg),
                   in_flight=max(cfg.rollout.tasks_per_step * cfg.rollout.n, cfg.eval.num_tasks), context=cfg.rollout.max_context,
                   train_in_flight=cfg.rollout.tasks_per_step * cfg.rollout.n,
                   selftest=runs_selftest(cfg), teacher_scores=loads_scorer(cfg),
                   teacher_plays=teacher_plays(cfg), teacher_shares=shares_teacher_weights(cfg, "cpu"),
                   teacher_overlap=cfg.teacher.overlap)  # fmt: skip


def host_plan(cfg: Config, student_ref: Path | str, teacher_refs: dict[str, Path | str],
              available_gib: float | None = None) -> HostPlan:  # fmt: skip
    """A CPU run's plan from its config and its models' config.json (teachers behind a server hold nothing here), against
    `run.host_memory_gib` where set, else what this machine has available now."""
    from agentopd.teacher.base import is_server

    teachers = [(ModelShape.from_ref(ref), stored_bytes(ref)) for ref in teacher_refs.values() if not is_server(ref)]
    if available_gib is None:
        available_gib = cfg.run.host_memory_gib or available_host_gib()
    return plan_host(host_run(cfg), ModelShape.from_ref(student_ref), stored_bytes(student_ref), teachers, available_gib)
