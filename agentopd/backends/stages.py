"""The stage code every backend runs: play planned episodes, score them with routed teachers.

    ctx = RunContext(cfg, mixture, student_ref, teacher_refs, trainer_cfg, rollout_cfg, device, dtype)
    players = Players(ctx, tokenizer)                   # engines by role, env instances by source
    episodes = players.play(planned, config, on_episode, who="student")
    scores = score_routed(teachers, by_teacher, mode)   # {teacher: [TeacherScores, ...]} (inside a backend)
    scores = score_episodes(backend, teacher_of, streams, mode)   # grouped by teacher, scattered back (runner)

The local backend calls these in its own process; the Ray backend calls the same functions
inside its rollout and teacher actors. `who` is `student` or a teacher name (a teacher plays
episodes for `objective=sft` and for the teacher's eval). Every engine of a Players object runs
on one event loop that lives as long as the Players (engines bind to the loop they first run on:
vLLM's AsyncLLM cannot be driven from a second `asyncio.run`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentopd.aio import gather_or_cancel
from agentopd.backends.base import BackendKind
from agentopd.engines.base import Engine, logprob_temperature
from agentopd.engines.loop import LoopEngine
from agentopd.plan import Mixture, Planned
from agentopd.rollout import EnvPool, Guide, Rollout, RolloutConfig
from agentopd.types import Episode, TokenStream
from agentopd.weights_dtype import cast_weights

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentopd.backends.base import Backend
    from agentopd.config import Config
    from agentopd.teacher import HFTeacher, ServerTeacher, TeacherMode, TeacherScores
    from agentopd.trainer.config import TrainerConfig

STUDENT = "student"
OnEpisode = Callable[[Planned, Episode], None]


@dataclass
class RunContext:
    """What the stages need to build their parts (picklable: it travels to Ray actors)."""

    cfg: Config
    mixture: Mixture
    student_ref: Path | str
    teacher_refs: dict[str, Path | str]  # teacher name -> from_pretrained reference
    trainer_cfg: TrainerConfig
    rollout_cfg: RolloutConfig
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    env_vars: dict[str, str] = field(default_factory=dict)  # set in every actor before it builds anything (AGENTOPD_HOME)
    vocab_size: int | None = None  # len(tokenizer): engines sample, teachers and the trainer normalise over these ids
    kv_cache_gib: float | None = None  # the fast engine's KV pool on a GPU (agentopd.memory_plan); None = its default
    teacher_eval_kv_gib: float | None = None  # a teacher's eval engine's smaller pool, where the plan sized one
    engine_max_batch: int | None = None  # engine.max_batch_size where the host plan lowered it (agentopd.memory_host)
    engine_sleep: bool = False  # local backend: the student's engine frees its KV pool while the teacher and trainer run
    teacher_offload: bool = True  # a local teacher leaves its GPU after each scoring (agentopd.memory_plan decides)
    # teachers of another tokenizer that play SFT episodes (run_parts.own_tokenizer_teachers): with their own tokenizer,
    # each episode then re-rendered for the student (agentopd.crosstok.retokenize)
    own_tokenizer: frozenset[str] = frozenset()
    teacher_tokens: int | None = None  # a local teacher's scoring passes (HFTeacher max_tokens_per_batch, head_chunk):
    teacher_head_chunk: int | None = None  # a CPU run's host plan lowers them to fit (None: the teacher's defaults)

    def inference_dtype(self, ref: Path | str) -> torch.dtype:
        """The dtype an engine or a teacher holds `ref` in: the run's (bf16 on a GPU). On a CPU, a checkpoint stored in
        bf16 (real ones, an imported GGUF) stays bf16 — half the host memory of fp32, and the CPU's bf16 matmuls (AMX,
        AVX-512 BF16) are faster too; the embedded models, stored in fp32, stay fp32. The trainer keeps fp32 weights."""
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return self.dtype
        from agentopd.shape import stored_in_bf16
        from agentopd.teacher.base import is_server

        return torch.bfloat16 if not is_server(ref) and stored_in_bf16(ref) else self.dtype

    def model_ref(self, who: str) -> Path | str:
        """The model a role plays with: the student's, or the named teacher's."""
        from agentopd.teacher.base import is_server

        if who == STUDENT:
            return self.student_ref
        if who not in self.teacher_refs:
            raise ValueError(f"no teacher named {who!r} (teachers: {sorted(self.teacher_refs)})")
        if is_server(self.teacher_refs[who]):
            raise ValueError(f"teacher {who!r} is a server ({self.teacher_refs[who]}): it scores tokens but cannot play episodes")
        return self.teacher_refs[who]


def vllm_options(cfg: Config) -> dict[str, Any]:
    """VLLMEngine keywords from a run's `engine.vllm` keys, with the defaults agentopd.config.VLLMOptions documents."""
    options = cfg.engine.vllm
    share = options.gpu_memory_utilization
    if share is None:
        # beside the trainer (and the teacher) on one GPU: half of it; a Ray rollout worker: its GPU share
        on_own = cfg.run.backend != BackendKind.LOCAL and cfg.ray.gpus_per_rollout_worker > 0
        share = 0.9 * min(1.0, cfg.ray.gpus_per_rollout_worker) if on_own else 0.5
    return {"kv_cache_gib": options.kv_cache_gib, "compile": options.compile, "worker_process": options.worker_process,
            "gpu_memory_utilization": share}


def kv_dtype_option(cfg: Config) -> dict[str, Any]:
    """`engine.kv_cache_dtype` as the fast and vLLM engines take it (nothing when "auto": each engine's own default)."""
    return {} if cfg.engine.kv_cache_dtype == "auto" else {"kv_cache_dtype": cfg.engine.kv_cache_dtype}


def build_engine(ctx: RunContext, model: torch.nn.Module | Path | str, vocab_size: int | None = -1,
                 share: bool = False, kv_cache_gib: float | None = None) -> Engine:  # fmt: skip
    """The rollout engine (`engine.kind`) over a model: a reference (folder, hub id) or, for the
    transformers engine, a module (copied, so a trainer holding it is never written to). Every engine
    takes the same options under our names (device, dtype, max_batch_size, seed) and maps them to its own.
    It samples the run's tokenizer ids (`vocab_size` -1), or another tokenizer's (a teacher that plays with its own).
    With `share`, a loaded module (a teacher's, agentopd.backends.teacher_weights) is served on its own weights: the
    fast engine takes them over, the transformers engine runs the module itself; nothing is copied. `kv_cache_gib`:
    the fast engine's pool where not the run's (a teacher's eval engine the memory plan sized smaller)."""
    from agentopd.engines import EngineKind, make_engine, resolve_kind

    kind = resolve_kind(ctx.cfg.engine.kind, ctx.device)
    kv_cache_gib = kv_cache_gib if kv_cache_gib is not None else ctx.kv_cache_gib
    kwargs: dict[str, Any] = {"max_batch_size": ctx.engine_max_batch or ctx.cfg.engine.max_batch_size, "seed": ctx.cfg.run.seed,
                              "vocab_size": ctx.vocab_size if vocab_size == -1 else vocab_size}
    if share:
        if not isinstance(model, torch.nn.Module) or kind not in (EngineKind.FAST, EngineKind.HF):
            raise ValueError(f"sharing weights needs a loaded module and engine.kind fast or hf, not {kind}")
        dtype = next(model.parameters()).dtype
        extra = {"share_weights": True, "kv_cache_gb": kv_cache_gib, **kv_dtype_option(ctx.cfg)} if kind == EngineKind.FAST else {}
        return make_engine(kind, model, device=ctx.device, dtype=dtype, **kwargs,
                           **{k: v for k, v in extra.items() if v is not None})  # fmt: skip
    dtype = ctx.inference_dtype(ctx.student_ref if isinstance(model, torch.nn.Module) else model)
    if kind == EngineKind.HF:
        kwargs["device"] = ctx.device
        if not isinstance(model, torch.nn.Module):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        else:
            import copy

            model = cast_weights(copy.deepcopy(model), dtype)  # the weights only: the rotary inv_freq stays fp32
        return make_engine(kind, model, **kwargs)
    if isinstance(model, torch.nn.Module):
        raise TypeError(f"engine.kind={kind} loads its model from a reference (a folder or hub id), not a module")
    if kind == EngineKind.VLLM:

        kwargs.update(vllm_options(ctx.cfg), **kv_dtype_option(ctx.cfg))
    else:  # the fast engine (an unsupported architecture falls back to hf: no pool to size, no stream to choose)
        if kv_cache_gib is not None:
            kwargs["kv_cache_gb"] = kv_cache_gib
        kwargs.update(kv_dtype_option(ctx.cfg))
        if ctx.cfg.teacher.overlap and kind == EngineKind.FAST:  # the decode first, the teacher's scoring beside it
            kwargs["priority_stream"] = True
    return make_engine(kind, str(model), device=ctx.device, dtype=dtype, **kwargs)


class Players:
    """Plays planned episodes of every source with the student's (or a teacher's) engine."""

    def __init__(self, ctx: RunContext, tokenizer: PreTrainedTokenizerBase, student_engine: Engine | None = None,
                 module_of: Callable[[str], torch.nn.Module | None] | None = None):  # fmt: skip
        """`module_of(teacher)`: a loaded model the teacher's engine is to share (backends.teacher_weights), or None."""
        self.ctx = ctx
        self.tokenizer = tokenizer
        self.module_of = module_of
        self.engines: dict[str, Engine] = {}
        self.env_pools: dict[tuple[str, str], EnvPool] = {}  # (source, split): envs kept across phases (rollout.EnvPool)
        self._tokenizers: dict[str, PreTrainedTokenizerBase] = {}  # teachers that play with their own (tokenizer_of)
        self.loop = asyncio.Runner()  # the one event loop of every phase and engine (module docstring)
        if student_engine is not None:
            self.engines[STUDENT] = student_engine

    def engine(self, who: str) -> Engine:
        if who not in self.engines:
            own = len(self.tokenizer_of(who)) if who in self.ctx.own_tokenizer else -1
            module = self.module_of(who) if self.module_of is not None and who != STUDENT else None
            kv = self.ctx.teacher_eval_kv_gib if who != STUDENT else None  # set only for a teacher that only evals
            if module is not None:  # one copy of the teacher's weights for this engine and its scorer
                self.engines[who] = build_engine(self.ctx, module, vocab_size=own, share=True, kv_cache_gib=kv)
            else:
                self.engines[who] = build_engine(self.ctx, self.ctx.model_ref(who), vocab_size=own, kv_cache_gib=kv)
        return self.engines[who]

    def tokenizer_of(self, who: str) -> PreTrainedTokenizerBase:
        """The tokenizer `who` plays with: the run's (the student's), or a teacher's own (RunContext.own_tokenizer)."""
        if who not in self.ctx.own_tokenizer:
            return self.tokenizer
        if who not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[who] = AutoTokenizer.from_pretrained(self.ctx.model_ref(who))
        return self._tokenizers[who]

    async def play_async(
        self, planned: Sequence[Planned], config: RolloutConfig, on_episode: OnEpisode | None = None, who: str = STUDENT,
        guide: Guide | None = None,
    ) -> list[Episode]:
        """Every planned episode, all sources at once on one engine (it batches across them); in plan order.
        `guide` may replace turns as they are sampled (agentopd.rollout.Guide; recipe.intervene_below)."""
        engine = self.engine(who)
        groups: dict[tuple[str, str], list[int]] = {}
        for i, p in enumerate(planned):
            groups.setdefault((p.source, p.spec.split), []).append(i)
        out: list[Episode | None] = [None] * len(planned)
        rollouts = []

        async def run(source: str, split: str, idx: list[int]) -> None:
            if (source, split) not in self.env_pools:
                self.env_pools[source, split] = EnvPool(self.ctx.mixture.sources[source].factory(split))
            ro = Rollout(self.env_pools[source, split], engine, self.tokenizer_of(who), config, guide=guide)
            rollouts.append(ro)
            by_id = {planned[i].spec.episode_id: i for i in idx}

            def done(spec, ep):
                if who in self.ctx.own_tokenizer:  # the student trains on it, the store shows it: in the run's tokenizer
                    from agentopd.crosstok.retokenize import as_student_episode

                    ep = as_student_episode(ep, self.tokenizer_of(who), self.tokenizer)
                out[by_id[spec.episode_id]] = ep
                if on_episode is not None:
                    on_episode(planned[by_id[spec.episode_id]], ep)

            await ro.run([planned[i].spec for i in idx], done)

        try:
            await gather_or_cancel([run(s, split, idx) for (s, split), idx in groups.items()])  # one source failing ends the others first
        finally:
            for ro in rollouts:
                ro.close()
        assert all(e is not None for e in out)
        return out  # type: ignore[return-value]

    def play(
        self, planned: Sequence[Planned], config: RolloutConfig, on_episode: OnEpisode | None = None, who: str = STUDENT,
        guide: Guide | None = None,
    ) -> list[Episode]:
        return self.loop.run(self.play_async(planned, config, on_episode, who, guide))

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.loop.run(self.engine(STUDENT).update_weights(state_dict))

    def drop(self, who: str) -> None:
        """Close the engine of `who` (a teacher whose evals are done); it is built again if it plays again."""
        if who in self.engines:
            self.loop.run(self.engines.pop(who).close())

    def sleep(self) -> None:
        """The student's engine frees its device memory besides the weights until `wake()` (engines/loop.py)."""
        self.loop.run(self._sleeper().sleep())

    def wake(self) -> None:
        self.loop.run(self._sleeper().wake())

    def _sleeper(self) -> LoopEngine:
        engine = self.engine(STUDENT)
        if not isinstance(engine, LoopEngine):
            raise ValueError(f"engine.sleep / ray.engine_sleep needs the fast or hf engine (engine.kind), not {type(engine).__name__}")
        return engine

    def close(self) -> None:
        async def close_all() -> None:
            for e in self.engines.values():
                await e.close()

        try:
            self.loop.run(close_all())
        finally:
            self.engines.clear()
            self.loop.close()
            for pool in self.env_pools.values():
                pool.close()
            self.env_pools.clear()


def build_teacher(ctx: RunContext, name: str, model: torch.nn.Module | None = None) -> HFTeacher | ServerTeacher:
    """The named teacher: a model loaded here (HFTeacher; on `model` where given, the one its engine shares:
    backends.teacher_weights), or a vLLM server's prompt logprobs (ServerTeacher) when its reference is an http(s)
    URL (Config checks what such a run can use)."""
    from agentopd.teacher import HFTeacher, ServerTeacher
    from agentopd.teacher.base import is_server

    # the teacher's sampled-token logprobs (kl/* metrics, sampled losses) sit beside the sampler's: same temperature;
    # the hidden states the full-vocabulary losses use carry none (the loss applies trainer.temperature)
    temperature = logprob_temperature(ctx.rollout_cfg.temperature)  # teacher.temperature may only agree (policy.check_run)
    ref = ctx.teacher_refs[name]
    if is_server(ref):
        return ServerTeacher(str(ref), top_k=ctx.cfg.teacher.top_k, temperature=temperature, reconnect_s=ctx.cfg.teacher.reconnect_s)
    # a cross-tokenizer teacher scores its own stream (agentopd.crosstok) over its own vocabulary
    vocab_size = None if ctx.trainer_cfg.loss.is_cross_tokenizer else ctx.vocab_size
    sizes = {k: v for k, v in (("max_tokens_per_batch", ctx.teacher_tokens), ("head_chunk", ctx.teacher_head_chunk)) if v}
    linear_dtype = ctx.cfg.teacher.linear_dtype
    if linear_dtype == "fp8":
        check_fp8_device(ctx.device)
    return HFTeacher(ref if model is None else model, device=ctx.device, dtype=ctx.inference_dtype(ref), temperature=temperature, top_k=ctx.cfg.teacher.top_k,
                     vocab_size=vocab_size, offload_after_score=ctx.teacher_offload, compile=ctx.cfg.teacher.compile,
                     linear_dtype=linear_dtype, **sizes)


def check_fp8_device(device: Any) -> None:
    """teacher.linear_dtype=fp8 runs on a GPU with fp8 tensor cores: refused elsewhere, in one line."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"teacher.linear_dtype=fp8 needs a CUDA GPU with fp8 tensor cores (H100/H200); this run's device "
                         f"is {device.type}, where it is slower than the run's dtype: set teacher.linear_dtype=auto")
    cc = torch.cuda.get_device_capability(device)
    if cc < (8, 9):
        raise ValueError(f"teacher.linear_dtype=fp8 needs compute capability >= 8.9 (H100/H200, L40, RTX 4090); "
                         f"{torch.cuda.get_device_name(device)} has {cc[0]}.{cc[1]}: set teacher.linear_dtype=auto")


def engine_metrics(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """A rollout's share of the fast engine's worker timings (FastEngine.timings: their change between `before` and
    `after`), as `rollout/engine_*`: seconds scheduling, preparing inputs, in steps (queuing the model and sampler and
    waiting for the sampled tokens: the device's time, where the host keeps up) and in bookkeeping; steps, decode steps,
    preemptions (sequences recomputed because the KV pool ran out of pages), the mean rows of a decode step and the share
    of decode rows whose shared prompt was read once for their tile (shared_prefix.py). {} for an engine without
    timings (transformers, vLLM)."""
    if not after:
        return {}
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    out = {f"rollout/engine_{k}_s": float(d[k]) for k in ("schedule", "prepare", "step", "advance") if k in d}
    out |= {f"rollout/engine_{k}": float(d[k]) for k in ("steps", "decode_steps", "preemptions") if k in d}
    if d.get("decode_steps"):
        out["rollout/engine_rows_per_decode"] = d.get("decode_rows", 0) / d["decode_steps"]
    if d.get("decode_rows") and "shared_prompt_rows" in d:
        out["rollout/engine_shared_prompt_share"] = d["shared_prompt_rows"] / d["decode_rows"]
    return out


class Scorers(Mapping):
    """The run's teachers as scorers by name, each loaded on first use: a run whose teachers only play (objective=sft)
    never loads one, and one that plays before it scores (recipe.sft_steps) loads it only then. `before_build(name)`
    runs first (the local backend closes that teacher's play engine there: the two copies never meet)."""

    def __init__(self, names: Sequence[str], build: Callable[[str], Any], before_build: Callable[[str], None] | None = None):
        self._names, self._build, self._before = list(names), build, before_build
        self._built: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._names:
            raise KeyError(name)
        if name not in self._built:
            if self._before is not None:
                self._before(name)
            self._built[name] = self._build(name)
        return self._built[name]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def built(self) -> dict[str, Any]:
        """The teachers loaded so far (what has events to report, what holds memory)."""
        return dict(self._built)


def score_routed(teachers: dict[str, HFTeacher], by_teacher: dict[str, list[TokenStream]], mode: TeacherMode) -> dict[str, list[TeacherScores]]:
    """Each teacher scores the streams routed to it (inside a backend)."""
    return {name: teachers[name].score(streams, mode=mode) for name, streams in by_teacher.items() if streams}


def score_episodes(backend: Backend, teacher_of: Sequence[str], streams: Sequence[TokenStream], mode: TeacherMode) -> list[TeacherScores]:
    """Scores of every stream, in order: grouped by the teacher each is routed to (`teacher_of[i]`),
    scored by the backend one group per teacher, scattered back."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(teacher_of):
        groups.setdefault(name, []).append(i)
    routed = backend.score({name: [streams[i] for i in idx] for name, idx in groups.items()}, mode)
    out: list[TeacherScores | None] = [None] * len(streams)
    for name, idx in groups.items():
        for i, sc in zip(idx, routed[name], strict=True):
            out[i] = sc
    return out  # type: ignore[return-value]
