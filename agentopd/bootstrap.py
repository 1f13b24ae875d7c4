"""The embedded default: a tokenizer, a teacher and a weaker student built locally, cached.

    models = bootstrap("sql_db")            # builds once under $AGENTOPD_HOME, then reuses
    models.teacher_dir, models.student_dir  # Hugging Face folders (model + tokenizer + chat template)
    models.report                           # how they were made and how well they do

Nothing is downloaded. Steps, each cached:
1. One tokenizer for every built-in env (`$AGENTOPD_HOME/tokenizer`): byte-level BPE trained
   on the envs' own oracle conversations (`agentopd.corpus`), so any built-in teacher can score
   any built-in student.
2. Demonstrations: the env's oracle solutions of training tasks, played through the real
   agent loop (ScriptedEngine), so they are token streams exactly like sampled ones.
3. Teacher: a small Qwen3-architecture model trained by SFT on the demonstrations until it
   solves held-out (eval-split) tasks, or its step budget runs out; its success is reported.
4. Student: a smaller Qwen3 model, briefly SFT-trained on the same demonstrations, so it has
   the format and solves some tasks but not most — the starting point distillation improves.
`bootstrap(env, force=True)` (CLI: `agentopd bootstrap --env NAME --force`) rebuilds.

Sizes (`embedded.size`, `bootstrap(env, size=...)`): `tiny`, the default above, built on the CPU; `gpu`, a ~25M
student and a ~150M teacher built by the same recipe on one GPU (`sized_spec`), cached under `models/gpu/<env>/`:

    models = bootstrap("sql_db", size=EmbeddedSize.GPU)   # on CUDA; agentopd bootstrap --env sql_db embedded.size=gpu
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM

from agentopd.batch import TrainSample
from agentopd.chat import build_tokenizer
from agentopd import attention
from agentopd.config import VARIANTS, EmbeddedSize, variant_of
from agentopd.corpus import env_corpus
from agentopd.engines.scripted import ScriptedEngine
from agentopd.evaluate import EvalResult, evaluate
from agentopd.paths import agentopd_home, atomic_dir
from agentopd.recovery import mask_turns, recovery_eval, with_mistake
from agentopd.splits import make_env_for_split, without_split
from agentopd.rollout import Rollout, RolloutConfig

BUILTIN_ENVS = ("sql_db", "calculator", "math")
RECIPE = 2  # bumped when the default recipe changes, so caches built by an older one are rebuilt
Progress = Callable[[str, float, dict[str, Any]], None]  # (phase, fraction done, info)


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int = 4
    kv_heads: int = 2
    intermediate_mult: int = 3
    head_dim: int | None = None  # None: hidden // heads

    def config(self, tokenizer: PreTrainedTokenizerBase, max_positions: int = 4096) -> Qwen3Config:
        return Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=self.hidden,
            intermediate_size=self.hidden * self.intermediate_mult,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim or self.hidden // self.heads,
            max_position_embeddings=max_positions,
            tie_word_embeddings=True,
            rope_theta=10000.0,
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )


@dataclass(frozen=True)
class SFTSpec:
    """How one model is trained on demonstrations."""

    size: ModelSize
    max_steps: int
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 20
    schedule: str = "cosine"  # or "constant": a student left mid-training, at a learning rate distillation can continue with
    target_success: float | None = None  # stop early once held-out success reaches it (teacher)
    eval_every: int = 50
    seed: int = 0
    # the format gate (the student): after max_steps, go on eval_every steps at a time, at most format_gate_steps more,
    # until malformed tool calls are under this share of its held-out turns (None: stop at max_steps, unchecked)
    format_gate: float | None = None
    format_gate_steps: int = 0


@dataclass(frozen=True)
class BootstrapSpec:
    teacher: SFTSpec = SFTSpec(ModelSize(hidden=128, layers=2), max_steps=400, lr=5e-3, target_success=0.8, eval_every=100)
    # narrower than the teacher, SFT stopped early at a constant lr (not annealed): it has the format and solves few
    # held-out tasks, and distillation can go on at the lr it was trained with. "Has the format" is checked, not
    # assumed (`format_gate`): a student still writing malformed calls in 10% of its turns after 150 steps trains on,
    # checked every 10 steps, up to 300 steps more. On stock_shelves (a plugin env, three dependent calls) the format
    # and the skill came within 10 steps of each other: step 200 parse errors 19% / success 0%, 210 8% / 1%, 220 13% /
    # 67%, 250 10% / 65%, 300 0% / 90% (benchmarks/results/default_recipe.md): checks 50 steps apart stopped at 300
    student: SFTSpec = SFTSpec(ModelSize(hidden=96, layers=2), max_steps=150, lr=3e-3, schedule="constant", seed=1,
                               eval_every=10, format_gate=0.1, format_gate_steps=300)  # fmt: skip
    tokenizer_vocab: int = 1000
    tokenizer_name: str = ""  # "": the shared tokenizer; else its own, cached apart (`tokenizer-<name>/`: builtin:cross)
    corpus_tasks_per_env: int = 1500
    demonstrations: int = 2000
    eval_tasks: int = 100
    max_context: int = 2048
    # share of the teacher's demonstrations given one recoverable mistake (agentopd.recovery), its turn masked out
    # of the SFT loss: the teacher learns to act in error states without learning to make errors. 0 = clean oracle.
    # The student always learns from the clean ones (a weak, early-stopped SFT model, as for every env)
    mistakes: float = 0.0


# calculator's student needs more SFT to solve any held-out task (0% at 200 steps, 3% at 225, 22% at 275:
# a sharp transition; benchmarks/results/default_run.md). Its teacher's success emerges late too: at 400 steps
# it landed anywhere from 6% to 75% with float rounding (threads); at 600 it is past the transition (75%)
ENV_SPECS: dict[str, BootstrapSpec] = {
    "calculator": BootstrapSpec(teacher=replace(BootstrapSpec.teacher, max_steps=600),
                                student=replace(BootstrapSpec.student, max_steps=225)),  # fmt: skip
    # the explore family (configs/sql_db_explore.yaml): a teacher that has seen its own mistakes answered, trained
    # longer, on every training task. On 2,000 demonstrations it memorised them (SFT loss 0.0014) and solved 41%
    # of held-out tasks at 1,500 steps (34% after an injected mistake). On all 3,183 training tasks (6,000 asked
    # for: demonstrations() takes at most every task) it reached 89% at 1,200 steps (81% after a mistake) and
    # stopped at its 80% target (benchmarks/results/quality.md)
    # Its student is the teacher's width (128), SFT'd on the clean demonstrations for 400 steps: 47% held-out, no
    # recovery learned. The 96-wide student of 150 steps (16%) had not learnt to copy a question's names into its
    # SQL (0 of 39 held-out tasks naming a person; at width 128 that comes between steps 250 and 400), and neither
    # SFT nor OPD taught it in 100 more steps: the comparison of issue 16 measured nothing (quality.md)
    "sql_db_explore": BootstrapSpec(
        teacher=replace(BootstrapSpec.teacher, max_steps=1500, eval_every=300), mistakes=0.5, demonstrations=6000,
        student=replace(BootstrapSpec.student, size=ModelSize(hidden=128, layers=2), max_steps=400)),  # fmt: skip
}
# bumped per preset when its ENV_SPECS entry changes, so a cache built by the older spec is rebuilt (RECIPE would
# rebuild every env's); where the new spec differs from the one in the cache's report in the student's SFT spec and
# nothing else, the cached teacher is kept and the student alone is retrained
SPEC_VERSIONS: dict[str, int] = {"sql_db_explore": 4, "calculator": 2}  # 2: a 1,500- / 600-step teacher; 3: every task; 4: the student


def default_spec(env_name: str) -> BootstrapSpec:
    return ENV_SPECS.get(env_name, BootstrapSpec())


# vLLM's CPU build serves head sizes 32, 64, 80, 96, 112, 128, ...; the embedded students' is 24 (hidden 96, 4 heads)
VLLM_HEAD_DIM = 32


def vllm_spec(spec: BootstrapSpec) -> BootstrapSpec:
    """`spec` with each model's head size raised to VLLM_HEAD_DIM where it is smaller (widths, heads and training
    unchanged): the embedded pair for vLLM (`student=builtin:vllm`)."""

    def served(sft_spec: SFTSpec) -> SFTSpec:
        size = sft_spec.size
        if (size.head_dim or size.hidden // size.heads) >= VLLM_HEAD_DIM:
            return sft_spec
        return replace(sft_spec, size=replace(size, head_dim=VLLM_HEAD_DIM))

    return replace(spec, teacher=served(spec.teacher), student=served(spec.student))


# the cross-tokenizer teacher (`teacher=builtin:cross`, issue 31): the default teacher's recipe over its own byte-level
# BPE, trained on the same corpus with a vocabulary this many times larger (other merges, other ids, longer tokens)
CROSS_VOCAB_FACTOR = 2


def cross_spec(spec: BootstrapSpec) -> BootstrapSpec:
    """`spec` with a tokenizer of CROSS_VOCAB_FACTOR x the vocabulary, cached apart: the teacher of `builtin:cross`."""
    return replace(spec, tokenizer_vocab=spec.tokenizer_vocab * CROSS_VOCAB_FACTOR, tokenizer_name="cross")


TINY_SPEC = BootstrapSpec(  # for tests: seconds, not minutes
    teacher=SFTSpec(ModelSize(hidden=32, layers=1, heads=2, kv_heads=1), max_steps=6, batch_size=8, eval_every=3),
    student=SFTSpec(ModelSize(hidden=32, layers=1, heads=2, kv_heads=1), max_steps=2, batch_size=8, seed=1),
    tokenizer_vocab=600,
    corpus_tasks_per_env=60,
    demonstrations=64,
    eval_tasks=8,
)

# embedded.size=gpu (issue 33): a pair one to two orders of magnitude larger than the tiny one, where the literature
# finds on-policy distillation ahead of SFT (a student with the capacity to keep on its own states what it learned, a
# teacher with more ability). Qwen3's shape at small scale: head size 64, 2 query heads per KV head, an MLP 3x the
# width. The tokenizer is the shared ~1k BPE (`tokenizer/`, as the tiny pair's): its embedding is ~1M parameters of
# either model, so the budget goes into the blocks; any built-in teacher scores any built-in student of either size
# (one vocabulary); a demonstration is the same token stream at both sizes; and nothing new is trained or cached.
# A larger BPE would shorten the sequences (~310 tokens per sql_db demonstration) by perhaps a third: not needed on a
# GPU, and it would put the two sizes on two vocabularies. Parameters (tied embeddings; tests/test_embedded_size.py):
GPU_TEACHER_SIZE = ModelSize(hidden=1024, layers=12, heads=16, kv_heads=8, head_dim=64)  # 152M
GPU_STUDENT_SIZE = ModelSize(hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64)  # 25.7M
# Their SFT, a first guess to be tuned on a GPU. The data: every training task's oracle demonstration (sql_db: 2,148
# of ~310 tokens, 0.67M tokens; demonstrations() takes at most one per task, so GPU_DEMONSTRATIONS means all of them).
# - teacher: 64 demonstrations a step (~20k tokens: ~34 steps an epoch). lr 5e-4: GPT-3's 125M / 350M models trained
#   at 6e-4 / 3e-4 on far larger batches, and a smaller batch wants no more. Warm-up 30 steps, cosine to lr/10 over at
#   most 600 steps (~18 epochs; the tiny teacher needed ~6 epochs at 128 wide: a wider model fits in fewer, and the
#   early stop ends it when it is good enough), stopped once 90% of the held-out tasks are solved (the tiny ones: 80%),
#   checked every 100 steps (each check plays eval_tasks held-out episodes).
# - student: 32 demonstrations a step, 100 steps (~1.5 epochs) at a constant lr 1e-3 (a 25M model takes about twice a
#   150M one's): like the tiny student, stopped early with the format learnt and few held-out tasks solved, at an lr
#   distillation can continue with (a run on this pair: trainer.lr=1e-3; the presets' 3e-3 is the tiny student's).
# On one H100 (bf16 autocast, fp32 master weights) a teacher step should take ~0.1 s: both models in ~2-4 minutes.
GPU_DEMONSTRATIONS = 10_000
GPU_TEACHER = SFTSpec(GPU_TEACHER_SIZE, max_steps=600, batch_size=64, lr=5e-4, warmup_steps=30, target_success=0.9, eval_every=100)
GPU_STUDENT = SFTSpec(GPU_STUDENT_SIZE, max_steps=100, batch_size=32, lr=1e-3, warmup_steps=20, schedule="constant", seed=1)


def sized_spec(spec: BootstrapSpec, size: EmbeddedSize) -> BootstrapSpec:
    """An env's recipe (`default_spec`) at `size`: `tiny` is the recipe itself; the others keep its data (tokenizer,
    mistakes, eval tasks, context) and swap both models and their SFT: `gpu` for GPU_TEACHER and GPU_STUDENT on every
    training task, `test` for TINY_SPEC's (seconds on a CPU)."""
    size = EmbeddedSize(size)
    if size == EmbeddedSize.TINY:
        return spec
    if size == EmbeddedSize.GPU:
        return replace(spec, teacher=GPU_TEACHER, student=GPU_STUDENT, demonstrations=max(spec.demonstrations, GPU_DEMONSTRATIONS))
    return replace(spec, teacher=TINY_SPEC.teacher, student=TINY_SPEC.student, demonstrations=TINY_SPEC.demonstrations,
                   eval_tasks=TINY_SPEC.eval_tasks)  # fmt: skip


def models_root(home: Path, size: EmbeddedSize) -> Path:
    """Where the built-in models of `size` are cached: `models/` for tiny (as ever), `models/<size>/` for the others
    (each with its own `<preset>/`, `vllm/<preset>/` and `cross/<preset>/` inside)."""
    return home / "models" if EmbeddedSize(size) == EmbeddedSize.TINY else home / "models" / str(size)


def build_device(size: EmbeddedSize, device: str | torch.device | None = None) -> torch.device:
    """Where the models of `size` are trained and evaluated: tiny ones on the CPU, always (whatever a run's device);
    the others on `device`, by default the GPU for `gpu` (a ValueError without one; `device="cpu"` builds there
    anyway: embedded.allow_cpu) and the CPU for `test`."""
    size = EmbeddedSize(size)
    if size == EmbeddedSize.TINY:
        return torch.device("cpu")
    if device is not None:
        return torch.device(device)
    if size == EmbeddedSize.GPU and not torch.cuda.is_available():
        raise ValueError("embedded.size=gpu: no CUDA device to build the gpu pair on; run on a GPU, use embedded.size=tiny "
                         "(the CPU default), or set embedded.allow_cpu=true to build it on the CPU anyway (hours)")  # fmt: skip
    return torch.device("cuda" if size == EmbeddedSize.GPU else "cpu")


@dataclass
class BuiltinModels:
    env: str
    teacher_dir: Path
    student_dir: Path
    report: dict[str, Any] = field(default_factory=dict)


def env_set(env_name: str | Sequence[str] = ()) -> tuple[str, ...]:
    """The envs a tokenizer covers: the built-ins, plus any other env named (a plugin's)."""
    names = [env_name] if isinstance(env_name, str) else list(env_name)
    extra = sorted({n for n in names if n not in BUILTIN_ENVS})
    return (*BUILTIN_ENVS, *extra)


def tokenizer_dir(envs: Sequence[str] = BUILTIN_ENVS, home: Path | None = None, name: str = "") -> Path:
    """Where the tokenizer of an env set is cached: `tokenizer/` for the built-ins alone (what every
    built-in model uses), `tokenizers/<env+env+...>/` for a set with other envs in it; a named one
    (`BootstrapSpec.tokenizer_name`) gets `-<name>` appended."""
    home = home or agentopd_home()
    suffix = f"-{name}" if name else ""
    if tuple(envs) == BUILTIN_ENVS:
        return home / f"tokenizer{suffix}"
    return home / "tokenizers" / ("+".join(envs) + suffix)


def ensure_tokenizer(spec: BootstrapSpec = BootstrapSpec(), force: bool = False, home: Path | None = None,
                     envs: Sequence[str] = BUILTIN_ENVS) -> PreTrainedTokenizerBase:  # fmt: skip
    """The shared tokenizer of an env set (`env_set`), trained on the envs' own oracle episodes (built once)."""
    path = tokenizer_dir(tuple(envs), home, spec.tokenizer_name)
    if force or not (path / "tokenizer.json").exists():
        texts = env_corpus(envs, spec.corpus_tasks_per_env)
        tok = build_tokenizer(texts, vocab_size=spec.tokenizer_vocab)
        atomic_dir(path, tok.save_pretrained)
    return AutoTokenizer.from_pretrained(path)


def env_version(env_name: str) -> str | None:
    """The version of the package an env comes from when it is not a built-in (a plugin's), else None."""
    if env_name in BUILTIN_ENVS:
        return None
    from importlib.metadata import PackageNotFoundError, version

    from agentopd.registry import ENV_GROUP, plugins

    plugin = plugins(ENV_GROUP).get(env_name)
    try:
        return version(plugin.package) if plugin is not None else None
    except (PackageNotFoundError, ValueError):
        return None


def require_oracle(env_name: str, env_kwargs: dict[str, Any]) -> None:
    """ValueError unless the env can solve its own tasks (`oracle`): the embedded default trains its
    teacher on those reference solutions."""
    env = make_env_for_split(env_name, "train", **env_kwargs)
    try:
        oracle = getattr(env.unwrapped, "oracle", None)
        tasks = getattr(env.unwrapped, "tasks", None) or []
        if oracle is None or not tasks:
            missing = "oracle(task) method" if oracle is None else "tasks"
        else:
            try:
                oracle(tasks[0])
                return
            except NotImplementedError:
                missing = "oracle (its oracle(task) raises NotImplementedError, as ToolEnv's does)"
    finally:
        env.close()
    raise ValueError(
        f"env {env_name!r} has no {missing}: the embedded default trains its teacher on the env's reference solutions "
        f"(ToolEnv.oracle(task) -> the assistant actions that solve it). Implement it, or pass your own models: "
        f"agentopd run --env {env_name} student=PATH teacher=PATH (Hugging Face folders or hub ids)"
    )


def preset_env_kwargs(env_name: str) -> dict[str, Any]:
    """The env kwargs of the shipped preset (configs/<env>.yaml), which the default run uses too."""
    from agentopd.config import load_config

    return without_split(load_config(env_name).env.kwargs)


def demonstrations(
    env_name: str, tokenizer: PreTrainedTokenizerBase, num: int, max_context: int, seed: int = 0, env_kwargs: dict[str, Any] | None = None,
    mistakes: float = 0.0,
) -> list[TrainSample]:
    """Oracle solutions of `num` training tasks as token streams (mask 1 on the assistant turns); with
    `mistakes` > 0, that share of them first makes one recoverable mistake (agentopd.recovery), its turn
    masked 0."""
    env_kwargs = without_split(env_kwargs)
    env = make_env_for_split(env_name, "train", **env_kwargs)
    rng = random.Random(seed)
    task_ids = [t.id for t in env.tasks]
    rng.shuffle(task_ids)
    task_ids = task_ids[:num]
    engine = ScriptedEngine(tokenizer)
    specs = Rollout.specs_for(task_ids, n=1, split="demo")
    mistake_rng = random.Random(seed + 1)  # its own generator: the tasks drawn do not depend on `mistakes`
    masked: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        task = env.tasks[env.task_index(options={"task_id": spec.task_id})]
        actions = env.oracle(task)
        if mistakes > 0 and mistake_rng.random() < mistakes:
            demo = with_mistake(env, task, actions, mistake_rng)
            if demo is not None:
                actions, masked[spec.episode_id] = demo.actions, demo.mistake_turns
        engine.script(spec.episode_id, actions)
    env.close()
    rollout = Rollout(lambda: make_env_for_split(env_name, "train", **env_kwargs), engine, tokenizer, RolloutConfig(max_context=max_context, max_new_tokens=max_context))
    episodes = rollout.run_sync(specs)
    rollout.close()
    bad = [e for e in episodes if not e.success]
    if bad:
        raise RuntimeError(f"{len(bad)} oracle demonstrations of {env_name} failed (first: task {bad[0].task_id}, {bad[0].stop_reason})")
    return [mask_turns(TrainSample.from_stream(e.tokens), masked.get(s.episode_id, ())) for s, e in zip(specs, episodes, strict=True)]


def sft(
    model: Qwen3ForCausalLM,
    samples: list[TrainSample],
    spec: SFTSpec,
    *,
    evaluate_fn: Callable[[Qwen3ForCausalLM], float] | None = None,
    format_check: Callable[[Qwen3ForCausalLM], EvalResult] | None = None,
    progress: Progress | None = None,
    name: str = "sft",
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Supervised fine-tuning on demonstrations with the project's trainer (loss=sft), on `device`: on CUDA the
    trainer's bf16 autocast over fp32 master weights, and `model` is left there. `evaluate_fn` (and whoever uses the
    model afterwards) sees it with the attention it was built with (the trainer's steps on CUDA use varlen attention,
    which generation does not take).

    `format_check` (with `spec.format_gate`): the held-out eval after max_steps; while its parse errors per turn are at
    or above the gate, `spec.eval_every` more steps, at most `spec.format_gate_steps` in all, each check kept in the
    result's "format_gate" (the last one's success is the result's)."""
    from agentopd.trainer import Trainer, TrainerConfig

    cfg = TrainerConfig(
        loss="sft", lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1, warmup_steps=spec.warmup_steps,
        total_steps=spec.max_steps, schedule=spec.schedule, min_lr_ratio=0.1, grad_clip=1.0, seed=spec.seed,
        micro_batch_tokens=16384,
    )  # fmt: skip
    trainer = Trainer(model, cfg, device=device)
    built_with = trainer.model_config()._attn_implementation  # what evaluate_fn and save_pretrained see

    def as_built() -> AbstractContextManager:
        """The model with the attention it was built with (varlen, the trainer's on CUDA, is for packed rows only)."""
        return attention.using(trainer.hf, built_with) if trainer.varlen else nullcontext()

    rng = random.Random(spec.seed)
    history: list[dict[str, float]] = []
    t0 = time.perf_counter()
    success = None

    def train_step(step: int) -> dict[str, float]:
        metrics = trainer.train_step(rng.sample(samples, min(spec.batch_size, len(samples))))
        if progress and step <= spec.max_steps:
            progress(name, step / spec.max_steps, {"step": step, "loss": metrics["loss"]})
        elif progress:  # past max_steps: the format gate's steps, a phase of their own
            progress(f"{name} (format)", (step - spec.max_steps) / spec.format_gate_steps, {"step": step, "loss": metrics["loss"]})
        return metrics

    for step in range(1, spec.max_steps + 1):
        metrics = train_step(step)
        if evaluate_fn is not None and (step % spec.eval_every == 0 or step == spec.max_steps):
            with as_built():
                success = evaluate_fn(trainer.hf)
            history.append({"step": step, "loss": metrics["loss"], "success": success, "seconds": time.perf_counter() - t0})
            if spec.target_success is not None and success >= spec.target_success:
                break
    out: dict[str, Any] = {}
    if format_check is not None and spec.format_gate is not None:
        checks = []
        while True:
            with as_built():
                r = format_check(trainer.hf)
            checks.append({"step": step, "parse_error_rate": r.parse_error_rate, "tool_error_rate": r.tool_error_rate,
                           "success": r.success_rate, "seconds": round(time.perf_counter() - t0, 1)})  # fmt: skip
            if r.parse_error_rate < spec.format_gate or step >= spec.max_steps + spec.format_gate_steps:
                break
            for _ in range(min(spec.eval_every, spec.max_steps + spec.format_gate_steps - step)):
                step += 1
                metrics = train_step(step)
        success = r.success_rate
        out["format_gate"] = {"max_parse_error_rate": spec.format_gate, "passed": r.parse_error_rate < spec.format_gate,
                              "checks": checks}  # fmt: skip
    if trainer.varlen:
        attention.set_implementation(trainer.hf, built_with)
    return {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "final_loss": metrics["loss"], "history": history,
            "success": success, **out}  # fmt: skip


def bootstrap(
    env_name: str,
    *,
    force: bool = False,
    spec: BootstrapSpec | None = None,
    home: Path | None = None,
    progress: Progress | None = None,
    env_kwargs: dict[str, Any] | None = None,
    for_vllm: bool = False,
    cross: bool = False,
    size: EmbeddedSize = EmbeddedSize.TINY,
    device: str | torch.device | None = None,
) -> BuiltinModels:
    """The embedded teacher and student of an env (built on first use, then cached under
    `$AGENTOPD_HOME/models/<env>/`, keyed by the recipe, the env's constructor arguments of its preset
    and, for an env of another package (a plugin), that package's version); `spec` defaults to the
    env's own recipe (`default_spec`). Any env with an oracle has them: a plugin's models use the
    tokenizer of the built-ins plus that env (`env_set`).

    A built-in env's models are trained on its preset's tasks, whatever a run's `env.*` says (a run on
    your own task file still starts from them), unless the run's env kwargs select a variant preset
    (VARIANTS: `env.difficulty=[explore]`, or `env_name="sql_db_explore"`, gets the models of
    configs/sql_db_explore.yaml, under `models/sql_db_explore/`); another env's on the constructor arguments given
    (`env_kwargs`, its defaults when None), so a plugin's run gets models for the tasks it plays.

    `for_vllm`: the pair of `vllm_spec(spec)` (a head size vLLM's CPU build serves), cached apart under
    `models/vllm/<preset>/`; where only the student changes, the default pair's teacher is built (or found) and
    copied, and the student alone is trained. Where no model changes, the default pair itself.

    `cross`: the default student with a teacher of `cross_spec(spec)` (its own, larger BPE over the same corpus:
    another tokenizer, for the cross-tokenizer losses), cached under `models/cross/<preset>/teacher`.

    `size` (embedded.size): the pair of `sized_spec(default_spec(preset), size)`, built on `build_device(size,
    device)` and cached under `models_root(home, size)` (`models/` for tiny, `models/<size>/` else; the vLLM and cross
    variants inside it); a `spec` given is built as is, cached there too. A cache of another size than tiny is kept
    while its report's spec is the one wanted (no SPEC_VERSIONS: those number the tiny recipes)."""
    size = EmbeddedSize(size)
    if cross:
        base = bootstrap(env_name, force=force, spec=spec, home=home, progress=progress, env_kwargs=env_kwargs, size=size, device=device)
        return _cross_teacher(base, env_name, spec, home or agentopd_home(), progress, env_kwargs, force, size, device)
    requested, requested_kwargs = env_name, env_kwargs
    if env_name in VARIANTS:  # `agentopd bootstrap --env sql_db_explore`: the variant preset's models
        env_name, preset = VARIANTS[env_name][0], env_name
    else:
        preset = variant_of(env_name, env_kwargs) if env_name in BUILTIN_ENVS else env_name
    spec = spec or sized_spec(default_spec(preset), size)
    home = home or agentopd_home()
    root = models_root(home, size) / preset
    base_spec = spec
    if for_vllm and vllm_spec(spec) != spec:
        spec, root = vllm_spec(spec), models_root(home, size) / "vllm" / preset
    teacher_dir, student_dir, report_path = root / "teacher", root / "student", root / "report.json"
    if env_name in BUILTIN_ENVS or env_kwargs is None:
        env_kwargs = preset_env_kwargs(preset)
    env_kwargs = without_split(env_kwargs)
    version = env_version(env_name)
    keep_teacher = None
    if not force and report_path.exists() and (teacher_dir / "config.json").exists() and (student_dir / "config.json").exists():
        report = json.loads(report_path.read_text())
        same_env = report.get("env_kwargs", {}) == json.loads(json.dumps(env_kwargs))
        built, wanted = _with_new_fields(report.get("spec")), json.loads(json.dumps(asdict(spec)))
        same_spec = report.get("spec_version", 1) == SPEC_VERSIONS.get(preset, 1) if size == EmbeddedSize.TINY else built == wanted
        if same_env and report.get("recipe") == RECIPE and report.get("env_version") == version:
            if same_spec:
                return BuiltinModels(env_name, teacher_dir, student_dir, report)
            if built is not None and built["student"] != wanted["student"] and {**built, "student": None} == {**wanted, "student": None}:
                keep_teacher = report  # the new spec changes the student's SFT spec only: the teacher (minutes of SFT) stays
        # the preset's env, the env's package, the preset's spec or the recipe changed since these were built: rebuild
    if env_name not in BUILTIN_ENVS:
        require_oracle(env_name, env_kwargs)
    if spec is not base_spec and keep_teacher is None and spec.teacher == base_spec.teacher:  # for vLLM: the same teacher
        base = bootstrap(requested, force=force, spec=base_spec, home=home, progress=progress, env_kwargs=requested_kwargs,
                         size=size, device=device)  # fmt: skip
        atomic_dir(teacher_dir, lambda path: shutil.copytree(base.teacher_dir, path, dirs_exist_ok=True))
        keep_teacher = base.report

    torch.manual_seed(0)
    # torch's own thread count: on the 2-core machine two threads train these models 1.75x faster than one
    return _build(env_name, env_kwargs, spec, home, root, progress, spec_version=SPEC_VERSIONS.get(preset, 1),
                  keep_teacher=keep_teacher, size=size, device=build_device(size, device))  # fmt: skip


def _with_new_fields(built: dict[str, Any] | None) -> dict[str, Any] | None:
    """A cached report's spec with the SFTSpec fields added since it was built, at their defaults (format_gate: None):
    a field added to the spec rebuilds no cache whose models it would not have changed."""
    if built is None:
        return None
    defaults = {f.name: f.default for f in fields(SFTSpec) if f.default is not MISSING}
    return {**built, **{role: {**defaults, **built[role]} for role in ("teacher", "student") if isinstance(built.get(role), dict)}}


def _cross_teacher(base: BuiltinModels, env_name: str, spec: BootstrapSpec | None, home: Path, progress: Progress | None,
                   env_kwargs: dict[str, Any] | None, force: bool, size: EmbeddedSize = EmbeddedSize.TINY,
                   device: str | torch.device | None = None) -> BuiltinModels:  # fmt: skip
    """The teacher of `bootstrap(..., cross=True)` beside `base`'s student (built once, cached like the pair)."""
    preset = variant_of(env_name, env_kwargs) if env_name in BUILTIN_ENVS else env_name
    spec = cross_spec(spec or sized_spec(default_spec(preset), size))
    root = models_root(home, size) / "cross" / preset
    kwargs = without_split(base.report.get("env_kwargs", env_kwargs or {}))
    report_path = root / "report.json"
    if not force and report_path.exists() and (root / "teacher" / "config.json").exists():
        report = json.loads(report_path.read_text())
        if report.get("spec") == json.loads(json.dumps(asdict(spec))) and report.get("env_kwargs") == json.loads(json.dumps(kwargs)) \
                and report.get("recipe") == RECIPE and report.get("env_version") == env_version(base.env):  # fmt: skip
            return BuiltinModels(base.env, root / "teacher", base.student_dir, report)
    torch.manual_seed(0)
    built = _build(base.env, kwargs, spec, home, root, progress, roles=("teacher",), size=size, device=build_device(size, device))
    return BuiltinModels(base.env, built.teacher_dir, base.student_dir, built.report)


def _build(env_name: str, env_kwargs: dict[str, Any], spec: BootstrapSpec, home: Path, root: Path, progress: Progress | None,
           spec_version: int = 1, keep_teacher: dict[str, Any] | None = None,
           roles: tuple[str, ...] = ("teacher", "student"), size: EmbeddedSize = EmbeddedSize.TINY,
           device: torch.device = torch.device("cpu")) -> BuiltinModels:  # fmt: skip
    """Build the tokenizer (if missing), the demonstrations, the teacher and the student (those of `roles`), the models
    trained and evaluated on `device` (initialised on the CPU, so a seed gives the same start on any device);
    `keep_teacher`: the report of a cache whose teacher is kept (its spec differs in the student's SFT spec only), so
    only the student is trained."""
    teacher_dir, student_dir, report_path = root / "teacher", root / "student", root / "report.json"
    t0 = time.perf_counter()
    tok = ensure_tokenizer(spec, home=home, envs=env_set(env_name))
    if progress:
        progress("demonstrations", 0.0, {})
    demos = demonstrations(env_name, tok, spec.demonstrations, spec.max_context, env_kwargs=env_kwargs)
    # the teacher's: the same tasks, a share of them with a recoverable mistake (the student learns from clean ones, as ever)
    teacher_demos = demos if spec.mistakes == 0 or keep_teacher else demonstrations(
        env_name, tok, spec.demonstrations, spec.max_context, env_kwargs=env_kwargs, mistakes=spec.mistakes)  # fmt: skip

    def eval_of(model: Qwen3ForCausalLM) -> EvalResult:
        model.eval()
        r = evaluate(model, tok, env_name, env_kwargs=env_kwargs, split="eval", num_tasks=spec.eval_tasks,
                     rollout=RolloutConfig(temperature=0.0, max_context=spec.max_context))  # fmt: skip
        model.train()
        return r

    def success_of(model: Qwen3ForCausalLM) -> float:
        return eval_of(model).success_rate

    report: dict[str, Any] = {"env": env_name, "recipe": RECIPE, "spec_version": spec_version, "env_kwargs": env_kwargs, "env_version": env_version(env_name),
                              "tokenizer_size": len(tok), "demonstrations": len(demos), "spec": asdict(spec),
                              "size": str(size), "device": device.type}  # fmt: skip
    if keep_teacher:
        report |= {k: keep_teacher[k] for k in ("teacher", "demonstrations_with_mistake") if k in keep_teacher}
    elif spec.mistakes > 0:  # how many of the teacher's demonstrations make (and recover from) a mistake
        report["demonstrations_with_mistake"] = sum(a.token_ids != b.token_ids for a, b in zip(demos, teacher_demos, strict=True))
    wanted = [r for r in (("teacher", spec.teacher, teacher_dir), ("student", spec.student, student_dir)) if r[0] in roles]
    for role, sft_spec, out in wanted[1:] if keep_teacher else wanted:
        torch.manual_seed(sft_spec.seed)
        model = Qwen3ForCausalLM(sft_spec.size.config(tok, spec.max_context))
        train = sft(model, teacher_demos if role == "teacher" else demos, sft_spec, evaluate_fn=success_of if role == "teacher" else None,
                    format_check=eval_of if role == "student" else None, progress=progress, name=role, device=device)  # fmt: skip
        model.eval()
        if "format_gate" not in train and (train["success"] is None or role == "student"):
            train["success"] = success_of(model)
        train["parameters"] = sum(p.numel() for p in model.parameters())
        if spec.mistakes > 0:  # held-out success when the episode starts with a recoverable mistake already made
            recovered = recovery_eval(model, tok, env_name, env_kwargs=env_kwargs, num_tasks=spec.eval_tasks,
                                      rollout=RolloutConfig(temperature=0.0, max_context=spec.max_context))  # fmt: skip
            train["recovery_success"], train["recovery_by_kind"] = recovered.success_rate, recovered.by_kind

        def save(path: Path, model=model) -> None:
            model.save_pretrained(path)
            tok.save_pretrained(path)

        atomic_dir(out, save)
        report[role] = train
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report_path.write_text(json.dumps(report, indent=2))
    return BuiltinModels(env_name, teacher_dir, student_dir, report)


def mixed_student(env_names: Sequence[str], *, spec: BootstrapSpec | None = None, home: Path | None = None, force: bool = False,
                  progress: Progress | None = None) -> Path:  # fmt: skip
    """A built-in student SFT'd on the union of the envs' oracle demonstrations, cached under
    `$AGENTOPD_HOME/models/mixed/<env+env>/student` (the built-in teachers of the envs are built too:
    a mixed run routes to them)."""
    names = sorted(set(env_names))
    bad = [n for n in names if n not in BUILTIN_ENVS]
    if bad:
        raise ValueError(
            f"a mixed run's embedded models cover the built-in envs {list(BUILTIN_ENVS)} (one tokenizer); {bad[0]!r} is not "
            f"one: pass student=PATH and teachers.<name>=PATH, or run {bad[0]!r} alone on its embedded default"
        )
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

    atomic_dir(out, save)
    report = {"envs": names, "env_kwargs": env_kwargs, "demonstrations": len(demos), "student": train, "seconds": round(time.perf_counter() - t0, 1)}
    report_path.write_text(json.dumps(report, indent=2))
    return out
