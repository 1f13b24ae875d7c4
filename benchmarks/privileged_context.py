"""Does a model read the privileged context? Greedy held-out success of the built-in student and teacher with the
env's plain prompt and with the privileged one (agentopd.privileged: the env's `privileged_context` appended to the
user message), the prompt a `teacher.privileged` teacher scores the student's tokens after.

    python benchmarks/privileged_context.py --env sql_db --kind solution --num-tasks 100 [--model DIR ...]
    python benchmarks/privileged_context.py --env sql_db --device cuda --json out.json embedded.size=gpu   # the gpu pair

Privileged self-distillation can only help where the context makes the teacher better at the task: the column
"privileged" must beat "plain" for the model that plays the teacher (`teacher=self`: the student).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import torch


def success(model_ref, env_name: str, kwargs: dict, kind: str | None, num_tasks: int, rollout, device: str = "cpu") -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentopd.engines import make_engine
    from agentopd.env import Privileged, ToolEnv
    from agentopd.evaluate import evaluate_async
    from agentopd.privileged import privileged_messages
    from agentopd.splits import make_env_for_split

    tokenizer = AutoTokenizer.from_pretrained(model_ref)
    engine = make_engine("hf", AutoModelForCausalLM.from_pretrained(model_ref), vocab_size=len(tokenizer), device=device)

    def factory():
        env = make_env_for_split(env_name, "eval", **kwargs)
        if kind is not None:  # this instance's prompts carry the context
            raw = env.unwrapped
            raw.initial_messages = lambda task: privileged_messages(ToolEnv.initial_messages(raw, task),
                                                                    raw.privileged_context(task, Privileged(kind)))  # fmt: skip
        return env

    async def go():
        try:
            return await evaluate_async(engine, tokenizer, factory, env_name=env_name, num_tasks=num_tasks, rollout=rollout)
        finally:
            await engine.close()

    return asyncio.run(go()).success_rate


def main() -> None:
    from dataclasses import replace

    from agentopd.config import load_config
    from agentopd.models import resolve_model
    from agentopd.policy import rollout_config
    from agentopd.splits import without_split

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", default="sql_db")
    ap.add_argument("--kind", default="solution", choices=("solution", "schema"))
    ap.add_argument("--num-tasks", type=int, default=100)
    ap.add_argument("--model", action="append", default=[], help="a model folder to check as well (repeatable)")
    ap.add_argument("--device", default="cpu", help="where the models play (cuda for the gpu-sized pair)")
    ap.add_argument("--json", type=Path, help="also write the table here as JSON: {model: {plain, privileged}}")
    ap.add_argument("overrides", nargs="*", help="dotted overrides (embedded.size=gpu: that pair's built-in models)")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    cfg = load_config(args.env, overrides=args.overrides)
    kwargs = without_split(cfg.env.kwargs)
    rollout = replace(rollout_config(cfg), temperature=0.0)
    print(f"{args.env}, teacher.privileged={args.kind}, {args.num_tasks} held-out tasks, greedy\n")
    print("| model | plain prompt | privileged prompt |\n|---|---|---|")
    models = [(f"builtin {role}", resolve_model("builtin", cfg.env.name, role, env_kwargs=cfg.env.kwargs, size=cfg.embedded.size,
                                                device=args.device))
              for role in ("student", "teacher")] + [(path, path) for path in args.model]  # fmt: skip
    table = {}
    for label, ref in models:
        plain = success(ref, cfg.env.name, kwargs, None, args.num_tasks, rollout, args.device)
        privileged = success(ref, cfg.env.name, kwargs, args.kind, args.num_tasks, rollout, args.device)
        table[label] = {"plain": plain, "privileged": privileged}
        print(f"| {label} | {plain:.0%} | {privileged:.0%} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"env": args.env, "kind": args.kind, "num_tasks": args.num_tasks, "models": table}))


if __name__ == "__main__":
    main()
