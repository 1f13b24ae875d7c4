"""Zero-shot held-out success of real checkpoints on the built-in envs, before and after the changes that let a model
that has never seen them play (tool-call parsing, sql_db's prompt).

    python benchmarks/real_zero_shot.py --tasks 50                      # the three catalogue models, three envs

Each model is a name of `agentopd fetch-model --list` (fetched and converted once; nothing downloaded at run time
when cached) or a folder. Greedy, the fast engine, the checkpoint's stored dtype (bf16), the env preset's rollout
settings with `--new-tokens` new tokens a turn, the model's own chat template, and an episode timeout of 2 hours (at the
default 300 s a 1.5B model on 2 busy cores lost 31 of 50 math episodes to it: what it measured was the machine). Two arms:
- before: `rollout.tool_parsing=strict` (only `<tool_call>` blocks are calls: what the loop read before) and sql_db
  without its tables (`env.schema_in_prompt=false`: the prompt it had);
- after: `tool_parsing` lenient (the default: bare or fenced JSON naming an offered tool, agentopd.chat.bare_calls),
  sql_db with its tables and the prompt that says to query (`env.schema_in_prompt=true`).
math offers no tools and its prompt did not change: one arm. Per cell: success, tool calls and parse errors per turn,
seconds. Writes a JSON line per cell to --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoTokenizer

from agentopd.config import load_config
from agentopd.evaluate import evaluate
from agentopd.gguf_fetch import CATALOGUE, fetch_model
from agentopd.policy import rollout_config
from agentopd.shape import stored_in_bf16
from agentopd.splits import without_split


ARMS = {"before": ["rollout.tool_parsing=strict"], "after": []}
ENV_ARMS = {"sql_db": {"before": ["env.schema_in_prompt=false"], "after": ["env.schema_in_prompt=true"]}}


def cell(model: Path, env: str, tasks: int, arm: str, new_tokens: int, overrides: list[str]) -> dict:
    arm_overrides = ARMS[arm] + ENV_ARMS.get(env, {}).get(arm, [])
    cfg = load_config(env, overrides=[*arm_overrides, f"rollout.max_new_tokens={new_tokens}", "rollout.max_context=4096",
                                      "rollout.episode_timeout_s=7200", *overrides])  # fmt: skip
    dtype = torch.bfloat16 if stored_in_bf16(model) else torch.float32
    t0 = time.perf_counter()
    r = evaluate(str(model), AutoTokenizer.from_pretrained(model), cfg.env.name, env_kwargs=without_split(cfg.env.kwargs),
                 split="eval", num_tasks=tasks, rollout=replace(rollout_config(cfg), temperature=0.0), engine_kind="fast",
                 engine_kwargs={"device": torch.device("cpu"), "dtype": dtype, "seed": 0})  # fmt: skip
    turns = [t for e in r.episodes for t in e.turns]
    return {"model": model.name, "env": env, "arm": arm, "parsing": cfg.rollout.tool_parsing, "tasks": r.num_tasks, "success": r.success_rate,
            "turns": len(turns), "tool_calls_per_turn": sum(sum(t.tool_calls.values()) for t in turns) / max(len(turns), 1),
            "parse_errors_per_turn": sum(t.parse_error for t in turns) / max(len(turns), 1),
            "tool_error_rate": r.tool_error_rate, "stop_reasons": r.stop_reasons, "seconds": round(time.perf_counter() - t0, 1), "overrides": arm_overrides + overrides}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(CATALOGUE))
    ap.add_argument("--envs", default="math,calculator,sql_db")
    ap.add_argument("--tasks", type=int, default=50)
    ap.add_argument("--arms", default="before,after")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("real_zero_shot.jsonl"))
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every cell (env.max_turns=4 ...)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = []
    for name in args.models.split(","):
        model = fetch_model(name) if name in CATALOGUE else Path(name)
        for env in args.envs.split(","):
            for arm in args.arms.split(",") if env != "math" else ["after"]:  # math: no tools, the same prompt
                row = cell(model, env, args.tasks, arm, args.new_tokens, args.overrides)
                rows.append(row)
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{row['model']:<22} {env:<11} {arm:<7} success {row['success']:6.1%}  calls/turn "
                      f"{row['tool_calls_per_turn']:.2f}  parse errors/turn {row['parse_errors_per_turn']:.2f}  {row['seconds']:.0f} s",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
