"""agentopd against TRL's DistillationTrainer (issue 32): the same models, tasks, loss and settings, each side as a
user runs it; per-step time and its split, tokens/s, peak memory, held-out success by agentopd's evaluator, and
whether TRL's tool-task streams are token-exact.

    python benchmarks/vs_trl.py --out DIR                                   # CPU: the embedded sql_db pair
    python benchmarks/vs_trl.py --out DIR --tiny                            # the GPU path at toy sizes (a smoke test)
    python benchmarks/vs_trl.py --device cuda --tokenizer .gpu/qwen3 --out DIR   # one GPU: Qwen3-0.6B / 1.7B shapes
    options: --tasks sql_db,math  --steps N  --prompts N  --beta 0|0.5|1  --lr X (CPU)  --eval-tasks N
             --trl-python .venv-trl/bin/python (default)  --trl-path DIR (PYTHONPATH of TRL's side)

On the GPU machines (no internet, no TRL) TRL's side runs from wheels installed into a folder, with stand-ins for
datasets and pyarrow (see vs_trl_trl_side.py); benchmarks/results/vs_trl.md has the command.

Runs in agentopd's venv; TRL's side (benchmarks/vs_trl_trl_side.py) runs in TRL's own venv (`--trl-python`), which
needs trl and its dependencies only. Both sides get the same student/teacher folders (weights, tokenizer and chat
template), the same train tasks (TRL: the env's train-split prompts as a list of conversations; the sql_db tool
`sql_query` as a plain Python function over the same database), the same divergence (TRL `beta` 0 / 0.5 / 1 =
`trainer.loss` forward_kl / jsd / reverse_kl), sampling temperature, prompts per step, one sample per prompt, new
tokens per turn, turns, learning rate and AdamW settings (constant schedule). Each side's final student is then
played greedily on the same held-out tasks by `agentopd.evaluate`.

The chat template is Qwen3's own (the file trl ships, trl/chat_templates/qwen3.jinja): TRL parses tool calls only
for templates it recognises by exact text, and agentopd's Qwen3-style template is not one of them. agentopd reads
Qwen3's template as the hermes format. On CPU the embedded models are copied with that template in place of theirs
(their prompts render to the same tokens). Writes DIR/vs_trl.md and DIR/vs_trl.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
LOSS_OF_BETA = {0.0: "forward_kl", 0.5: "jsd", 1.0: "reverse_kl"}  # TRL's beta -> agentopd's trainer.loss


def settings(args: argparse.Namespace) -> dict:
    """What both sides share (CPU: the sql_db preset's rollout and learning rate; GPU: gpu_opd.py's sizes)."""
    gpu = args.device == "cuda" and not args.tiny
    return {
        "steps": args.steps, "prompts_per_step": args.prompts or 16, "temperature": 0.5,
        "max_new_tokens": 128 if gpu else 96, "max_turns": 3 if gpu else 4, "lr": 1e-5 if gpu else args.lr,
        "betas": [0.9, 0.95], "weight_decay": 0.0, "grad_clip": 1.0, "beta": args.beta, "seed": 0,
        "device": args.device,
    }  # fmt: skip


def qwen3_template() -> str:
    from importlib.resources import files

    return (files("trl") / "chat_templates" / "qwen3.jinja").read_text()


def prepare_models(args: argparse.Namespace, work: Path) -> tuple[Path, Path, str]:
    """Student and teacher folders both sides load; returns (student, teacher, what they are)."""
    if args.tokenizer is None and not args.tiny:  # CPU: the embedded pair, with Qwen3's own template
        from agentopd.bootstrap import bootstrap

        built = bootstrap("sql_db")
        for role, src in (("student", built.student_dir), ("teacher", built.teacher_dir)):
            dst = work / role
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst)
            (dst / "chat_template.jinja").write_text(qwen3_template())
        return work / "student", work / "teacher", "the embedded sql_db pair (agentopd bootstrap)"
    import torch
    from gpu_opd import build
    from transformers import AutoTokenizer

    if args.tokenizer is not None:
        from agentopd.vocab import read_vocab_info

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        rows = read_vocab_info(args.tokenizer).get("model_rows", len(tok))
    else:  # --tiny without a tokenizer: the embedded one, with Qwen3's template
        from agentopd.bootstrap import BootstrapSpec, ensure_tokenizer

        tok = ensure_tokenizer(BootstrapSpec())
        tok.chat_template = qwen3_template()
        rows = len(tok)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shapes = ("tiny-s", "tiny-t") if args.tiny else ("qwen3-0.6b", "qwen3-1.7b")
    n = [build(shape, tok, work / role, dtype, rows) for shape, role in zip(shapes, ("student", "teacher"))]
    what = f"{shapes[0]} ({n[0] / 1e6:.1f}M) / {shapes[1]} ({n[1] / 1e6:.1f}M), random weights, {len(tok):,} tokens, {rows:,} rows"
    return work / "student", work / "teacher", what


def env_kwargs(task: str) -> dict:
    from agentopd.bootstrap import preset_env_kwargs

    return {k: v for k, v in preset_env_kwargs(task).items() if k != "split"}


def trl_spec(task: str, common: dict, student: Path, teacher: Path) -> dict:
    """TRL's inputs: the env's train-split prompts (system + user messages) and, for sql_db, its database."""
    from agentopd.splits import make_env_for_split

    kwargs = env_kwargs(task)
    env = make_env_for_split(task, "train", **kwargs)
    prompts = [env.reset(options={"task_id": t.id})[0] for t in env.tasks]
    tools = env.reset(options={"task_id": env.tasks[0].id})[1]["tools"]
    spec = {**common, "task": task, "student": str(student), "teacher": str(teacher), "prompts": prompts,
            "tool_schemas": tools}  # fmt: skip
    turns = common["max_turns"] if task == "sql_db" else 1
    spec["max_turns"] = turns
    spec["max_completion_length"] = turns * common["max_new_tokens"]  # TRL's whole-completion budget (tool results count)
    if task == "sql_db":
        spec["db_path"] = str(env.db.path)
        spec["db_kwargs"] = {"query_timeout_s": env.db.query_timeout_s, "max_rows": env.db.max_rows,
                             "max_output_chars": env.db.max_output_chars, "hints": env.db.hints}  # fmt: skip
    env.close()
    return spec


def cpu_seconds(pid: int) -> float:
    """utime + stime of a running process, all its threads (what time.process_time() gives inside it)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_timed(cmd: list[str], log: Path, env: dict | None = None, lines: Path | None = None) -> tuple[int, float, float, list[tuple[float, float]]]:
    """Run `cmd`; (return code, wall seconds, peak RSS GiB of the process — its own rusage, not the driver's —, and
    for each line of the file `lines` the wall and CPU seconds of the process when it appeared, polled every 10 ms).
    CPU seconds are the measure that the machine's other load disturbs least (2 shared cores)."""
    t = time.perf_counter()
    stamps: list[tuple[float, float]] = []
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if lines is not None and lines.exists():
                n = lines.read_bytes().count(b"\n")
                if n > len(stamps):
                    try:
                        cpu = cpu_seconds(proc.pid)
                    except (FileNotFoundError, ProcessLookupError, IndexError):
                        cpu = float("nan")
                    stamps += [(time.perf_counter() - t, cpu)] * (n - len(stamps))
            if pid:
                break
            time.sleep(0.01)
    return os.waitstatus_to_exitcode(status), time.perf_counter() - t, usage.ru_maxrss / 2**20, stamps


def run_ours(task: str, common: dict, student: Path, teacher: Path, out: Path, work: Path) -> dict:
    run = work / f"ours_{task}"  # the run directory beside the models: --out keeps the reports and logs alone
    shutil.rmtree(run, ignore_errors=True)
    turns = common["max_turns"] if task == "sql_db" else 1
    loss = LOSS_OF_BETA[common["beta"]]
    cmd = [sys.executable, "-m", "agentopd.cli", "run", "--env", task, "--run-dir", str(run),
           f"student={student}", f"teacher={teacher}", f"steps={common['steps']}",
           f"rollout.tasks_per_step={common['prompts_per_step']}", "rollout.n=1",
           f"rollout.max_new_tokens={common['max_new_tokens']}", f"rollout.max_turns={turns}",
           f"rollout.temperature={common['temperature']}", f"trainer.temperature={common['temperature']}",
           f"trainer.loss={loss}", f"trainer.beta={common['beta']}", f"trainer.lr={common['lr']}",
           f"trainer.betas={common['betas']}", f"trainer.weight_decay={common['weight_decay']}",
           f"trainer.grad_clip={common['grad_clip']}", "trainer.schedule=constant", "trainer.warmup_steps=0",
           "eval.every=0", "run.checkpoint_every=0", "log.tensorboard=false", f"run.seed={common['seed']}",
           "teacher.selftest=false"]  # fmt: skip  # the GPU leg's random weights are a uniform teacher; TRL has no self-test
    load = os.getloadavg()[0]
    rc, wall, rss, stamps = run_timed(cmd, out / f"ours_{task}.log", lines=run / "metrics.jsonl")
    if rc != 0:
        raise SystemExit(f"agentopd run failed ({rc}); see {out / f'ours_{task}.log'}")
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = []
    for i, r in enumerate(records):  # a step's wall time: from the previous metrics line to its own
        if "loss" not in r:
            continue
        parts = {k: r.get(f"perf/{k}_s", 0.0) for k in ("rollout", "teacher", "train_step", "weight_sync")}
        timed = i > 0 and "eval/success_rate" not in r  # an eval step's line also waits for the eval
        steps.append({"step": r.get("step"), "wall_s": stamps[i][0] - stamps[i - 1][0] if timed else None,
                      "cpu_s": stamps[i][1] - stamps[i - 1][1] if timed else None,
                      "rollout_s": parts["rollout"], "teacher_s": parts["teacher"], "train_s": parts["train_step"],
                      "sync_s": parts["weight_sync"], "generated_tokens": r.get("tool_mask/llm_tokens"),
                      "trained_tokens": r.get("train/tokens"),
                      "peak_cuda_gib": max((v for k, v in r.items() if k.startswith("mem/") and k.endswith("_peak_gib")),
                                           default=None)})  # fmt: skip  # measured (reserved), not the plan's _plan_gib
    return {"steps": steps, "process_wall_s": wall, "peak_rss_gib": rss, "final": str(run / "final"), "cmd": cmd[3:],
            "load_1min": [load, os.getloadavg()[0]]}  # fmt: skip


def run_trl(task: str, spec: dict, out: Path, work: Path, trl_python: str, trl_path: str) -> dict:
    side = work / f"trl_{task}"
    shutil.rmtree(side, ignore_errors=True)
    side.mkdir(parents=True)
    (side / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": trl_path}  # TRL's venv (or folder) alone: nothing of agentopd's
    load = os.getloadavg()[0]
    rc, wall, rss, _ = run_timed([trl_python, str(HERE / "vs_trl_trl_side.py"), str(side / "spec.json"), str(side)],
                              out / f"trl_{task}.log", env)  # fmt: skip
    if rc != 0:
        raise SystemExit(f"TRL side failed ({rc}); see {out / f'trl_{task}.log'}")
    result = json.loads((side / "trl_result.json").read_text())
    return {**result, "process_wall_s": wall, "peak_rss_gib": rss, "load_1min": [load, os.getloadavg()[0]]}


def held_out(task: str, model: str, tokenizer: Path, common: dict, num_tasks: int) -> float:
    from transformers import AutoTokenizer

    from agentopd.evaluate import evaluate
    from agentopd.models import pick_device
    from agentopd.rollout import RolloutConfig

    turns = common["max_turns"] if task == "sql_db" else 1
    rollout = RolloutConfig(temperature=0.0, max_turns=turns, max_new_tokens=common["max_new_tokens"])
    tok = AutoTokenizer.from_pretrained(tokenizer)
    device, dtype = pick_device(common["device"])  # as `agentopd eval` does: bf16 on CUDA, fp32 on CPU
    result = evaluate(model, tok, task, env_kwargs=env_kwargs(task), split="eval", num_tasks=num_tasks, rollout=rollout,
                      engine_kind="auto", engine_kwargs={"device": device, "dtype": dtype, "seed": 0})  # fmt: skip
    return result.success_rate


def median(steps: list[dict], key: str) -> float | None:
    """Median over steps 2..N (step 1 pays one-off start-up), or step 1 alone when there is one."""
    vals = [s[key] for s in (steps[1:] or steps) if s.get(key) is not None]
    return statistics.median(vals) if vals else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tiny", action="store_true", help="toy random models: the GPU path's smoke test")
    ap.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer folder (agentopd make-tokenizer qwen3 DIR)")
    ap.add_argument("--tasks", default="sql_db,math")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default 16)")
    ap.add_argument("--beta", type=float, default=0.0, choices=sorted(LOSS_OF_BETA))
    ap.add_argument("--eval-tasks", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-3, help="CPU learning rate (GPU: 1e-5)")
    ap.add_argument("--trl-python", default=str(HERE.parent / ".venv-trl" / "bin" / "python"), help="TRL's interpreter")
    ap.add_argument("--trl-first", action="store_true", help="run TRL's side before ours")
    ap.add_argument("--work", type=Path, default=Path("/tmp/vs_trl"), help="where the models are built or copied")
    ap.add_argument("--trl-path", default="", help="PYTHONPATH of TRL's side, e.g. a `pip install --target` folder")
    args = ap.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    # models outside OUT (not sent back from a device call); built ones are reused by a later call on the same machine
    work = args.work / ("tiny" if args.tiny else args.tokenizer.name if args.tokenizer else "embedded")
    work.mkdir(parents=True, exist_ok=True)
    from vs_trl_drift import check_trl_streams
    from vs_trl_report import write_report

    common = settings(args)
    student, teacher, models = prepare_models(args, work)
    results = {"settings": common, "models": models, "tasks": {}}
    base = {t: held_out(t, str(student), student, common, args.eval_tasks) for t in args.tasks.split(",")}
    for task in args.tasks.split(","):
        spec = trl_spec(task, common, student, teacher)
        if args.trl_first:  # the other order, to see what the machine's load did to either side
            trl = run_trl(task, spec, args.out, work, args.trl_python, args.trl_path)
            ours = run_ours(task, common, student, teacher, args.out, work)
        else:
            ours = run_ours(task, common, student, teacher, args.out, work)
            trl = run_trl(task, spec, args.out, work, args.trl_python, args.trl_path)
        ours["held_out"] = held_out(task, ours["final"], student, common, args.eval_tasks)
        trl["held_out"] = held_out(task, trl["final"], student, common, args.eval_tasks)
        drift = check_trl_streams(work / f"trl_{task}" / "trl_streams.json", student, spec["tool_schemas"]) if task == "sql_db" else None
        results["tasks"][task] = {"ours": ours, "trl": trl, "initial_held_out": base[task], "trl_drift": drift,
                                  "train_prompts": len(spec["prompts"]),
                                  "max_completion_length": spec["max_completion_length"]}  # fmt: skip
        (args.out / "vs_trl.json").write_text(json.dumps(results, indent=1, default=str))
    text = write_report(results, args, median)
    print(text)
    (args.out / "vs_trl.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
