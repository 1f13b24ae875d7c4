"""Rollout engines: async token-in/token-out generation behind one protocol (engines/base.py).

    engine = make_engine("hf", "path/to/model", max_batch_size=64)     # transformers, CPU or GPU
    engine = make_engine("fast", "path/to/model", device="cuda")       # paged KV, CUDA graphs (engines/fast)
    engine = make_engine("vllm", "path/to/model", gpu_memory_utilization=0.5)  # optional extra

`make_engine(kind, model, **kwargs)` forwards kwargs to `HFEngine`, `FastEngine` or `VLLMEngine`.
`fast` serves Qwen3/Qwen2/Llama-style models; any other architecture falls back to `hf` with one
log line. vLLM is imported only when a VLLMEngine is built; without it that raises a one-line
ImportError.
"""

from __future__ import annotations

import inspect
import logging
from enum import StrEnum
from typing import Any

from agentopd.engines.base import Engine, FinishReason, GenerateRequest, GenerateResult, SamplingParams


class EngineKind(StrEnum):
    AUTO = "auto"
    HF = "hf"
    FAST = "fast"
    VLLM = "vllm"


def resolve_kind(kind: str, device: Any = None) -> EngineKind:
    """The engine `auto` means on `device`: vLLM where installed on a GPU, else the fast engine — on CPU too,
    where its prefix reuse measured 1.4-1.7x faster rollouts than hf (benchmarks/results/engine_gpu.md)."""
    if kind not in EngineKind.__members__.values():
        raise ValueError(f"unknown engine kind {kind!r}: choose one of {[k.value for k in EngineKind]}")
    if kind != EngineKind.AUTO:
        return EngineKind(kind)
    import importlib.util

    on_gpu = device is not None and getattr(device, "type", str(device)).startswith("cuda")
    if on_gpu and importlib.util.find_spec("vllm") is not None:
        return EngineKind.VLLM
    return EngineKind.FAST


log = logging.getLogger(__name__)


def _fast_or_fallback(model: Any, kwargs: dict[str, Any]) -> Engine:
    """FastEngine where it supports the architecture, else HFEngine (one log line says why)."""
    from agentopd.engines.fast import FastEngine, supports

    if isinstance(model, str):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
    else:
        config = model.config
    why = supports(config)
    if why is None:
        return FastEngine(model, **kwargs)
    from agentopd.engines.hf import HFEngine

    dropped = "; its K/V stay in the model's dtype (kv_cache_dtype dropped)" if kwargs.get("kv_cache_dtype", "auto") != "auto" else ""
    log.warning("engine.kind=fast does not support this model (%s): using the transformers engine%s", why, dropped)
    accepted = inspect.signature(HFEngine.__init__).parameters
    return HFEngine(model, **{k: v for k, v in kwargs.items() if k in accepted})


def make_engine(kind: str, model: Any, **kwargs: Any) -> Engine:
    """An engine of `kind` serving `model` (a path, hub id, or for hf/fast a PreTrainedModel)."""
    kind = resolve_kind(kind, kwargs.get("device"))
    if kind == EngineKind.FAST:
        return _fast_or_fallback(model, kwargs)
    if kind == EngineKind.HF:
        from agentopd.engines.hf import HFEngine

        return HFEngine(model, **kwargs)
    from agentopd.engines.vllm import VLLMEngine

    return VLLMEngine(model, **kwargs)


def __getattr__(name: str) -> Any:
    # Lazy exports: importing agentopd.engines stays cheap (no torch / transformers / vllm).
    if name == "HFEngine":
        from agentopd.engines.hf import HFEngine

        return HFEngine
    if name == "FastEngine":
        from agentopd.engines.fast import FastEngine

        return FastEngine
    if name == "VLLMEngine":
        from agentopd.engines.vllm import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module 'agentopd.engines' has no attribute {name!r}")


__all__ = [
    "Engine",
    "EngineKind",
    "FastEngine",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "HFEngine",
    "SamplingParams",
    "VLLMEngine",
    "make_engine",
]
