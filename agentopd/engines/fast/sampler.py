"""The fast engine's sampler: exact protocol logprobs and batch-independent, counter-based draws.

    tokens, logprobs = sample(logits_BV, params, seeds, positions)

Logprobs follow engines/base.py: `log_softmax(logits / T)` in fp32 over the full vocabulary, T = 1
for greedy rows; the reported value is that row's entry at the chosen token. The vocabulary is the logits'
columns: the engine passes the tokenizer's ids only (`logits[:, :vocab_size]`, a view; the fused kernel
reads it by row stride), so the embedding's padding rows are never drawn. Greedy rows take the
argmax. Sampled rows draw by an exponential race (Gumbel-max): token = argmax(logprob - log E_v)
with E_v = -log(u_v), where u_v is a hash of (seed, position, v) — one uniform per vocabulary
entry, computed from counters alone. A row's draw therefore depends only on its own logits, its
request's seed and the position being sampled: not on which batch it lands in, on preemption and
recompute, or on any generator state. Top-k / top-p set the tokens outside them to -inf before the
race (so they narrow what is sampled) and are not renormalised into the reported logprob.

On CUDA, rows without top-k / top-p go through one fused Triton kernel (triton_sampler.py) that
computes the same numbers in two passes over the logits.

The hash is lowbias32 (Chris Wellons' integer-hash search), evaluated in int64 torch arithmetic with
32-bit wraparound, so CPU and CUDA draw the same numbers.

Legend: B rows, V vocabulary.
"""

from __future__ import annotations

import numpy as np
import torch

from agentopd.engines.base import SamplingParams, logprob_temperature
from agentopd.engines.sampling import filter_logprobs

M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32) without int64 overflow (tensor or int)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & M32


def mix32(x):
    """lowbias32 on values in [0, 2**32): ints or int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_key(seed: int, position: int) -> int:
    """The 32-bit counter key of one draw: request seed (any int) and the position being sampled."""
    k = mix32((seed & M32) ^ 0x9E3779B9)
    k = mix32(k ^ ((seed >> 32) & M32))
    return mix32(k ^ (position & M32))


def row_keys(seeds: list[int], positions: list[int]) -> np.ndarray:
    """`row_key` of many rows at once (numpy uint64 arithmetic; equal to row_key row by row)."""
    m = np.uint64(M32)
    s = np.array([x & 0xFFFFFFFFFFFFFFFF for x in seeds], dtype=np.uint64)
    pos = np.array(positions, dtype=np.uint64) & m

    def mix(x):
        x = x ^ (x >> np.uint64(16))
        x = (x * np.uint64(0x7FEB352D)) & m
        x = x ^ (x >> np.uint64(15))
        x = (x * np.uint64(0x846CA68B)) & m
        return x ^ (x >> np.uint64(16))

    k = mix((s & m) ^ np.uint64(0x9E3779B9))
    k = mix(k ^ ((s >> np.uint64(32)) & m))
    return mix(k ^ pos)


_token_keys: dict[tuple[str, int], torch.Tensor] = {}


def _token_key_V(vocab: int, device: torch.device) -> torch.Tensor:
    key = (str(device), vocab)
    if key not in _token_keys:
        _token_keys[key] = mix32((torch.arange(vocab, dtype=torch.int64, device=device) * 0x9E37 + 0x85EB) & M32)
    return _token_keys[key]


def uniforms(keys_B: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1), fp32, from 23 hashed bits of (row key, token)."""
    h_BV = mix32(keys_B[:, None] ^ _token_key_V(vocab, keys_B.device)[None, :])
    return ((h_BV >> 9).float() + 0.5) * (1.0 / (1 << 23))


def sample(logits_BV: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           positions: list[int]) -> tuple[list[int], list[float]]:
    """One token per row and its protocol logprob; row i uses params[i], seeds[i], positions[i]."""
    both = torch.stack(sample_on_device(logits_BV, params, seeds, positions)).tolist()  # one device sync
    return [int(t) for t in both[0]], both[1]


def sample_on_device(logits_BV: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                     positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` without the host sync: float64 tensors [B] of tokens and logprobs on logits' device
    (float64 holds both exactly), so a caller can queue more work before it reads them."""
    assert logits_BV.shape[0] == len(params) == len(seeds) == len(positions)
    device = logits_BV.device
    temps = [logprob_temperature(p.temperature) for p in params]
    if logits_BV.is_cuda and all(p.top_k == 0 and p.top_p == 1.0 for p in params):
        from agentopd.engines.fast import triton_sampler

        if triton_sampler.available():
            keys = row_keys(seeds, positions).astype(np.float64)  # < 2**32: exact in float64
            meta_3B = torch.tensor(np.stack([np.array(temps), keys, [p.temperature == 0 for p in params]]))
            meta_3B = meta_3B.to(device, non_blocking=True)
            tokens_B, logprobs_B = triton_sampler.fused_sample(
                logits_BV, meta_3B[0].float(), meta_3B[1].long(), meta_3B[2].to(torch.int8))
            return tokens_B.double(), logprobs_B.double()
    if all(t == 1.0 for t in temps):
        logprobs_BV = torch.log_softmax(logits_BV.float(), dim=-1)
    else:
        temp_B1 = torch.tensor(temps, dtype=torch.float32, device=device)[:, None]
        logprobs_BV = torch.log_softmax(logits_BV.float() / temp_B1, dim=-1)
    tokens_B = logprobs_BV.argmax(dim=-1)
    drawn = [i for i, p in enumerate(params) if p.temperature > 0]
    if drawn:
        rows = torch.tensor(drawn, device=device) if len(drawn) < len(params) else None
        race_SV = logprobs_BV if rows is None else logprobs_BV[rows]
        narrowed = [j for j, i in enumerate(drawn) if params[i].top_k > 0 or params[i].top_p < 1.0]
        if narrowed:
            race_SV = race_SV.clone()
            for j in narrowed:
                race_SV[j] = filter_logprobs(race_SV[j], params[drawn[j]].top_k, params[drawn[j]].top_p)
        keys_S = torch.from_numpy(row_keys([seeds[i] for i in drawn], [positions[i] for i in drawn]).astype(np.int64))
        keys_S = keys_S.to(device, non_blocking=True)
        u_SV = uniforms(keys_S, logits_BV.shape[1])
        picked_S = (race_SV - torch.log(-torch.log(u_SV))).argmax(dim=-1)
        if rows is None:
            tokens_B = picked_S
        else:
            tokens_B[rows] = picked_S
    chosen_B = logprobs_BV.gather(1, tokens_B[:, None])[:, 0]
    return tokens_B.double(), chosen_B.double()
