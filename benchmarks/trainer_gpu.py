"""Student-step throughput on GPUs: Qwen3-0.6B / 1.7B shapes (random weights, the real 151,936
vocabulary), forward KL against a Qwen3-4B-shaped teacher's cached hidden states, 1-4 GPUs; and
teacher scoring, padded vs packed.

    python benchmarks/trainer_gpu.py --shape qwen3-0.6b --jsonl out.jsonl             # one GPU, no process group
    torchrun --nproc_per_node 4 benchmarks/trainer_gpu.py --shape qwen3-1.7b --jsonl out.jsonl   # FSDP2 over NCCL
    python benchmarks/trainer_gpu.py --teacher --jsonl out.jsonl                        # 4B teacher: padded vs packed
    python benchmarks/trainer_gpu.py --report out.jsonl --write benchmarks/results/trainer_gpu.md

Each rank trains on its own `--seqs` sequences of `--seq-len` tokens a step (weak scaling: the
per-GPU work is the same at every world size; 16 x 2048 by default), prompt 256 tokens, every
response token a student token, teacher hidden states (H_t = 2560) random, cached on the host as
the runner caches them. `--configs` lists trainer variants (eager, compile, ac, ac2 = recompute
every 2nd layer, +-joined), each a fresh Trainer in this process. Timed: `--steps` steps after 2
warm-up steps (compilation); tokens/s = global real tokens / wall time; MFU = 6 * N * tokens/s /
(GPUs * 989.4 TFLOP/s dense bf16), N = decoder + lm_head parameters (the trainer's perf/mfu);
peak = torch.cuda.max_memory_allocated on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

SHAPES = {  # hidden, layers, heads, kv heads, head_dim, intermediate (Qwen3 configs)
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144),
    "qwen3-4b": (2560, 36, 32, 8, 128, 9728),
    "tiny": (64, 2, 4, 2, 16, 128),  # --smoke: the same code on CPU
    "tiny-t": (96, 2, 4, 2, 16, 192),
}
VOCAB = 151936
SMOKE = False


def _cuda(fn, *a, default=None):
    return default if SMOKE else getattr(torch.cuda, fn)(*a)
CONFIGS = {
    "eager": {},
    "compile": {"compile": True},
    "ac": {"activation_checkpointing": True},
    "ac2": {"activation_checkpointing": True, "checkpoint_every": 2},
    "sdpa": {"varlen_attention": False},
}


def qwen3(shape: str, device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    h, layers, heads, kv, hd, inter = SHAPES[shape]
    cfg = Qwen3Config(vocab_size=512 if SMOKE else VOCAB, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, head_dim=hd, intermediate_size=inter, max_position_embeddings=8192,
                      tie_word_embeddings=shape not in ("qwen3-4b", "tiny-t"))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3ForCausalLM(cfg)


def samples(n: int, seq_len: int, prompt: int, h_t: int, seed: int):
    from agentopd.batch import TrainSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        r = seq_len - prompt
        out.append(TrainSample(
            token_ids=torch.randint(0, 512 if SMOKE else VOCAB, (seq_len,), generator=g).tolist(), prompt_len=prompt,
            response_mask=[1] * r, old_logprobs=[0.0] * r,
            teacher_hidden=(torch.randn(r, h_t, generator=g) * 2).to(torch.bfloat16)))
    return out


def bench_train(args) -> list[dict]:
    from agentopd.trainer import Trainer, TrainerConfig

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device("cpu") if SMOKE else torch.device("cuda", torch.cuda.current_device())
    h_t = SHAPES["tiny-t" if SMOKE else "qwen3-4b"][0]
    g = torch.Generator().manual_seed(1)
    teacher_head = (torch.randn(512 if SMOKE else VOCAB, h_t, generator=g) * h_t**-0.5).to(device, torch.bfloat16)
    data = samples(args.seqs, args.seq_len, 16 if SMOKE else 256, h_t, seed=100 + rank)
    rows = []
    for name in args.configs.split(","):
        opts = {}
        for part in name.split("+"):
            opts |= CONFIGS[part]
        cfg = TrainerConfig(loss="forward_kl", lr=1e-5, micro_batch_tokens=args.micro_batch_tokens,
                            chunk_size=args.chunk_size, total_steps=100, **opts)
        _cuda("empty_cache")
        _cuda("reset_peak_memory_stats")
        try:
            trainer = Trainer(qwen3(args.shape, device), cfg, device=device)
            t_warm = time.perf_counter()
            for _ in range(2):
                trainer.train_step(data, teacher_head_VH=teacher_head)
            warm = time.perf_counter() - t_warm
            _cuda("synchronize")
            if distributed:
                dist.barrier()
            t0 = time.perf_counter()
            metrics = [trainer.train_step(data, teacher_head_VH=teacher_head) for _ in range(args.steps)]
            _cuda("synchronize")
            wall = time.perf_counter() - t0
        except Exception as e:  # OOM, a compile error...: report the row, go on with the next config
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
            rows.append({"shape": args.shape, "config": name, "world": world, "error": msg})
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
            trainer = None
            continue
        tokens = sum(m["train/tokens"] for m in metrics)
        row = {
            "shape": args.shape, "config": name, "world": world, "device": _cuda("get_device_name", default="cpu"),
            "seqs_per_gpu": args.seqs, "seq_len": args.seq_len, "micro_batch_tokens": args.micro_batch_tokens,
            "chunk_size": args.chunk_size, "params_N": trainer.matmul_params, "steps": args.steps,
            "tokens_per_s": tokens / wall, "tokens_per_s_per_gpu": tokens / wall / world,
            "mfu": 6 * trainer.matmul_params * tokens / wall / (989.4e12 * world),
            "perf_mfu_median": statistics.median(m.get("perf/mfu", float("nan")) for m in metrics),
            "peak_GiB": _cuda("max_memory_allocated", default=0) / 2**30, "warmup_s": warm,
            "loss": metrics[-1]["loss"], "varlen": trainer.varlen, "fsdp": trainer.distributed,
        }
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        del trainer
    if distributed:
        dist.destroy_process_group()
    return rows if rank == 0 else []


def bench_teacher(args) -> list[dict]:
    from agentopd.teacher.hf import HFTeacher
    from agentopd.types import TokenStream

    device = torch.device("cpu" if SMOKE else "cuda")
    model = qwen3("tiny-t" if SMOKE else "qwen3-4b", device).to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    streams = []
    for _ in range(args.teacher_streams):  # agent episodes of mixed length
        n = int(torch.randint(300, 4096, (1,), generator=g)) // (16 if SMOKE else 1)
        p = int(torch.randint(100, 300, (1,), generator=g)) // (16 if SMOKE else 1)
        ids = torch.randint(0, 512 if SMOKE else VOCAB, (n,), generator=g).tolist()
        streams.append(TokenStream(token_ids=ids, prompt_len=p, response_mask=[1] * (n - p), logprobs=[0.0] * (n - p),
                                   turn_index=[0] * (n - p)))
    tokens = sum(len(s.token_ids) for s in streams)
    rows, outs = [], {}
    for pack in ((False,) if SMOKE else (False, True)):
        teacher = HFTeacher(model, device=device, max_tokens_per_batch=args.teacher_tokens, offload_after_score=False,
                            pack=pack)
        for mode in ("logprobs", "hidden"):
            teacher.score(streams[:4], mode=mode)  # warm-up
            _cuda("synchronize")
            _cuda("reset_peak_memory_stats")
            t0 = time.perf_counter()
            out = teacher.score(streams, mode=mode)
            _cuda("synchronize")
            wall = time.perf_counter() - t0
            outs[(pack, mode)] = out
            row = {"teacher": "qwen3-4b", "pack": pack, "mode": mode, "streams": len(streams), "tokens": tokens,
                   "max_tokens_per_batch": args.teacher_tokens, "tokens_per_s": tokens / wall,
                   "peak_GiB": _cuda("max_memory_allocated", default=0) / 2**30,
                   "device": _cuda("get_device_name", default="cpu")}
            rows.append(row)
            print(json.dumps(row), flush=True)
    a = torch.tensor([x for s in outs[(False, "logprobs")] for x in s.logprobs])
    b = torch.tensor([x for s in outs[(not SMOKE, "logprobs")] for x in s.logprobs])
    rows.append({"teacher": "qwen3-4b", "packed_vs_padded_logprob_max_abs_diff": float((a - b).abs().max()),
                 "packed_vs_padded_logprob_mean_abs_diff": float((a - b).abs().mean())})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def check() -> None:
    """CUDA: a packed row through varlen attention == each sequence alone through sdpa; one trainer
    step with varlen == the same step with sdpa rows (bf16: differences at bf16 rounding)."""
    import copy

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from agentopd import attention
    from agentopd.trainer import Trainer, TrainerConfig

    cfg = Qwen3Config(vocab_size=1000, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=32, intermediate_size=512, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).cuda().bfloat16()
    lens = [37, 300, 5, 128]
    seqs = [torch.randint(0, 1000, (n,)) for n in lens]
    with torch.no_grad():
        alone = torch.cat([model.model(input_ids=s[None].cuda(), use_cache=False).last_hidden_state[0] for s in seqs])
        with attention.use_varlen(model):
            packed = model.model(input_ids=torch.cat(seqs)[None].cuda(),
                                 position_ids=torch.cat([torch.arange(n) for n in lens])[None].cuda(), use_cache=False,
                                 **attention.varlen_kwargs(lens, "cuda")).last_hidden_state[0]
    starts = [0] + torch.tensor(lens).cumsum(0).tolist()
    errs = [((packed[a:b].float() - alone[a:b].float()).norm() / alone[a:b].float().norm()).item()
            for a, b in zip(starts, starts[1:])]
    print("CHECK packed varlen vs each sequence alone (sdpa), hidden rel err per sequence:", errs, flush=True)
    data = samples(6, 200, 20, 64, seed=3)
    for i, s in enumerate(data):  # mixed lengths
        cut = 40 + 25 * i
        s.token_ids, s.response_mask, s.old_logprobs = s.token_ids[:cut], s.response_mask[:cut - 20], s.old_logprobs[:cut - 20]
        s.teacher_hidden = s.teacher_hidden[:cut - 20]
    head = torch.randn(1000, 64, device="cuda", dtype=torch.bfloat16) / 8
    for s in data:
        s.token_ids = [t % 1000 for t in s.token_ids]
    losses = {}
    for varlen in (True, False):
        torch.manual_seed(0)
        tr = Trainer(Qwen3ForCausalLM(copy.deepcopy(cfg)), TrainerConfig(loss="forward_kl", varlen_attention=varlen, micro_batch_tokens=512))
        losses[varlen] = [tr.train_step(data, teacher_head_VH=head)["loss"] for _ in range(3)]
    print("CHECK", json.dumps({"trainer_losses_varlen": losses[True], "trainer_losses_sdpa": losses[False]}), flush=True)


def report(jsonl: Path) -> str:
    rows = [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()]
    train = [r for r in rows if "shape" in r]

    def key(r):  # scaling baseline: the same run on one FSDP rank (torchrun --nproc_per_node 1)
        return r["shape"], r["config"], r.get("micro_batch_tokens"), r.get("chunk_size")

    one = {key(r): r for r in train if r.get("world") == 1 and r.get("fsdp") and "error" not in r}
    lines = ["| shape | config | launch | GPUs | micro-batch tokens | loss chunk | tokens/s | tokens/s per GPU | "
             "per GPU / 1 FSDP rank | MFU | peak GiB (rank 0) |", "|" + "---|" * 11]
    for r in train:
        launch = "torchrun (FSDP2)" if r.get("fsdp") else "python (no FSDP)"
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['config']} | {launch} | {r['world']} | {r['error']} |" + " - |" * 6)
            continue
        base = one.get(key(r))
        ratio = f"{r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.2f}" if base and r.get("fsdp") else "-"
        lines.append(f"| {r['shape']} | {r['config']} | {launch} | {r['world']} | {r['micro_batch_tokens']} | "
                     f"{r['chunk_size']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_gpu']:,.0f} | {ratio} | "
                     f"{100 * r['mfu']:.1f}% | {r['peak_GiB']:.1f} |")
    teach = [r for r in rows if "pack" in r]
    if teach:
        lines += ["", "| teacher | mode | layout | tokens/s | peak GiB |", "|---|---|---|---|---|"]
        for r in teach:
            lines.append(f"| {r['teacher']} | {r['mode']} | {'packed' if r['pack'] else 'padded'} | "
                         f"{r['tokens_per_s']:,.0f} | {r['peak_GiB']:.1f} |")
        for r in rows:
            if "packed_vs_padded_logprob_max_abs_diff" in r:
                lines.append(f"\npacked vs padded teacher logprobs: max |diff| "
                             f"{r['packed_vs_padded_logprob_max_abs_diff']:.3g}, mean "
                             f"{r['packed_vs_padded_logprob_mean_abs_diff']:.3g}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-0.6b", choices=["qwen3-0.6b", "qwen3-1.7b", "tiny"])
    ap.add_argument("--configs", default="eager,compile")
    ap.add_argument("--seqs", type=int, default=16, help="sequences per GPU per step")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--teacher", action="store_true", help="teacher scoring, padded vs packed")
    ap.add_argument("--check", action="store_true", help="varlen attention vs sdpa on CUDA (tiny model)")
    ap.add_argument("--teacher-streams", type=int, default=64)
    ap.add_argument("--teacher-tokens", type=int, default=16384)
    ap.add_argument("--jsonl", type=Path, default=None, help="append result rows here (rank 0)")
    ap.add_argument("--report", type=Path, default=None, help="make the markdown table of a jsonl")
    ap.add_argument("--write", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script, measures nothing")
    args = ap.parse_args()
    global SMOKE
    SMOKE = args.smoke
    if args.report:
        text = report(args.report)
        print(text)
        if args.write:
            args.write.write_text(text + "\n")
        return
    if args.check:
        check()
        return
    rows = bench_teacher(args) if args.teacher else bench_train(args)
    if args.jsonl and rows:
        with args.jsonl.open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
