"""benchmarks/quality.py's arms on the gpu-sized embedded pair (embedded.size=gpu), on one GPU lent ten minutes a call.

    # a GPU call (only what is under $OUT comes back): build the pair (~3 min; cached in /tmp, which a machine still
    # warm from the last call keeps), then run the arms of the --seed seeds (0, or 1,2 in turn) that the bundle lacks
    # until --budget-s, rewriting the bundle (in $OUT and --work) after every finished run
    python benchmarks/quality_gpu.py --env sql_db --seed 0 --out $OUT [--resume quality_gpu.json]
    # a call started while the machine is still warm: the last call's bundle and pair are still in --work
    python benchmarks/quality_gpu.py --env sql_db --seed 1,2 --out $OUT --resume /tmp/quality_gpu/quality_gpu.json
    # a sweep longer than a call (the explore family): a process session of its own outlives the call while the
    # machine stays warm (it goes back after 30 s idle), so no run stops between calls; each call, this one and the
    # next ones, brings back the bundle as it stands. The same command serves every call: a machine that went back
    # between two calls (a reply 30 s late, or its 30 minutes of holding, start included, spent: two full calls and
    # a short one) comes fresh, without the log, and the sweep starts again there from --resume instead of the call
    # sleeping beside nothing (on 2026-11-28 a whole call was lost that way). Send the next call the moment a reply
    # comes, with no other step between (on 2026-11-28 a copy made first cost the machine: the next call met a fresh
    # one, which built a pair again), and merge each reply's bundle into the checkout's afterwards (--merge below)
    [ -f /tmp/quality_gpu.log ] || setsid python benchmarks/quality_gpu.py --env sql_db_explore ... \
        --out /tmp/quality_gpu/out --budget-s 1e9 --stop-s 1e9 > /tmp/quality_gpu.log 2>&1 < /dev/null &
    for i in $(seq 55); do sleep 10; cp /tmp/quality_gpu/out/quality_gpu.json $OUT/ 2>/dev/null; done; tail /tmp/quality_gpu.log
    # here, after each call: the bundle it brought back (CALL_OUT: its $OUT) into the checkout's (a call that met a
    # fresh machine brings back the checkout's runs plus its own, on a pair of its own; runs both bundles hold keep
    # the first one's result)
    python benchmarks/quality_gpu.py --resume benchmarks/results/quality_gpu_X.json --merge CALL_OUT/quality_gpu.json
    # here, once the arms are in: quality.py's tables and curves of the bundle
    python benchmarks/quality_gpu.py --resume quality_gpu.json --report benchmarks/results/quality_gpu.md
    # the whole path on the CPU in a minute (the test size, 2 steps; tests/test_quality_gpu.py)
    python benchmarks/quality_gpu.py --tiny --out /tmp/quality_gpu

The bundle, `<out>/quality_gpu.json` (one file: a call returns at most a few), holds what the runs share (env, size,
steps, overrides), each call's pair (its bootstrap report: the models themselves, ~700 MB in fp32, do not come back,
so each call builds the pair again: seeded, but GPU kernels are not bit-exact, so every call's pair is kept and each
result names the pair it ran on) and every run's result as quality.py writes it. The next call's --resume is that
file put in the checkout (the working tree travels to the GPU machine; the bundle is a few hundred KB). A run still
going at --stop-s is stopped as Ctrl-C stops a run (it finishes its step and checkpoints it): a call started while
the machine is still warm continues it from there (its run directory and the pair are in --work); on a fresh machine
it starts over. --budget-s stops launching runs. Every run starts from the pair's student, `embedded.size=gpu
run.device=cuda`, at the student's own SFT learning rate.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_spec = importlib.util.spec_from_file_location("quality", Path(__file__).with_name("quality.py"))
quality = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quality)
_spec = importlib.util.spec_from_file_location("_measured", Path(__file__).with_name("_measured.py"))
_measured = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_measured)

ARMS = ("sft", "opd", "sft_then_opd", "sft_late_opd", "opd_mixed", "opd_self_privileged", "opd_horizon")
BUNDLE = "quality_gpu.json"
SHARED = ("env", "size", "steps", "eval_every", "privileged", "overrides")  # what every result of a bundle has in common
# --tiny: the test-size pair on the CPU, runs of 2 steps on 2 tasks: the whole path in about a minute
TINY = ["rollout.tasks_per_step=2", "rollout.max_new_tokens=16", "rollout.max_turns=2", "eval.num_tasks=2",
        "teacher.selftest=false"]  # --tiny's embedded.size=test teacher is barely trained: near uniform, which the self-test refuses


def run_overrides(args: argparse.Namespace) -> list[str]:
    """What every run of the bundle is given: the pair's size and device, the student's own SFT learning rate (the
    presets' is the tiny student's), then the user's. On the GPU, --jobs runs share the card: the fast engine with a
    KV pool of its own size (vLLM would take half the card per run; the default pool is 16 GiB), 4 GiB: a step's 32
    contexts of 1,024 tokens take ~0.3 GiB of the student's KV (8 layers x 4 KV heads x 64 x 2 x bf16), the teacher's
    greedy eval ~0.8 GiB."""
    from agentopd.bootstrap import default_spec, sized_spec

    lr = sized_spec(default_spec(args.env), args.size).student.lr  # a preset's (sql_db_explore) recipe is its own
    placement = TINY + ["run.device=cpu"] if args.tiny else ["run.device=cuda", "engine.kind=fast", "engine.kv_cache_gib=4"]
    return [f"embedded.size={args.size}", f"trainer.lr={lr:g}", *placement, *args.overrides]


def load_bundle(args: argparse.Namespace) -> dict:
    """The bundle of --resume (checked to be of the same runs), else a new one."""
    shared = {"env": args.env, "size": args.size, "steps": args.steps, "eval_every": args.eval_every, "privileged": args.privileged,
              "overrides": run_overrides(args)}  # fmt: skip
    if args.resume is None:
        return {**shared, "pairs": [], "results": {}}
    bundle = json.loads(args.resume.read_text())
    changed = [k for k in SHARED if bundle.get(k) != shared[k]]
    if changed:
        raise SystemExit(f"--resume {args.resume}: its runs differ in {', '.join(changed)} "
                         f"({', '.join(f'{k}={bundle.get(k)!r}' for k in changed)}); give the same options or start a new bundle")  # fmt: skip
    return bundle


def merge_bundles(into: dict, other: dict, name: str = "the other bundle") -> list[str]:
    """`other`'s pairs and runs added to `into` (in place): a pair recorded in both is kept once, each added run points
    at its pair's place in `into`, and a run both hold with different results keeps `into`'s (the first one run;
    the other is named in what this returns, with what was added)."""
    changed = [k for k in SHARED if into.get(k) != other.get(k)]
    if changed:
        raise SystemExit(f"--merge {name}: its runs differ in {', '.join(changed)} "
                         f"({', '.join(f'{k}={other.get(k)!r}' for k in changed)}); only bundles of the same runs merge")  # fmt: skip
    where = {}
    for i, pair in enumerate(other["pairs"]):
        if pair not in into["pairs"]:
            into["pairs"].append(pair)
        where[i] = into["pairs"].index(pair)
    said = []
    for run, result in other["results"].items():
        result = {**result, "pair": where[result["pair"]]}
        if run not in into["results"]:
            into["results"][run] = result
            said.append(f"added {run} (pair {result['pair']})")
        elif into["results"][run] != result:
            said.append(f"kept {run} of pair {into['results'][run]['pair']}, not {name}'s of pair {result['pair']}")
    return said


def write_bundle(bundle: dict, *outs: Path) -> None:
    """Atomically, into each folder: a call killed at its limit still leaves a whole bundle behind."""
    for out in outs:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".{BUNDLE}.tmp"
        tmp.write_text(json.dumps(bundle, indent=1))
        tmp.replace(out / BUNDLE)


def build_pair(args: argparse.Namespace, home: Path) -> dict:
    """`agentopd bootstrap` of the pair (a process of its own: this one never holds the GPU), and its report."""
    from agentopd.bootstrap import bootstrap

    t0 = time.perf_counter()
    size_overrides = [o for o in run_overrides(args) if o.startswith(("embedded.", "run.device"))]
    cmd = [sys.executable, "-m", "agentopd.cli", "bootstrap", "--env", args.env, *size_overrides]
    subprocess.run(cmd, env=dict(os.environ, AGENTOPD_HOME=str(home)), check=True)
    report = bootstrap(args.env, size=args.size, home=home).report  # the cache just built: nothing trained here
    return {**report, "built_s": round(time.perf_counter() - t0, 1), "machine": machine(), "commit": _measured.commit_measured(),
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


def context_check(args: argparse.Namespace, home: Path) -> dict:
    """Greedy held-out success of the pair with the plain prompt and with the privileged one
    (benchmarks/privileged_context.py): a privileged teacher can only help where its privileged column beats its plain
    one. A check that fails is recorded as such; the arms still run."""
    out = args.work / "context.json"
    device, num_tasks = ("cpu", 2) if args.tiny else ("cuda", 100)
    script = Path(__file__).with_name("privileged_context.py")
    sized = [o for o in run_overrides(args) if o.startswith("embedded.")]
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, str(script), "--env", args.env, "--kind", args.privileged, "--num-tasks", str(num_tasks),
                           "--device", device, "--json", str(out), *sized],
                          env=dict(os.environ, AGENTOPD_HOME=str(home)), capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        print(f"privileged-context check failed (exit {done.returncode}):\n{done.stderr[-2000:]}", flush=True)
        return {"error": done.stderr[-500:], "seconds": round(time.perf_counter() - t0, 1)}
    print(done.stdout, flush=True)
    return {**json.loads(out.read_text()), "seconds": round(time.perf_counter() - t0, 1)}


def same_pair(a: dict, b: dict) -> bool:
    """The same built pair (a warm machine's cache read again): everything but when and where it was read."""
    skip = ("built_s", "machine", "context", "commit", "date")
    return {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {gpu}, torch {torch.__version__}"


def quality_args(args: argparse.Namespace, bundle: dict) -> argparse.Namespace:
    """The namespace quality.py's plan_runs / report read."""
    return argparse.Namespace(env=[args.env], methods=args.methods, seeds=max(args.seeds) + 1, steps=args.steps, eval_every=args.eval_every,
                              intervene_below=-1.0, support_below=0.3, privileged=args.privileged, work=args.work,
                              overrides=bundle["overrides"], report_only=False)  # fmt: skip


def run_arms(args: argparse.Namespace, bundle: dict, home: Path, deadline: float, stop_at: float) -> None:
    """The runs of the --seed seeds the bundle lacks (seed by seed, runs stopped by an earlier call first), --jobs at
    a time, none launched past `deadline`, the ones still playing at `stop_at` stopped with a checkpoint (the next
    call on this machine continues them); the bundle rewritten after each finished run. A pair already in the bundle
    (a warm machine's cache) is not added again."""
    qargs = quality_args(args, bundle)
    specs = [s for s in quality.plan_runs(qargs) if s["seed"] in args.seeds and Path(s["result"]).stem not in bundle["results"]]
    # runs an earlier call stopped with a checkpoint (a warm machine keeps them) first: they are the nearest to done
    specs.sort(key=lambda s: (not (Path(s["run_dir"]) / "checkpoints").is_dir(), args.seeds.index(s["seed"])))
    if not specs:
        print(f"every arm of seed(s) {args.seeds} is in the bundle", flush=True)
        return
    built = build_pair(args, home)
    if bundle["pairs"] and same_pair(built, bundle["pairs"][-1]):
        print("the pair is the bundle's last one (cached on this machine)", flush=True)
    else:
        bundle["pairs"].append(built)
    if any("privileged" in m for m in args.methods) and "context" not in bundle["pairs"][-1]:
        bundle["pairs"][-1]["context"] = context_check(args, home)  # once a pair: before the arms, which need it
    write_bundle(bundle, args.out, args.work)
    pair = len(bundle["pairs"]) - 1
    lock = threading.Lock()
    os.environ["AGENTOPD_HOME"] = str(home)  # the workers find the pair there

    def one(spec: dict) -> None:
        name = Path(spec["result"]).stem
        if time.monotonic() > deadline:
            print(f"not started (--budget-s): {name}", flush=True)
            return
        result = quality.launch(spec)
        if result is not None:
            with lock:
                bundle["results"][name] = {**result, "pair": pair}
                write_bundle(bundle, args.out, args.work)

    stop = threading.Timer(max(0.0, stop_at - time.monotonic()), quality.stop_runs)
    stop.daemon = True
    stop.start()
    try:
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(one, specs))
    finally:
        stop.cancel()


def write_report(args: argparse.Namespace, bundle: dict) -> None:
    """quality.py's markdown (and PNG beside it) of every result in the bundle, headed by the pairs they ran on."""
    results = list(bundle["results"].values())
    methods = [m for m in quality.METHODS if any(r["method"] == m for r in results)]
    qargs = argparse.Namespace(env=[bundle["env"]], methods=methods, overrides=bundle["overrides"])
    args.report.parent.mkdir(parents=True, exist_ok=True)
    png: Path | None = args.report.with_suffix(".png")
    try:
        quality.plot(results, qargs.env, methods, png)
    except ImportError as e:  # the tables still get written
        print(f"no plot: {e} (pip install matplotlib)", file=sys.stderr)
        png = None
    seeds = sorted({r["seed"] for r in results})
    effective = {o.split("=", 1)[0]: o for o in bundle["overrides"]}.values()  # a user's key over the script's own
    # the privileged context reaches the runs only through privileged arms, and the pairs' context checks
    privileged = f"--privileged {bundle['privileged']} " if any("context" in p for p in bundle["pairs"]) else ""
    head = [f"# Quality on the gpu-sized embedded pair (embedded.size={bundle['size']})", "",
            f"`python benchmarks/quality_gpu.py --env {bundle['env']} --steps {bundle['steps']} --eval-every {bundle['eval_every']} "
            f"{privileged}--methods {','.join(methods)} --seed {','.join(map(str, seeds))} --out $OUT --resume quality_gpu.json` (in as many calls "
            f"as it takes; each call's pair below); every run: `{' '.join(effective)}`.", "",
            "| pair | built (date, commit) | machine | teacher | student | built in |", "|---|---|---|---|---|---|"]  # fmt: skip
    for i, p in enumerate(bundle["pairs"]):
        t, s = p["teacher"], p["student"]
        head.append(f"| {i} | {p.get('date', '?')}, {p.get('commit', '?')} | {p['machine']} | {t['parameters'] / 1e6:.1f}M, {t['success']:.0%} held-out, {t['steps']} steps | "
                    f"{s['parameters'] / 1e6:.1f}M, {s['success']:.0%} held-out, {s['steps']} steps | {p['built_s']:.0f} s |")  # fmt: skip
    checks = [(i, p["context"]) for i, p in enumerate(bundle["pairs"]) if p.get("context", {}).get("models")]
    if checks:
        head += ["", f"Does the pair read the privileged context (`{checks[0][1]['kind']}`)? Greedy held-out success with the plain "
                     "prompt and the privileged one (benchmarks/privileged_context.py):", "",
                 "| pair | model | plain | privileged | tasks |", "|---|---|---|---|---|"]  # fmt: skip
        for i, c in checks:
            head += [f"| {i} | {m} | {v['plain']:.0%} | {v['privileged']:.0%} | {c['num_tasks']} |" for m, v in c["models"].items()]
    args.report.write_text("\n".join(head) + "\n\n" + quality.report(results, qargs, png))
    print(f"wrote {args.report}" + (f" and {png.name}" if png else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", default="sql_db", help="an env or preset (sql_db, sql_db_explore, calculator, ...)")
    ap.add_argument("--seed", default="0", help="the seed(s) this call runs, in turn: 0 or 1,2")
    ap.add_argument("--methods", default=",".join(ARMS), help=f"comma-separated subset of {','.join(quality.METHODS)}")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--privileged", default="solution", choices=("solution", "schema"))
    ap.add_argument("--jobs", type=int, default=3, help="runs at once (they share the GPU; five sql_db runs of the "
                    "gpu pair showed 71 GiB used on an 80 GB H100 at nvidia-smi's minute samples, eight lost 10 of 15 runs)")
    ap.add_argument("--budget-s", type=float, default=420, help="launch no run after this many seconds of the call")
    ap.add_argument("--stop-s", type=float, default=540,
                    help="after this many seconds of the call, stop the runs still playing with a checkpoint (each "
                         "finishes its step first); a next call on the still-warm machine continues them")
    ap.add_argument("--out", type=Path, help="where the bundle is written ($OUT on the GPU machine)")
    ap.add_argument("--resume", type=Path, help="a bundle of an earlier call: its runs are not run again")
    ap.add_argument("--work", type=Path, default=Path("/tmp/quality_gpu"), help="run directories, results and AGENTOPD_HOME")
    ap.add_argument("--merge", type=Path, action="append", help="add this bundle's pairs and runs to --resume's, in place; "
                    "run nothing (a call that met a fresh machine brings back a bundle beside the last call's)")
    ap.add_argument("--report", type=Path, help="write the markdown report of the bundle here (and a PNG beside it); run nothing")
    ap.add_argument("--tiny", action="store_true", help="the test-size pair on the CPU, 2 steps of 2 tasks: the path, not a result")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every run")
    args = ap.parse_args()
    t0 = time.monotonic()
    try:
        args.seeds = [int(x) for x in args.seed.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--seed {args.seed!r}: a seed or a comma-separated list of seeds (0 or 1,2)")
    if not args.seeds or min(args.seeds) < 0:
        ap.error(f"--seed {args.seed!r}: seeds are integers >= 0")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(quality.METHODS))
    if unknown:
        ap.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(quality.METHODS)}")
    args.size = "test" if args.tiny else "gpu"
    if args.tiny:
        args.steps, args.eval_every = 2, 1
    if args.merge:
        if args.resume is None:
            ap.error("--merge adds to a bundle: give it with --resume")
        bundle = json.loads(args.resume.read_text())
        for other in args.merge:
            print("\n".join(merge_bundles(bundle, json.loads(other.read_text()), str(other))) or f"{other}: nothing new")
        tmp = args.resume.with_name(f".{args.resume.name}.tmp")
        tmp.write_text(json.dumps(bundle, indent=1))
        tmp.replace(args.resume)
        print(f"{args.resume}: {len(bundle['pairs'])} pairs, {len(bundle['results'])} runs")
        return
    if args.report:
        if args.resume is None:
            ap.error("--report reads a bundle: give it with --resume")
        write_report(args, json.loads(args.resume.read_text()))
        return
    bundle = load_bundle(args)
    if args.out is None:
        ap.error("--out is needed to run (the bundle is written there)")
    for name, result in bundle["results"].items():  # where quality.launch looks for a run's result first
        (args.work / "results").mkdir(parents=True, exist_ok=True)
        (args.work / "results" / f"{name}.json").write_text(json.dumps(result))
    run_arms(args, bundle, args.work / "home", deadline=t0 + args.budget_s, stop_at=t0 + args.stop_s)
    write_bundle(bundle, args.out, args.work)
    done = sorted(n for n in bundle["results"] if any(f"-s{seed}-" in n for seed in args.seeds))
    print(f"bundle {args.out / BUNDLE}: {len(bundle['results'])} results ({len(done)} of seed(s) {args.seed}: {', '.join(done)}) "
          f"in {time.monotonic() - t0:.0f} s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
