"""Peak memory and time (forward + backward) of the chunked full-vocabulary losses against a
naive implementation (full logits, plain autograd) and, on CUDA, Liger-Kernel's fused JSD.

    python benchmarks/loss.py --write benchmarks/results/loss_cpu.md             # CPU shapes
    python benchmarks/loss.py --device cuda --write benchmarks/results/loss_gpu.md

Each row is one loss (forward KL, reverse KL, JSD(0.5)) at one shape, inputs as the trainer
gives them: student hidden states N x H_s and lm_head V x H_s (both need grad), teacher
hidden states N x H_t and lm_head V x H_t (no grad). Timed work = student logits + teacher
logits + loss + backward to the student hidden states and head.
    naive    logits_NV = h @ W^T (autograd), teacher logits under no_grad, `divergence().sum()`
    default  `chunked_divergence(...)` as the trainer calls it: on CUDA the fused Triton path
             (agentopd/losses/fused.py), on CPU the torch path below
    chunked  `chunked_divergence(..., fused=False)` (the torch reference: custom autograd function,
             recompute in backward); chunked_gif: grad_in_forward=True (no recompute);
             _compiled: compiled=True
    liger    `LigerFusedLinearJSDLoss` (chunked torch, compiled and not) and `LigerFusedLinearJSD`
             (Triton), JSD only, CUDA only, when `liger_kernel` imports
Memory is the peak *extra* memory of one forward+backward over the inputs already allocated:
    CUDA  torch.cuda.max_memory_allocated() - memory_allocated() before (one process).
    CPU   torch has no CPU allocator statistics and tracemalloc does not see its buffers, so
          every (impl, loss, shape) runs in a fresh subprocess: peak = ru_maxrss after one
          forward+backward - resident set size just before it (inputs allocated, a 16-token
          warm-up run so code pages and thread pools are already resident).
          glibc returns these large blocks to the OS, so RSS follows live tensors.
Time is the best of --repeats runs (after one warm-up on CUDA); tokens/s = N / time. Ratios
are computed between rows of the same run. On CUDA, `grad err` compares each implementation's
gradients (student hidden and head, first min(N, 1024) tokens of the first shape) with an fp64
reference computed from the same bf16 inputs: max over the two of |g - g_ref| / |g_ref| (norms).
Variants take an optional chunk size, `impl:chunk` (e.g. default:2048).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too
from agentopd.losses import chunked_divergence, divergence  # noqa: E402

KINDS = ("forward_kl", "reverse_kl", "jsd")
BETA = 0.5
CPU_SHAPES = "2048x32000x256x512,4096x32000x256x512"
GPU_SHAPES = "4096x151936x2048x4096,16384x151936x2048x4096,32768x151936x2048x4096"


@dataclass(frozen=True)
class Case:
    impl: str  # naive | default | chunked[_gif][_compiled] | liger_chunked[_compiled] | liger_triton
    kind: str
    n: int
    v: int
    h_s: int
    h_t: int
    dtype: str
    device: str
    chunk_size: int = 1024
    repeats: int = 2
    threads: int = 1


@dataclass
class Result:
    case: Case
    peak_bytes: float | None = None
    seconds: float | None = None
    loss: float | None = None
    error: str | None = None
    grad_err: float | None = None


def _inputs(c: Case):
    g = torch.Generator(device=c.device).manual_seed(0)
    dt = getattr(torch, c.dtype)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=c.device, dtype=torch.float32) * scale).to(dt)

    h = r(c.n, c.h_s).requires_grad_(True)
    w = r(c.v, c.h_s, scale=c.h_s**-0.5 * 2).requires_grad_(True)
    th = r(c.n, c.h_t)
    tw = r(c.v, c.h_t, scale=c.h_t**-0.5 * 3)
    return h, w, th, tw


def _step_fn(c: Case, h, w, th, tw):
    """A closure running one forward+backward; returns the loss as a float (sum over tokens)."""
    if c.impl == "naive":
        def step():
            s_logits = h @ w.T
            with torch.no_grad():
                t_logits = th @ tw.T
            loss = divergence(s_logits, t_logits, c.kind, beta=BETA).sum()
            loss.backward()
            return loss.detach()
    elif c.impl == "default":
        def step():
            loss = chunked_divergence(h, w, teacher_hidden_NH=th, teacher_head_VH=tw, kind=c.kind, beta=BETA,
                                      chunk_size=c.chunk_size)
            loss.backward()
            return loss.detach()
    elif c.impl.startswith("chunked"):
        opts = dict(grad_in_forward="_gif" in c.impl, compiled=c.impl.endswith("_compiled"), fused=False)

        def step():
            loss = chunked_divergence(h, w, teacher_hidden_NH=th, teacher_head_VH=tw, kind=c.kind, beta=BETA,
                                      chunk_size=c.chunk_size, **opts)
            loss.backward()
            return loss.detach()
    elif c.impl.startswith("liger_chunked"):
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        fn = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=BETA, temperature=1.0,
                                     compiled=c.impl.endswith("compiled"), chunk_size=c.chunk_size)
        labels = torch.zeros(c.n, dtype=torch.long, device=c.device)

        def step():
            loss = fn(h, w, th, tw, labels)
            loss.backward()
            return loss.detach() * c.n  # Liger returns the mean over tokens
    elif c.impl == "liger_triton":
        from liger_kernel.transformers import LigerFusedLinearJSD

        fn = LigerFusedLinearJSD(jsd_beta=BETA, temperature=1.0)

        def step():
            loss = fn(h, w, th, tw, None)
            loss.backward()
            return loss.detach() * c.n
    else:
        raise ValueError(f"impl={c.impl!r}")
    return step


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_REF_GRADS: dict = {}


def grad_error(c: Case, h, w, th, tw, m: int = 1024) -> float:
    """max over (hidden, head) of |g - g_ref| / |g_ref| against an fp64 reference on the first m tokens."""
    import dataclasses

    m = min(m, c.n)
    key = (c.kind, c.n, c.v, c.h_s, c.h_t)
    if key not in _REF_GRADS:
        h64 = h[:m].detach().double().requires_grad_(True)
        w64 = w.detach().double().requires_grad_(True)
        t64 = th[:m].double() @ tw.double().T
        divergence(h64 @ w64.T, t64, c.kind, beta=BETA).sum().backward()
        _REF_GRADS.clear()
        _REF_GRADS[key] = (h64.grad.float(), w64.grad.float())
        del h64, w64, t64
    hs = h[:m].detach().clone().requires_grad_(True)
    ws = w.detach().clone().requires_grad_(True)
    _step_fn(dataclasses.replace(c, n=m), hs, ws, th[:m], tw)()
    scale = m if c.impl.startswith("liger") else 1  # Liger's step already rescales its mean to a sum
    errs = [((g.float() * scale - r).norm() / r.norm()).item() for g, r in zip((hs.grad, ws.grad), _REF_GRADS[key])]
    return max(errs)


def run_case(c: Case) -> Result:
    torch.set_num_threads(c.threads)
    res = Result(c)
    try:
        h, w, th, tw = _inputs(c)
        step = _step_fn(c, h, w, th, tw)
        cuda = c.device.startswith("cuda")
        if cuda:
            step()  # warm-up (compilation, cuBLAS handles, autotuning)
            h.grad = w.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            # a 16-token warm-up pages in the code and thread pools a first op touches (else counted
            # as peak); its own peak is far below the measured one, so ru_maxrss is not affected
            m = min(16, c.n)
            small = [t[:m].detach().requires_grad_(t.requires_grad) for t in (h, th)]
            _step_fn(c, small[0], w, small[1], tw)()
            w.grad = None
            before = _rss_bytes()
        times = []
        for i in range(c.repeats):
            h.grad = w.grad = None
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            if i == 0:
                if cuda:
                    res.peak_bytes = torch.cuda.max_memory_allocated() - before
                else:
                    res.peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
                res.loss = float(loss)
        res.seconds = min(times)
        if cuda and c.n <= 4096:
            h.grad = w.grad = None
            res.grad_err = grad_error(c, h, w, th, tw)
    except Exception as e:  # OOM, a dynamo error in Liger's compiled path...: report, keep going
        res.error = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        if c.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return res


def run_case_subprocess(c: Case) -> Result:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(asdict(c))], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        return Result(c, error=f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1][:160]}")
    d = json.loads(proc.stdout.strip().splitlines()[-1])
    return Result(c, d["peak_bytes"], d["seconds"], d["loss"], d["error"])


def _gib(b):
    return f"{b / 2**30:.2f}" if b is not None else "-"


def table(results: list[Result]) -> str:
    rows = ["| loss | N | V | H_s | H_t | impl | chunk | peak GiB | mem / naive | time s | tokens/s | speed / naive | "
            "rel. diff vs naive | grad err vs fp64 | speed / liger_c | mem / liger_c |", "|" + "---|" * 16]
    naive = {(r.case.kind, r.case.n, r.case.v, r.case.h_s, r.case.h_t): r for r in results if r.case.impl == "naive"}
    liger = {(r.case.kind, r.case.n, r.case.v, r.case.h_s, r.case.h_t): r for r in results
             if r.case.impl == "liger_chunked_compiled" and r.error is None}
    for r in results:
        c = r.case
        base = naive.get((c.kind, c.n, c.v, c.h_s, c.h_t))
        lig = liger.get((c.kind, c.n, c.v, c.h_s, c.h_t))
        gerr = f"{r.grad_err:.1e}" if r.grad_err is not None else "-"
        vs_lig = (f"{lig.seconds / r.seconds:.2f} | {r.peak_bytes / lig.peak_bytes:.2f}"
                  if lig is not None and r.error is None and r is not lig else "- | -")
        ok = r.error is None
        base_ok = base is not None and base.error is None
        mem_ratio = f"{r.peak_bytes / base.peak_bytes:.3f}" if ok and base_ok and c.impl != "naive" else "-"
        speed = f"{base.seconds / r.seconds:.2f}" if ok and base_ok and c.impl != "naive" else "-"
        diff = (f"{abs(r.loss - base.loss) / max(abs(base.loss), 1e-30):.1e}"
                if ok and base_ok and c.impl != "naive" else "-")
        chunk = str(c.chunk_size) if c.impl != "naive" and c.impl != "liger_triton" else "-"
        if ok:
            rows.append(f"| {c.kind} | {c.n} | {c.v} | {c.h_s} | {c.h_t} | {c.impl} | {chunk} | {_gib(r.peak_bytes)} | "
                        f"{mem_ratio} | {r.seconds:.3f} | {c.n / r.seconds:,.0f} | {speed} | {diff} | {gerr} | {vs_lig} |")
        else:
            rows.append(f"| {c.kind} | {c.n} | {c.v} | {c.h_s} | {c.h_t} | {c.impl} | {chunk} | {r.error} | "
                        "- | - | - | - | - | - | - | - |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shapes", default=None, help="comma list of NxVxH_sxH_t (default per device)")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--chunk-sizes", default=None, help="comma list (default: 256,1024 on CPU, 1024,4096 on CUDA)")
    ap.add_argument("--variants", default=None,
                    help="implementations besides naive, each optionally impl:chunk (default: default on CPU; "
                         "default, default:2048, default:4096, chunked_gif_compiled:4096 on CUDA)")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per run")
    ap.add_argument("--no-liger", action="store_true")
    ap.add_argument("--write", default=None, help="write the markdown table here")
    ap.add_argument("--json", default=None, help="write every row (case and result) here as a JSON list")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        r = run_case(Case(**json.loads(args.worker)))
        print(json.dumps({"peak_bytes": r.peak_bytes, "seconds": r.seconds, "loss": r.loss, "error": r.error}))
        return
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch.cuda.is_available() is False")
    shapes = [tuple(int(x) for x in s.split("x")) for s in (args.shapes or (GPU_SHAPES if cuda else CPU_SHAPES)).split(",")]
    chunks = [int(x) for x in (args.chunk_sizes or ("1024" if cuda else "256,1024")).split(",")]
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    variants = (args.variants or ("default,default:2048,default:4096,chunked_gif_compiled:4096" if cuda
                                  else "default")).split(",")
    repeats = args.repeats or (3 if cuda else 2)
    liger = False
    if cuda and not args.no_liger:
        try:
            import liger_kernel  # noqa: F401
            liger = True
        except ImportError:
            print("liger_kernel not importable: Liger rows skipped", file=sys.stderr)
    results = []
    for n, v, h_s, h_t in shapes:
        for kind in args.kinds.split(","):
            impls = [("naive", 0)]
            for var in variants:
                name, _, cs = var.partition(":")
                impls += [(name, int(cs))] if cs else [(name, x) for x in chunks]
            if liger and kind == "jsd":
                impls += [("liger_chunked_compiled", 1024), ("liger_chunked", 1024), ("liger_triton", 0)]
            for impl, cs in impls:
                c = Case(impl, kind, n, v, h_s, h_t, dtype, args.device, cs or 1024, repeats, args.threads)
                r = run_case(c) if cuda else run_case_subprocess(c)
                results.append(r)
                print(f"{impl:24s} {kind:10s} N={n} V={v} H={h_s}/{h_t} chunk={cs}: "
                      + (r.error or f"{_gib(r.peak_bytes)} GiB {r.seconds:.3f} s loss {r.loss:.6g}"), file=sys.stderr)
    out = table(results)
    print(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**asdict(r.case), "peak_bytes": r.peak_bytes, "seconds": r.seconds,
                        "error": r.error} for r in results], f)
    if args.write:
        dev = torch.cuda.get_device_name() if cuda else f"{platform.processor() or platform.machine()} CPU, {args.threads} thread(s)"
        head = (f"# Loss benchmark ({args.device})\n\n"
                f"Command: `python {' '.join(sys.argv)}`  \n"
                f"Date: {datetime.date.today()}; torch {torch.__version__}; device: {dev}; dtype {dtype}; "
                f"JSD beta {BETA}; time = best of {repeats}{' after a warm-up' if cuda else ''}.  \n"
                "peak = extra memory of one forward+backward over the inputs "
                f"({'torch.cuda.max_memory_allocated' if cuda else 'ru_maxrss - RSS before, one subprocess per row'}). "
                "Ratios against the naive row of the same loss and shape, same run. "
                "speed / naive > 1 means faster.\n\n")
        with open(args.write, "w") as f:
            f.write(head + out + "\n")


if __name__ == "__main__":
    main()
