"""Tiny random-init Qwen3 students and synthetic train samples shared by the trainer/batch tests
(and the spawned distributed workers)."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from agentopd.batch import TrainSample

try:
    import pytest
except ImportError:  # tests/_gpu_check.py on a machine without pytest
    pytest = None

VOCAB = 128


def _one_thread():
    """Tiny models on a busy 2-core machine: intra-op threads only add contention (10x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


one_thread = pytest.fixture(autouse=True, scope="module")(_one_thread) if pytest else None


def tiny_config(tie: bool = True, attn: str = "sdpa") -> Qwen3Config:
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=tie,
        max_position_embeddings=256,
    )
    cfg._attn_implementation = attn
    return cfg


def tiny_model(seed: int = 0, tie: bool = True, attn: str = "sdpa") -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_config(tie, attn))


def make_samples(
    n: int, seed: int = 1, min_len: int = 8, max_len: int = 40, teacher_hidden: int = 0
) -> list[TrainSample]:
    """Random episodes: a prompt, then alternating student (mask 1) and tool (mask 0) spans, with
    sampler/teacher logprobs, top-4 teacher ids, rewards in 4 groups; optional teacher hidden rows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        prompt = int(torch.randint(1, min(6, length), (1,), generator=g))
        ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        r = length - prompt
        mask = [1 if (j // 5) % 2 == 0 else 0 for j in range(r)]  # 5 student tokens, 5 tool tokens, ...
        old = (-torch.rand(r, generator=g) * 5).tolist()
        teacher = (-torch.rand(r, generator=g) * 5).tolist()
        topk_ids = torch.stack([torch.randperm(VOCAB, generator=g)[:4] for _ in range(r)]).tolist() if r else []
        topk_lp = torch.log_softmax(torch.randn(r, 5, generator=g), -1)[:, :4].tolist()
        hidden = torch.randn(r, teacher_hidden, generator=g) if teacher_hidden else None
        out.append(
            TrainSample(
                token_ids=ids,
                prompt_len=prompt,
                response_mask=mask,
                old_logprobs=[o * m for o, m in zip(old, mask)],
                teacher_logprobs=[t * m for t, m in zip(teacher, mask)],
                teacher_topk_ids=topk_ids,
                teacher_topk_logprobs=topk_lp,
                teacher_hidden=hidden,
                reward=float(torch.rand(1, generator=g)),
                group_id=i % 4,
                turn_index=[j // 10 for j in range(r)],
            )
        )
    return out


def with_shared_prefix(samples: list[TrainSample], length: int, seed: int = 9) -> list[TrainSample]:
    """The samples behind one common prefix of `length` random tokens (a system prompt), part of each prompt."""
    import dataclasses

    prefix = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [dataclasses.replace(s, token_ids=prefix + s.token_ids, prompt_len=length + s.prompt_len) for s in samples]


def real_vocab_model(rows: int = 151_936, seed: int = 0, hidden: int = 32, max_positions: int = 4096,
                     padding_from: int | None = None, padding_boost: float = 0.0) -> Qwen3ForCausalLM:
    """A tiny random Qwen3 with a real vocabulary's embedding rows (Qwen3: 151,936 for 151,669 token ids).
    `padding_boost` > 0 scales the lm_head rows from `padding_from` on (tied: the input rows too, which no id
    reaches) so the padding rows get large logits: a sampler that does not mask them picks them."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=rows, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                      max_position_embeddings=max_positions)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(cfg).eval()
    if padding_boost:
        with torch.no_grad():
            model.get_output_embeddings().weight[padding_from:] *= padding_boost
    return model


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """torch's varlen_attn computed one sequence at a time: (T, H, D) in, (T, H, D) out. A stand-in for the CUDA
    flash kernel, so that the packed paths run on CPU (the real kernel is checked on GPUs by
    benchmarks/trainer_gpu.py --check and the GPU-marked tests). Causal as flash attention aligns it: a sequence with
    more keys than queries (a segment continuing a shared prefix, agentopd.prefix.pack_row) lets query t see keys up
    to t + (keys - queries)."""
    out = torch.empty_like(query)
    causal = tuple(window_size) == (-1, 0)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    for s in range(len(cu_seq_q) - 1):
        a, b, c, d = int(cu_seq_q[s]), int(cu_seq_q[s + 1]), int(cu_seq_k[s]), int(cu_seq_k[s + 1])
        q, k, v = query[a:b].transpose(0, 1), key[c:d].transpose(0, 1), value[c:d].transpose(0, 1)
        mask = None
        if causal:
            mask = torch.arange(d - c)[None, :] <= torch.arange(b - a)[:, None] + ((d - c) - (b - a))
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)
    return out
