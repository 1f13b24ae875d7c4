"""Rollout benchmarks (issue 3), each a ratio against a baseline run in the same process.

(a) Agent-loop overhead per turn: episodes driven by an instant engine (the ScriptedEngine
    replaying oracle turns: no model), so the time is the loop itself — env steps, stream
    assembly, parsing. Target: <= 1 ms per turn.
(b) Rollout tokens/s of the concurrent loop vs one episode at a time, same tiny model
    (random-init Qwen3, hidden 128, 2 layers), same tasks, HFEngine with max_batch_size=64 vs 1.
    Target: >= 3x.

    python benchmarks/rollout.py [--env sql_db] [--episodes 64] [--write benchmarks/results/rollout.md]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from agentopd import make_env
from agentopd.chat import build_tokenizer
from agentopd.corpus import env_corpus
from agentopd.engines.hf import HFEngine
from agentopd.engines.scripted import ScriptedEngine
from agentopd.rollout import Rollout, RolloutConfig


def loop_overhead(env_name: str, tok, episodes: int) -> dict:
    env = make_env(env_name)
    tasks = env.tasks[:episodes]
    engine = ScriptedEngine(tok)
    specs = Rollout.specs_for([t.id for t in tasks], n=1)
    for spec, task in zip(specs, tasks):
        engine.script(spec.episode_id, env.oracle(task))
    ro = Rollout(lambda: make_env(env_name), engine, tok, RolloutConfig(max_context=4096, concurrency=1))
    t = time.perf_counter()
    eps = ro.run_sync(specs)
    dt = time.perf_counter() - t
    turns = sum(e.num_turns for e in eps)
    ro.close()
    return {"episodes": len(eps), "turns": turns, "ms_per_turn": 1e3 * dt / turns}


def throughput(env_name: str, tok, episodes: int, batch: int, model) -> dict:
    env = make_env(env_name)
    specs = Rollout.specs_for([t.id for t in env.tasks[: episodes // 2]], n=2)
    engine = HFEngine(model, max_batch_size=batch, seed=0)
    cfg = RolloutConfig(max_context=1024, max_new_tokens=48, max_turns=3, temperature=1.0, concurrency=64)
    ro = Rollout(lambda: make_env(env_name), engine, tok, cfg)
    t = time.perf_counter()
    eps = ro.run_sync(specs)
    dt = time.perf_counter() - t
    asyncio.run(engine.close())
    ro.close()
    gen = sum(e.tokens.num_llm_tokens for e in eps)
    return {"episodes": len(eps), "generated": gen, "seconds": dt, "tokens_per_s": gen / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", default="sql_db")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = build_tokenizer(env_corpus(["sql_db", "calculator", "math"], 300), vocab_size=1000)
    a = loop_overhead(args.env, tok, 200)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, tie_word_embeddings=True)).eval()  # fmt: skip
    seq = throughput(args.env, tok, args.episodes, 1, model)
    con = throughput(args.env, tok, args.episodes, 64, model)
    ratio = con["tokens_per_s"] / seq["tokens_per_s"]
    lines = [
        f"# Rollout benchmarks ({args.env}, {args.threads} torch threads)",
        "",
        f"command: `python benchmarks/rollout.py --env {args.env} --episodes {args.episodes} --threads {args.threads}`",
        "",
        "| measure | value | target | ratio to target |",
        "|---|---|---|---|",
        f"| (a) loop overhead per turn, instant engine ({a['turns']} turns) | {a['ms_per_turn']:.3f} ms | <= 1 ms | {1.0 / a['ms_per_turn']:.1f}x under |",
        f"| (b) one at a time ({seq['episodes']} episodes, {seq['generated']} tokens) | {seq['tokens_per_s']:,.0f} tok/s | | |",
        f"| (b) concurrent, same model and tasks ({con['generated']} tokens) | {con['tokens_per_s']:,.0f} tok/s | | |",
        f"| (b) concurrent / one at a time | {ratio:.1f}x | >= 3x | {ratio / 3:.2f} |",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        with open(args.write, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
