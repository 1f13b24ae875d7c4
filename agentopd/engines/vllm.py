"""VLLMEngine: vLLM's AsyncLLM behind the async Engine protocol (optional extra, GPU nodes).

    engine = VLLMEngine("/models/Qwen3-1.7B", gpu_memory_utilization=0.5, enable_sleep_mode=True)
    result = await engine.generate(GenerateRequest(prompt_ids, SamplingParams(temperature=1.0)))
    await engine.update_weights(trainer_state_dict)   # HF names; CPU or GPU tensors
    await engine.sleep(); ...train...; await engine.wake_up()   # colocated with the trainer
    await engine.close()

Token-in/token-out only: the engine runs with `skip_tokenizer_init=True`, prompts are
`TokensPrompt(prompt_token_ids=...)`, sampling uses `detokenize=False`, `logprobs=0` (the sampled
token's logprob) and `ignore_eos=True` (only the request's stop ids stop it, as in HFEngine).
vLLM is imported inside the class: without it, constructing one raises a one-line ImportError.

Logprobs: the engine starts with `logprobs_mode="processed_logprobs"`, i.e. vLLM reports
`log_softmax` of the logits after temperature and top-k/top-p. That is the protocol's
`log_softmax(logits / T)` exactly when top_p == 1 and top_k == 0 (or greedy). With truncation on,
vLLM renormalises over the kept tokens, unlike engines/base.py; such results carry
`info["logprobs"] == "renormalized"` (else "full"). Temperatures vLLM would clamp
(0 < T < 0.01, T > 2) are refused with a ValueError, since the logprobs would not match T.

Weight updates: `WeightSyncExtension` is passed as `worker_extension_cls`; `update_weights` waits
for in-flight requests (new ones wait), sends the state dict in chunks through
`collective_rpc("agentopd_load_weights", ...)` -> `model_runner.model.load_weights(weights=...)`,
then `reset_prefix_cache()`. RPC arguments travel through CPU memory, so this suits models of
a few billion parameters; larger ones want NCCL/CUDA-IPC transfer (not built).

The pure translation functions (`to_vllm_sampling_kwargs`, `result_from_output`,
`logprobs_kind`, `weight_chunks`) need no vLLM and are unit tested; the engine itself was not
run on our CPU machines.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import torch

from agentopd.engines.base import FinishReason, GenerateRequest, GenerateResult, SamplingParams

INSTALL_HINT = "vLLM is not installed: pip install 'agentopd[vllm]'"
LOAD_METHOD = "agentopd_load_weights"
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def top_k_off(vllm_version: str) -> int:
    """The top_k value that disables top-k: -1 before vLLM 0.9 (vllm#17773), 0 from then on."""
    from packaging.version import Version

    return -1 if Version(vllm_version) < Version("0.9.0") else 0


def logprobs_kind(params: SamplingParams) -> str:
    """"full" when vLLM's processed logprobs equal the protocol's, "renormalized" under top-k/top-p."""
    if params.temperature == 0 or (params.top_p == 1.0 and params.top_k == 0):
        return "full"
    return "renormalized"


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


def result_from_output(completion: Any, params: SamplingParams) -> GenerateResult:
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
    return GenerateResult(token_ids, logprobs, _FINISH[completion.finish_reason],
                          {"logprobs": logprobs_kind(params)})


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


class WeightSyncExtension:
    """Mixed into vLLM's GPU worker (`worker_extension_cls`); reached via `collective_rpc`."""

    def agentopd_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named tensors into the worker's model; returns how many were given."""
        self.model_runner.model.load_weights(weights=weights)  # type: ignore[attr-defined]
        return len(weights)


class VLLMEngine:
    """vLLM AsyncLLM serving token ids (see the module docstring)."""

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        enable_sleep_mode: bool = False,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        weight_chunk_bytes: int = 512 << 20,
        **engine_kwargs: Any,
    ) -> None:
        try:
            import vllm
        except ModuleNotFoundError as exc:
            if exc.name != "vllm":
                raise
            raise ImportError(INSTALL_HINT) from None
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if not isinstance(model, str):
            raise ValueError(f"VLLMEngine needs a model path or hub id, got {type(model).__name__}")
        self._version = vllm.__version__
        args = AsyncEngineArgs(
            model=model, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            enable_sleep_mode=enable_sleep_mode, tensor_parallel_size=tensor_parallel_size, seed=seed,
            skip_tokenizer_init=True, logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.WeightSyncExtension", **engine_kwargs,
        )
        self._llm = AsyncLLM.from_engine_args(args)
        self.max_model_len = int(self._llm.model_config.max_model_len)
        self.weight_chunk_bytes = weight_chunk_bytes
        self.weight_version = 0
        self._inflight = 0
        self._drained = asyncio.Event()
        self._open = asyncio.Event()
        self._open.set()
        self._drained.set()

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        from vllm import SamplingParams as VSamplingParams
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if not request.token_ids:
            raise ValueError("GenerateRequest.token_ids is empty: a prompt needs at least one token")
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
            result = result_from_output(final.outputs[0], request.params)
            result.info["weight_version"] = self.weight_version
            return result
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._drained.set()

    def release(self, episode_id: str) -> None:
        """Nothing to free: vLLM's prefix cache reuses an episode's earlier turns by itself."""

    async def update_weights(self, state_dict: dict[str, Any]) -> None:
        """Wait for in-flight requests, push the weights to every worker, drop the prefix cache."""
        self._open.clear()
        try:
            await self._drained.wait()
            for chunk in weight_chunks(state_dict, self.weight_chunk_bytes):
                await self._llm.collective_rpc(LOAD_METHOD, args=(chunk,))
            await self._llm.reset_prefix_cache()
            self.weight_version += 1
        finally:
            self._open.set()

    async def sleep(self, level: int = 1) -> None:
        """Free GPU memory for the trainer (needs enable_sleep_mode). Level 2 drops the weights."""
        await self._llm.sleep(level=level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate ("weights", then "kv_cache"; None = both) after `sleep`."""
        await self._llm.wake_up(tags=tags)
        if tags is None or "kv_cache" in tags:
            await self._llm.reset_prefix_cache()

    async def close(self) -> None:
        self._llm.shutdown()
