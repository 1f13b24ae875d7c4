"""The vocabulary-head GEMMs of the losses and of the teacher at a real vocabulary: does an odd row count (Qwen3's
tokenizer has 151,669 ids, its head 151,936 rows) push cuBLAS onto its slow `align1` kernels, and do the head's rows
up to a multiple of 64 (read from the same storage; the logits' first V columns used) bring the fast ones back?

    python benchmarks/head_gemm_align.py                # CUDA; each GEMM's ms, plain and widened, and their ratio
    python benchmarks/head_gemm_align.py --kernels      # + the kernel each form ran (torch profiler)

The four GEMMs per chunk of C rows (trainer: `losses/fused.py`; teacher: `teacher/hf.py`'s `head_logits`):
    logits    (C x V)  = h_CH @ W_VH^T                    bf16 out
    grad_h    (C x H)  = g_CV @ W_VH                      bf16 out
    grad_w    (V x H) += g_CV^T @ h_CH                    fp32 accumulator
    teacher   (C x V)  = h_CH @ W_VH^T                    fp32 out (`out_dtype`)
"""

from __future__ import annotations

import argparse
import json

import torch

import torch.nn.functional as F

from agentopd.losses.head_matmul import ALIGN, padded_cols, widened_rows


def _time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _kernel(fn) -> str:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if e.device_type.name == "CUDA" and "gemm" in e.key.lower() or "nvjet" in e.key]
    return "; ".join(sorted(set(n[:70] for n in names))) or "?"


def forms(c: int, h: int, v: int, rows: int, device: torch.device) -> dict[str, dict[str, callable]]:
    """For each GEMM, the plain form (the first v rows of the head: what the code ran before) and the widened one
    (the rows up to an aligned count, read from the same storage: losses/head_matmul, what it runs now)."""
    g = torch.Generator(device=device).manual_seed(0)
    w_full = torch.randn(rows, h, device=device, dtype=torch.bfloat16, generator=g) * 0.02
    w, wide = w_full[:v], widened_rows(w_full[:v])
    assert wide is not None, "the head has no rows past v to widen into"
    vp = wide.shape[0]
    x = torch.randn(c, h, device=device, dtype=torch.bfloat16, generator=g)
    grad_plain = torch.randn(c, v, device=device, dtype=torch.bfloat16, generator=g)
    grad_wide = torch.zeros(c, vp, device=device, dtype=torch.bfloat16)
    grad_wide[:, :v] = grad_plain
    acc, acc_wide = torch.zeros(v, h, device=device), torch.zeros(vp, h, device=device)
    gh = torch.empty(c, h, device=device, dtype=torch.bfloat16)
    return {
        "logits": {"plain": lambda: F.linear(x, w), "widened": lambda: F.linear(x, wide)[:, :v]},
        "grad_h": {"plain": lambda: torch.mm(grad_plain, w, out=gh), "widened": lambda: torch.mm(grad_wide, wide, out=gh)},
        "grad_w": {"plain": lambda: torch.addmm(acc, grad_plain.T, x, out_dtype=torch.float32, out=acc),
                   "widened": lambda: torch.addmm(acc_wide, grad_wide.T, x, out_dtype=torch.float32, out=acc_wide)},
        "teacher": {"plain": lambda: torch.mm(x, w.t(), out_dtype=torch.float32),
                    "widened": lambda: torch.mm(x, wide.t(), out_dtype=torch.float32)[:, :v]},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--hidden", default="2048,4096", help="student 1.7B and teacher 8B hidden sizes")
    ap.add_argument("--vocab", type=int, default=151_669, help="the tokenizer's ids (Qwen3)")
    ap.add_argument("--rows", type=int, default=151_936, help="the head's rows")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    device = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(), "chunk": args.chunk, "vocab": args.vocab, "align": ALIGN, "rows": []}
    print(f"{out['device']}, C={args.chunk}, V={args.vocab} (padded to {padded_cols(args.vocab)})")
    print("| GEMM | H | plain ms | widened ms | plain / widened |" + (" kernels (plain -> widened) |" if args.kernels else ""))
    print("|---|---|---|---|---|" + ("---|" if args.kernels else ""))
    for h in (int(x) for x in args.hidden.split(",")):
        for name, pair in forms(args.chunk, h, args.vocab, args.rows, device).items():
            plain, padded = _time(pair["plain"], args.reps), _time(pair["widened"], args.reps)
            row = {"gemm": name, "hidden": h, "plain_ms": round(plain, 3), "widened_ms": round(padded, 3),
                   "ratio": round(plain / padded, 2)}
            cells = f"| {name} | {h} | {plain:.3f} | {padded:.3f} | {plain / padded:.2f} |"
            if args.kernels:
                row["kernels"] = [_kernel(pair["plain"]), _kernel(pair["widened"])]
                cells += f" {row['kernels'][0]} -> {row['kernels'][1]} |"
            out["rows"].append(row)
            print(cells, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
