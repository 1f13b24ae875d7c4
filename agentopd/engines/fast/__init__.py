"""The fast engine: paged KV kept across an episode's turns, continuous batching, CUDA-graph steps.

    from agentopd.engines.fast import FastEngine, supports
    engine = FastEngine(model_or_path, device="cuda", dtype=torch.bfloat16, max_batch_size=256)

Modules, one concept each: `model.py` (the decoder stack over a flat token batch, fused weights
with HF-named views), `attention.py` (batch description + torch reference paged attention),
`triton_attention.py` (Triton paged decode / prefill kernels), `triton_ops.py` (fused RMSNorm,
q/k-norm + rotary + K/V store, SiLU*up), `kv_cache.py` (page pool, refcounts, prefix cache),
`scheduler.py` (continuous batching, chunked prefill, preemption, episode reuse), `sampler.py` (exact
logprobs, counter-based draws) and `triton_sampler.py` (the same in one fused pass on CUDA),
`graphs.py` (CUDA graphs per bucket: decode steps by rows, prompt-chunk steps by tokens), `engine.py` (the async Engine protocol on top).

On CPU everything runs as plain torch (the reference attention, torch ops); on CUDA with Triton the
kernels take over. Measured numbers: benchmarks/results/engine_gpu.md.
"""

from agentopd.engines.fast.engine import FastEngine
from agentopd.engines.fast.model import supports

__all__ = ["FastEngine", "supports"]
