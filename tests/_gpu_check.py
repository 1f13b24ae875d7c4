"""Trainer checks and throughput on CUDA machines (not collected by pytest; run by hand there).

    PYTHONPATH=.:tests torchrun --nproc_per_node 2 tests/_gpu_check.py dist   # NCCL FSDP2 vs one GPU
    PYTHONPATH=.:tests python tests/_gpu_check.py bench                       # tokens/s, 0.6B-shaped

dist: the tiny-model scenario of _dist_worker (6 steps, 3 + save + fresh Trainer + load + 3) with
bf16 mixed precision on 2 ranks, again with CPU offload, and on one GPU without a process group;
prints one JSON line. bench: a random Qwen3-0.6B-shaped student (bf16 compute, activation
checkpointing), each loss kind vs a naive Hugging Face cross-entropy step on the same tokens.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def _dist() -> None:
    from _dist_worker import scenario

    from agentopd.trainer import TrainerConfig

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    kwargs = {"lr": 1e-2, "eps": 1.0, "micro_batch_tokens": 64, "warmup_steps": 1, "total_steps": 6,
              "loss": "sampled_k1", "task_reward_coef": 0.5, "reward_beta": 0.5, "mixed_precision": "bf16"}
    out = {}
    ckpt = os.environ.get("CKPT_DIR", "/tmp/agentopd_gpu_ckpt")
    two = scenario(TrainerConfig(**kwargs), f"{ckpt}/two", rank, world)
    offload = scenario(TrainerConfig(**kwargs | {"cpu_offload": True}), f"{ckpt}/offload", rank, world)
    dist.destroy_process_group()
    if rank == 0:
        one = scenario(TrainerConfig(**kwargs), f"{ckpt}/one")
        diff = lambda a, b: max(abs(x - y) for x, y in zip(a, b))  # noqa: E731
        out = {
            "losses_one_gpu": one["losses"],
            "losses_two_ranks": two["losses"],
            "max_loss_diff_two_vs_one": diff(two["losses"], one["losses"]),
            "max_loss_diff_offload_vs_two": diff(offload["losses"], two["losses"]),
            "resume_max_loss_diff_two_ranks": diff(two["resumed_losses"], two["losses"]),
            "resume_bit_identical_two_ranks": two["resumed_losses"] == two["losses"],
            "resume_bit_identical_one_gpu": one["resumed_losses"] == one["losses"],
            "engine_state_dict_device": str(next(iter(two["params_6"].values())).device),
        }
        print("DIST", json.dumps(out))


def _bench() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from agentopd.batch import TrainSample
    from agentopd.trainer import Trainer, TrainerConfig

    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    n_seq, seq, prompt, h_t = 16, 2048, 256, 1024
    g = torch.Generator().manual_seed(0)
    teacher_head = (torch.randn(cfg.vocab_size, h_t, generator=g) * 0.02).to("cuda", torch.bfloat16)

    def samples():
        out = []
        for _ in range(n_seq):
            r = seq - prompt
            out.append(TrainSample(
                token_ids=torch.randint(0, cfg.vocab_size, (seq,), generator=g).tolist(), prompt_len=prompt,
                response_mask=[1] * r, old_logprobs=(-torch.rand(r, generator=g) * 3).tolist(),
                teacher_logprobs=(-torch.rand(r, generator=g) * 3).tolist(),
                teacher_hidden=torch.randn(r, h_t, generator=g).to(torch.bfloat16)))
        return out

    data = samples()
    tokens = n_seq * seq
    results = {}
    for kind in ("sft", "sampled_k1", "reverse_kl", "jsd"):
        torch.manual_seed(0)
        trainer = Trainer(Qwen3ForCausalLM(cfg), TrainerConfig(loss=kind, lr=1e-5, micro_batch_tokens=8192,
                                                               activation_checkpointing=True, chunk_size=4096))
        torch.cuda.reset_peak_memory_stats()
        trainer.train_step(data, teacher_head_VH=teacher_head)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            m = trainer.train_step(data, teacher_head_VH=teacher_head)
        torch.cuda.synchronize()
        results[kind] = {"tok_s": round(3 * tokens / (time.perf_counter() - t0)),
                         "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2), "loss": m["loss"]}
        del trainer
        torch.cuda.empty_cache()

    # naive: HF forward with labels (full logits), same micro-batches (4 x 2048), bf16 autocast, AC, AdamW
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).cuda()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.tensor([s.token_ids for s in data], device="cuda")
    labels = ids.clone()
    labels[:, :prompt] = -100
    torch.cuda.reset_peak_memory_stats()
    for i in range(4):
        if i == 1:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        for c in range(0, n_seq, 4):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids[c : c + 4], labels=labels[c : c + 4], use_cache=False).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    results["naive_hf_ce"] = {"tok_s": round(3 * tokens / (time.perf_counter() - t0)),
                              "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    print("BENCH", json.dumps({"device": torch.cuda.get_device_name(), "tokens_per_step": tokens, **results}))


if __name__ == "__main__":
    {"dist": _dist, "bench": _bench}[sys.argv[1]]()
