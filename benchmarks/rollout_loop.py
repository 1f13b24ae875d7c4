"""The agent loop's rollout against the engine alone on the same episodes: what the loop costs on top (issue 36).

    python benchmarks/rollout_loop.py --device cuda --tokenizer TOK --shape qwen3-0.6b --out DIR   # one GPU, real vocab
    python benchmarks/rollout_loop.py --device cpu --out DIR                                       # embedded tokenizer

Arms, one process, the fast engine over one random-weight Qwen3-shaped model (`--shape`, embedding rows from the
tokenizer folder's `agentopd_vocab.json`, or the embedded tokenizer's):
1. **loop**: `Rollout.run` — env reset and steps, chat-template rendering, tool-call parsing, stream assembly — on
   E episodes (`--tasks` x `--n`) of each env (`--envs`: math is single-turn, sql_db multi-turn); every request the
   loop sends the engine is recorded.
2. **engine**: the recorded requests replayed straight into the same engine, each episode's turns in order (as the
   loop sends them: the same token ids, seeds and limits, so the engine samples the same tokens), nothing else.
Before each timed arm the engine drops its cached pages (`sleep()` + `wake()`), so both start cold. The envs are kept
across arms (`EnvPool`, as a run keeps them across steps); each rep plays tasks no earlier arm played (as a run's steps
do: no prompt rendered before). `--reps` pairs; the table keeps the pair with the fastest loop. Ratio = engine tok/s / loop tok/s (1.0: the loop costs
nothing on top). `--profile` adds a cProfile of the loop's host threads (the event loop and the engine's worker)
and, on CUDA, torch.profiler's top kernels, into DIR.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_opd import SHAPES, tokenizer_and_rows  # noqa: E402

from agentopd.engines import GenerateRequest  # noqa: E402
from agentopd.engines.fast import FastEngine  # noqa: E402
from agentopd.registry import make_env  # noqa: E402
from agentopd.rollout import EnvPool, Rollout, RolloutConfig  # noqa: E402

SHAPES = {**SHAPES, "cpu-s": (64, 2, 4, 2, 16, 192)}
HOME = Path("/tmp/rollout_loop/home")  # the embedded tokenizer, when no --tokenizer


class Recorder:
    """The engine as the loop sees it, recording every request in order (per episode)."""

    def __init__(self, engine: FastEngine) -> None:
        self.engine, self.requests = engine, {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, request: GenerateRequest):
        self.requests.setdefault(request.episode_id, []).append(request)
        return await self.engine.generate(request)


def build_model(shape: str, rows: int, device: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    h, layers, heads, kv, hd, inter = SHAPES[shape]
    cfg = Qwen3Config(vocab_size=rows, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, head_dim=hd, intermediate_size=inter, max_position_embeddings=40960,
                      tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        return Qwen3ForCausalLM(cfg).to(dtype).eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def cold(engine: FastEngine) -> None:
    """Drop every cached page (the next arm starts without the last one's prefixes)."""
    async def both():
        await engine.sleep()
        await engine.wake()

    asyncio.run(both())


def run_loop(engine: FastEngine, tok, envs: EnvPool, specs, cfg: RolloutConfig, device: str, profile: bool = False):
    rec = Recorder(engine)
    ro = Rollout(envs, rec, tok, cfg)
    profs = []
    if profile:
        work = engine._work  # the worker thread's loop: profiled on its own thread

        def profiled_work():
            p = cProfile.Profile()
            try:
                p.enable()
            except ValueError:  # Python >= 3.12: one profiler at a time, and the event loop's sees every thread
                return work()
            profs.append(p)
            try:
                work()
            finally:
                p.disable()

        engine._work = profiled_work
        main = cProfile.Profile()
        main.enable()
    t = time.perf_counter()
    eps = ro.run_sync(specs)
    sync(device)
    dt = time.perf_counter() - t
    if profile:
        main.disable()
        del engine._work
        profs.append(main)  # last: the event loop's
    ro.close()
    gen = sum(e.tokens.num_llm_tokens for e in eps)
    return {"seconds": dt, "tokens": gen, "turns": sum(e.num_turns for e in eps), "requests": rec.requests,
            "streams": {s.episode_id: e.tokens.token_ids for s, e in zip(specs, eps)}, "profiles": profs}


def run_engine(engine: FastEngine, requests: dict[str, list[GenerateRequest]], device: str):
    async def episode(eid: str, reqs: list[GenerateRequest]) -> list[list[int]]:
        outs = []
        for r in reqs:
            outs.append((await engine.generate(r)).token_ids)
        engine.release(eid)
        return outs

    async def everything():
        return await asyncio.gather(*(episode(e, r) for e, r in requests.items()))

    t = time.perf_counter()
    outs = asyncio.run(everything())
    sync(device)
    dt = time.perf_counter() - t
    return {"seconds": dt, "tokens": sum(len(o) for ep in outs for o in ep), "outputs": dict(zip(requests, outs))}


def same_turns(loop: dict, engine: dict) -> tuple[int, int]:
    """Turns the engine alone sampled exactly as in the loop, of all turns."""
    same = total = 0
    for eid, reqs in loop["requests"].items():
        out = engine["outputs"][eid]
        for k, r in enumerate(reqs):
            after = reqs[k + 1].token_ids if k + 1 < len(reqs) else loop["streams"][eid]  # what the loop went on with
            total += 1
            same += after[len(r.token_ids) : len(r.token_ids) + len(out[k])] == out[k]
    return same, total


def host_profile(profs: list[cProfile.Profile], top: int = 25) -> str:
    """Top functions by own time: the engine's worker thread (its `_work` calls merged), then the event loop's."""
    loop = pstats.Stats(profs[-1], stream=io.StringIO())
    if len(profs) == 1:  # Python >= 3.12
        sections = [("every thread (one profiler: Python >= 3.12)", loop)]
    else:
        worker = pstats.Stats(profs[0], stream=io.StringIO())
        for p in profs[1:-1]:
            worker.add(p)
        sections = [("engine worker thread", worker), ("event loop thread (the loop, env, templates, parsing)", loop)]
    parts = []
    for name, stats in sections:
        if stats is None:
            continue
        buf = io.StringIO()
        stats.stream = buf
        stats.sort_stats("tottime").print_stats(top)
        parts.append(f"## {name}\n\n```\n{buf.getvalue().strip()}\n```\n")
    return "\n".join(parts)


ISSUE_RUN = ["run.steps=4", "rollout.tasks_per_step=16", "rollout.n=4", "rollout.max_new_tokens=128", "rollout.temperature=1.0",
             "eval.teacher=false", "trainer.loss=reverse_kl", "trainer.activation_checkpointing=true"]


def opd_run(tokenizer: Path, out: Path) -> list[str]:
    """`agentopd run --env math` as issue 36 ran it (Qwen3-0.6B / 1.7B shapes, random weights, `tokenizer`): the
    rollout phase's tokens/s per step, from the run's metrics."""
    import subprocess

    from gpu_opd import build

    tok, rows = tokenizer_and_rows(tokenizer, HOME)
    work = Path("/tmp/rollout_loop") / tokenizer.name
    build("qwen3-0.6b", tok, work / "student", torch.bfloat16, rows)
    build("qwen3-1.7b", tok, work / "teacher", torch.bfloat16, rows)
    run = work / "run"
    subprocess.run(["rm", "-rf", str(run)], check=True)
    cmd = ["agentopd", "run", "--env", "math", "--run-dir", str(run), f"student={work / 'student'}", f"teacher={work / 'teacher'}",
           *ISSUE_RUN]
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "agentopd.cli", *cmd[1:]], capture_output=True, text=True)
    (out / "opd_run_log.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "perf/rollout_s" in r]
    lines = [f"`{' '.join(cmd)}` ({time.perf_counter() - t:.0f} s)", "", "| step | rollout s | rollout tok/s | sampled tokens |",
             "|---|---|---|---|"]
    for r in steps:
        lines.append(f"| {r.get('step')} | {r['perf/rollout_s']:.3f} | {r['perf/rollout_tokens_per_s']:,.0f} | "
                     f"{r['perf/rollout_s'] * r['perf/rollout_tokens_per_s']:,.0f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--shape", default=None, help=f"one of {sorted(SHAPES)}; default qwen3-0.6b on cuda, cpu-s on cpu")
    ap.add_argument("--envs", default="math,sql_db")
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--opd-run", action="store_true", help="also `agentopd run --env math` as issue 36 ran it (needs --tokenizer)")
    ap.add_argument("--json", type=Path, default=None, help="write figures for benchmarks/gpu_check.py here")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    shape = args.shape or ("qwen3-0.6b" if args.device == "cuda" else "cpu-s")
    tok, rows = tokenizer_and_rows(args.tokenizer, HOME)
    model = build_model(shape, rows, args.device)
    engine = FastEngine(model, device=args.device, max_batch_size=args.tasks * args.n, seed=0, max_model_len=4096,
                        vocab_size=len(tok))
    cfg = RolloutConfig(max_new_tokens=args.max_new_tokens, max_turns=args.max_turns, max_context=2048,
                        temperature=1.0, concurrency=args.tasks * args.n)
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {args.threads} torch threads"
    lines = [f"# Agent loop vs engine alone, same episodes ({dev_name})", "",
             f"`{' '.join(['python', 'benchmarks/rollout_loop.py', *sys.argv[1:]])}`", "",
             f"model: {shape} random weights, {rows:,} embedding rows; tokenizer: {args.tokenizer or 'embedded'} "
             f"({len(tok):,} tokens); {args.tasks * args.n} episodes ({args.tasks} tasks x {args.n}), "
             f"<= {args.max_new_tokens} tokens a turn, <= {args.max_turns} turns, T=1.", "",
             "| env | turns | tokens | loop s | loop tok/s | engine s | engine tok/s | engine / loop | same turns |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    profile_text, figures = [], {}
    for env in args.envs.split(","):
        tasks = [t.id for t in make_env(env).tasks]

        def specs_of(k: int):  # a run's step k: tasks no step before played (prompts not rendered before)
            return Rollout.specs_for(tasks[k * args.tasks : (k + 1) * args.tasks], n=args.n, seed=1, step=k)

        envs = EnvPool(lambda: make_env(env))  # kept across arms, as a run keeps its envs across steps
        run_loop(engine, tok, envs, specs_of(0), cfg, args.device)  # warm-up: Triton compiles, first captures, the envs made
        pairs = []
        for k in range(1, args.reps + 1):
            cold(engine)
            loop = run_loop(engine, tok, envs, specs_of(k), cfg, args.device)
            cold(engine)
            pairs.append((loop, run_engine(engine, loop["requests"], args.device)))
        lo, en = min(pairs, key=lambda p: p[0]["seconds"])  # the fastest loop arm and the engine on its requests
        same, total = same_turns(lo, en)
        loop_tok_s, engine_tok_s = lo["tokens"] / lo["seconds"], en["tokens"] / en["seconds"]
        figures |= {f"loop/{env}_loop_tok_s": loop_tok_s, f"loop/{env}_loop_over_engine": loop_tok_s / engine_tok_s}
        lines.append(f"| {env} | {lo['turns']} | {lo['tokens']:,} | {lo['seconds']:.3f} | {lo['tokens'] / lo['seconds']:,.0f} | "
                     f"{en['seconds']:.3f} | {en['tokens'] / en['seconds']:,.0f} | "
                     f"{(en['tokens'] / en['seconds']) / (lo['tokens'] / lo['seconds']):.2f} | {same}/{total} |")
        print(lines[-1], f"(loop s / engine s per rep: {[(round(a['seconds'], 3), round(b['seconds'], 3)) for a, b in pairs]})",
              flush=True)
        if args.profile:
            cold(engine)
            prof = run_loop(engine, tok, envs, specs_of(args.reps + 1), cfg, args.device, profile=True)
            profile_text.append(f"# {env}: host profile of one loop arm ({prof['seconds']:.3f} s under cProfile)\n")
            profile_text.append(host_profile(prof["profiles"]))
            if args.device == "cuda":
                cold(engine)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as tp:
                    r = run_loop(engine, tok, envs, specs_of(args.reps + 2), cfg, args.device)
                table = tp.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60)
                profile_text.append(f"## {env}: torch.profiler, one loop arm ({r['seconds']:.3f} s under the profiler)\n\n"
                                    f"```\n{table}\n```\n")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))
    if args.opd_run:
        lines += ["", "## agentopd run", "", *opd_run(args.tokenizer, args.out)]
    text = "\n".join(lines)
    print(text)
    (args.out / "rollout_loop.md").write_text(text + "\n")
    if profile_text:
        (args.out / "rollout_loop_profile.md").write_text("\n".join(profile_text))


if __name__ == "__main__":
    main()
