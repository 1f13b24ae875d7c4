"""The tables of benchmarks/vs_trl.py (issue 32) from its results dict: one row per side and task.

agentopd's split: rollout (generation and tool calls together: its agent loop runs them interleaved, many episodes
in flight), teacher scoring, train step, weight sync. TRL's: generation (transformers generate, every turn), tool
calls, teacher forward (inside its loss), and the rest of the optimizer step ("train"). Generated tok/s: tokens the
student sampled / generation (TRL) or rollout (agentopd) seconds. Trainer tok/s: tokens forwarded (prompt and
completion, no padding) / train seconds (agentopd: its train step; TRL: train + teacher, which its loss runs).
"""

from __future__ import annotations

import time

from _measured import commit_measured


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _loads(side: dict) -> str:
    return "/".join(f"{x:.1f}" for x in side["load_1min"]) if "load_1min" in side else "n/a"


def rows(task: str, r: dict, median) -> list[str]:
    out = []
    ours, trl = r["ours"], r["trl"]
    o_step, o_roll = median(ours["steps"], "wall_s"), median(ours["steps"], "rollout_s")
    o_teach, o_train = median(ours["steps"], "teacher_s"), median(ours["steps"], "train_s")
    o_gen, o_tok = median(ours["steps"], "generated_tokens"), median(ours["steps"], "trained_tokens")
    o_mem = max((s["peak_cuda_gib"] for s in ours["steps"] if s.get("peak_cuda_gib") is not None), default=None)
    o_cpu, t_cpu = median(ours["steps"], "cpu_s"), median(trl["steps"], "cpu_s")
    out.append(f"| {task} | agentopd | {_f(o_step)} | {_f(o_cpu)} | {_f(o_roll)} (with tools) | in rollout | {_f(o_teach)} | {_f(o_train)} "
               f"| {_f(o_gen / o_roll if o_gen and o_roll else None, '{:,.0f}')} "
               f"| {_f(o_tok / o_train if o_tok and o_train else None, '{:,.0f}')} "
               f"| {_f(ours['peak_rss_gib'])} | {_f(o_mem)} | {ours['held_out']:.2f} |")  # fmt: skip
    t_step, t_gen_s = median(trl["steps"], "wall_s"), median(trl["steps"], "generation_s")
    t_tool, t_teach, t_train = median(trl["steps"], "tools_s"), median(trl["steps"], "teacher_s"), median(trl["steps"], "train_s")
    t_gen, t_tok = median(trl["steps"], "generated_tokens"), median(trl["steps"], "trained_tokens")
    t_mem = trl.get("peak_cuda_reserved_gib")
    train_and_teacher = (t_train or 0) + (t_teach or 0)
    out.append(f"| {task} | TRL {trl['versions']['trl']} | {_f(t_step)} | {_f(t_cpu)} | {_f(t_gen_s)} | {_f(t_tool, '{:.4f}')} | {_f(t_teach)} "
               f"| {_f(t_train)} | {_f(t_gen / t_gen_s if t_gen and t_gen_s else None, '{:,.0f}')} "
               f"| {_f(t_tok / train_and_teacher if t_tok and train_and_teacher else None, '{:,.0f}')} "
               f"| {_f(trl['peak_rss_gib'])} | {_f(t_mem)} | {trl['held_out']:.2f} |")  # fmt: skip
    return out


def write_report(results: dict, args, median) -> str:
    commit = commit_measured()
    s = results["settings"]
    lines = [f"# agentopd vs TRL DistillationTrainer ({args.device}{', tiny' if args.tiny else ''})", "",
             f"date {time.strftime('%Y-%m-%d')}, commit {commit}; models: {results['models']}", "",
             (f"settings (both sides): {s['steps']} steps, {s['prompts_per_step']} prompts per step, 1 sample each, "
              f"temperature {s['temperature']} (sampling and loss), beta {s['beta']}, up to {s['max_new_tokens']} new "
              f"tokens per turn, lr {s['lr']} constant, AdamW betas {s['betas']}, weight decay {s['weight_decay']}, "
              f"grad clip {s['grad_clip']}"), "",
             ("| task | side | s/step | CPU s/step | generation s | tools s | teacher s | train s | generated tok/s "
              "| trainer tok/s | peak RSS GiB | peak CUDA GiB (reserved) | held-out success |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for task, r in results["tasks"].items():
        lines += rows(task, r, median)
    lines.append("")
    lines.append("Medians over steps 2..N. Held-out success: greedy, agentopd.evaluate, the env's eval split. "
                 f"Sides run one after the other ({'TRL first' if args.trl_first else 'agentopd first'}).")
    for task, r in results["tasks"].items():
        lines.append(f"- {task}: initial student {r['initial_held_out']:.2f}; {r['train_prompts']} train prompts; "
                     f"TRL max_completion_length {r['max_completion_length']}; process wall s: agentopd "
                     f"{r['ours']['process_wall_s']:.1f}, TRL {r['trl']['process_wall_s']:.1f}; 1-min load average "
                     f"before/after: agentopd {_loads(r['ours'])}, TRL {_loads(r['trl'])}")  # fmt: skip
        d = r.get("trl_drift")
        if d:
            lines.append(f"  TRL streams (every step) through agentopd's drift checker: {d['token_exact']}/{d['samples']} "
                         f"token-exact ({d['with_tool_results']} with tool results); findings {d['findings']}")  # fmt: skip
            lines += [f"    - {e}" for e in d["examples"][:3]]
    return "\n".join(lines)
