"""teacher.linear_dtype=fp8 against the run's dtype: how far its scores move on a real checkpoint, and how fast it
scores on a GPU.

    python benchmarks/teacher_fp8.py fidelity --teacher DIR --store RUN/trajectories.db [--episodes 8] [--out DIR]
    python benchmarks/teacher_fp8.py speed [--shape 8b] [--tasks 32] [--out DIR]          # a GPU with fp8 tensor cores

fidelity (CPU or GPU): the teacher folder (a real checkpoint, e.g. Qwen2.5-Coder-1.5B-Instruct imported from its GGUF:
agentopd.gguf_fetch) scores the response tokens of a run's last `--episodes` stored training episodes (the student's own streams, what an OPD
teacher scores) twice, in bf16 and with its projections in float8 (agentopd.teacher.fp8): per response token the KL of
the fp8 teacher's distribution from the bf16 one (full vocabulary, fp32), |delta log p| of the sampled token, and how
often the two agree on the most likely token. For scale, the same figures between the bf16 teacher and the bf16 student
of the same run are what OPD's signal is made of.

speed (GPU): a random-weight Qwen3 of the shape (8b: the README's GPU example's teacher) scores `--tasks` x 8 streams
of a 384-token prompt and 1,024 response tokens each (packed, prompts shared, mode hidden, `teacher.compile` on) with
HFTeacher, bf16 then fp8 in one process, two scorings each (the first compiles): seconds and the ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agentopd.teacher.fp8 import to_fp8  # noqa: E402


def _log_probs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0]
    return torch.log_softmax(logits.float(), -1)


def fidelity(args) -> dict:
    from transformers import AutoModelForCausalLM

    from agentopd.store import Store

    store = Store(args.store, readonly=True)
    episodes = [ep for _, ep in store.iter_episodes(split="train") if ep.tokens][-args.episodes:]  # the latest steps'
    if not episodes:
        raise SystemExit(f"{args.store}: no episodes")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.bfloat16).to(device).eval()
    student = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.bfloat16).to(device).eval() if args.student else None
    refs, positions, sampled, lp_student = [], [], [], []
    t0 = time.perf_counter()
    for ep in episodes:
        s = ep.tokens
        pos = torch.tensor([s.prompt_len + i - 1 for i, m in enumerate(s.response_mask) if m], device=device)
        ref = _log_probs(model, s.token_ids)[pos]
        refs.append(ref.cpu())
        positions.append(pos)
        sampled.append(torch.tensor(s.token_ids, device=device)[pos + 1].cpu())
        if student is not None:
            lp_student.append(_log_probs(student, s.token_ids)[pos].cpu())
    bf16_s = time.perf_counter() - t0
    del student
    n = to_fp8(model)
    kl, dlp, agree = [], [], []
    kl_st = []
    t0 = time.perf_counter()
    for i, (ep, ref, pos, tok) in enumerate(zip(episodes, refs, positions, sampled)):
        got = _log_probs(model, ep.tokens.token_ids)[pos].cpu()
        kl.append((ref.exp() * (ref - got)).sum(-1))
        dlp.append((ref.gather(1, tok[:, None]) - got.gather(1, tok[:, None])).abs()[:, 0])
        agree.append((ref.argmax(-1) == got.argmax(-1)).float())
        if lp_student:
            kl_st.append((ref.exp() * (ref - lp_student[i])).sum(-1))
    fp8_s = time.perf_counter() - t0
    kl, dlp, agree = torch.cat(kl), torch.cat(dlp), torch.cat(agree)
    out = {"teacher": str(args.teacher), "store": str(args.store), "episodes": len(episodes), "tokens": len(kl),
           "projections_fp8": n, "kl_mean": kl.mean().item(), "kl_p99": kl.quantile(0.99).item(), "kl_max": kl.max().item(),
           "dlogp_mean": dlp.mean().item(), "dlogp_p99": dlp.quantile(0.99).item(), "top1_agree": agree.mean().item(),
           "seconds_bf16": bf16_s, "seconds_fp8": fp8_s, "device": device}
    if kl_st:
        out["kl_teacher_student_mean"] = torch.cat(kl_st).mean().item()
    print(json.dumps(out, indent=1), flush=True)
    return out


def speed(args) -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import memory_gpu
    from agentopd.teacher import HFTeacher
    from agentopd.teacher.base import TeacherMode
    from agentopd.types import TokenStream

    h, layers, heads, kv, hd, inter, tied = memory_gpu.SHAPES[args.shape]
    cfg = Qwen3Config(vocab_size=151936, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, tie_word_embeddings=tied,
                      max_position_embeddings=40960)
    g = torch.Generator().manual_seed(0)
    streams = []
    for _ in range(args.tasks):
        prompt = torch.randint(0, 151643, (384,), generator=g).tolist()
        for _ in range(8):
            resp = torch.randint(0, 151643, (1024,), generator=g).tolist()
            streams.append(TokenStream(prompt + resp, 384, [1] * 1024, [0.0] * 1024, [0] * 1024))
    tokens = sum(len(s.token_ids) for s in streams)
    out = {"shape": args.shape, "streams": len(streams), "tokens": tokens}
    for linear_dtype in ("auto", "fp8"):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
        teacher = HFTeacher(model, device="cuda", offload_after_score=False, compile=True, linear_dtype=linear_dtype)
        times = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            teacher.score(streams, mode=TeacherMode.HIDDEN)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() / 2**30
        out[linear_dtype] = {"seconds": times, "peak_gib": peak}
        print(f"{linear_dtype:4s}: {', '.join(f'{t:.2f}' for t in times)} s ({tokens / min(times):,.0f} tok/s; peak {peak:.1f} GiB)",
              flush=True)
        del teacher, model
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    out["fp8_over_bf16"] = min(out["auto"]["seconds"]) / min(out["fp8"]["seconds"])
    print(f"fp8 scores {out['fp8_over_bf16']:.2f}x as fast as bf16 ({tokens:,} tokens, best of {args.reps})", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    f = sub.add_parser("fidelity")
    f.add_argument("--teacher", type=Path, required=True)
    f.add_argument("--student", type=Path, default=None, help="the run's student folder: the teacher-student KL for scale")
    f.add_argument("--store", type=Path, required=True)
    f.add_argument("--episodes", type=int, default=8)
    s = sub.add_parser("speed")
    s.add_argument("--shape", default="8b")
    s.add_argument("--tasks", type=int, default=32)
    s.add_argument("--reps", type=int, default=2)
    for p in (f, s):
        p.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    out = fidelity(args) if args.what == "fidelity" else speed(args)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"teacher_fp8_{args.what}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
