"""The headline GPU figures in one run, each as a ratio against its recorded baseline.

    python benchmarks/gpu_check.py --commit $(git rev-parse --short HEAD) --out DIR   # ~7.5 min on an H100
    python benchmarks/gpu_check.py --only engine,loss --out DIR                      # some parts
    python benchmarks/gpu_check.py --out DIR --record                                # + DIR/gpu_baseline.json
    python benchmarks/gpu_check.py --only opd --out DIR --against /tmp/old --against-commit ea9f3b9   # A/B, one call
    python benchmarks/gpu_check.py --only realsize --tokenizer TOK --out DIR   # the README's example, ~7 min on an H200

CI has no GPU, so nothing else notices when a change slows the GPU path (one line once cut the trainer's
throughput 42% and every test passed). Run this before resolving any change to `engines/`, `trainer/`, `losses/`,
`teacher/`, `batch.py`, `prefix.py` or `backends/`, and put its table in the closing note.

On our GPU machines (torch, transformers, Triton present; agentopd's own requirements not): carry wheels of
liger-kernel, pydantic (+ pydantic-core, annotated-types, typing-inspection), sqlite-utils (+ sqlite-fts4,
click-default-group), gymnasium (+ farama-notifications), install them with `pip install --no-index --no-deps
--target`, put that folder on PYTHONPATH, and `python -m pip install --no-deps --no-build-isolation -e .` (the
envs register through entry points; the machine's bare `pip` is not its Python's). About 7.5 minutes on an H100.

Parts, each in a process of its own (its own CUDA context and inductor cache), one after the other:
    engine   benchmarks/engine_gpu.py --check-json: the fast engine's multi-turn arms at 128 and 256 episodes
             (Qwen3-0.6B shape, 151,936-row vocabulary, random weights), best of two runs each
    trainer  benchmarks/trainer_gpu.py: the 0.6B student compiled, 16 x 2,048 tokens a step, micro-batches of
             16,384 and 32,768 tokens, loss chunk 4,096: tokens/s, MFU, peak memory
    loss     benchmarks/loss.py --json: the fused full-vocabulary JSD against Liger-Kernel's compiled
             LigerFusedLinearJSDLoss at 4,096 and 16,384 tokens (needs `liger_kernel` importable)
    opd      benchmarks/gpu_opd.py: eight OPD steps (0.6B / 1.7B shapes, fast engine, compiled trainer);
             seconds per phase, medians of steps 2-8 (with 3 steps, one run's train phase alone went 0.425 -> 0.467 s
             from step 2 to 3, and HEAD's median 0.38-0.47 s over four runs of one call: a 10% gate on 2 steps is noise);
             the train phase as opd/train_steady_s (steady_train_s: seconds per token of the steps that did not
             recompile, at the median step's tokens; their median, opd/train_s until 2026-11-30, picked between
             one- and two-micro-batch steps)
    loop     benchmarks/rollout_loop.py: the agent loop against the engine alone on the same requests (math and
             sql_db, 64 episodes, 0.6B shape, the embedded tokenizer): the loop's tok/s and its share of the
             engine's (1.0: the loop costs nothing on top)
    realsize benchmarks/realsize.py: the README's GPU example as written (configs/examples/qwen3-gpu.yaml: 64 tasks x 8,
             up to 8 turns, 1,024 new tokens; random Qwen3-1.7B / 8B shapes with Qwen3's real vocabulary) for 2 steps:
             the second step's rollout, teacher, train and sync seconds, their sum, throughputs and MFU, and the
             seconds of the run's one checkpoint (not gated: the host's disk); needs `--tokenizer`, a real-vocabulary
             tokenizer folder (`agentopd make-tokenizer qwen3 DIR`, built where the real-vocab extra is installed)
    tests    pytest -m gpu: every GPU-marked test

Baselines: benchmarks/results/gpu_baseline.json, per figure and card kind (H100, H200, ...): value, which way is
better, the commit and date it was measured at, and where (a results file, or this script). A figure is compared
only with its baseline on the same card kind. The exit code is 1 when a gated figure is more than 10%
worse than its baseline (a throughput 10% lower, a memory peak or a time 10% higher) or a GPU test fails, else 0.
A baseline moves only in a commit that says why; `--record` writes DIR/gpu_baseline.json with this run's
figures added for every figure that has no baseline on this card yet (copy it over the repository's file).

A recorded baseline comes from another call, often another host: CPU-bound figures (the agent loop, the OPD step's
rollout) moved 10-20% between H100 hosts with no change to the code. `--against DIR` runs each part (the GPU tests
aside) in another commit's tree as well, right before this tree's, in the same call, and judges the figures against
those; the recorded baseline stays in the row. Make DIR with `git archive REF | tar -x -C DIR` and carry it (both
trees use this checkout's installed entry points; a part whose script or output changed between the commits cannot
be compared so).

That same-call comparison is the default for the host-bound parts (engine, opd, loop): where git is,

    python benchmarks/gpu_check.py --prepare-against          # .gpu_check/against: the last commit they passed at
    python benchmarks/gpu_check.py --prepare-against 0a7c87f  # or a commit of your choice

writes that commit's tree to `.gpu_check/against` (git-ignored: name it in the device call's carry); a check run without
`--against` finds it there and runs those parts in it as well, right before this tree's. The other parts (trainer,
loss, realsize: GPU-bound) stay judged against their recorded baselines. Without the folder the host-bound rows are
judged against the recorded baselines, and the check says so. The last commit each part passed at, per card, is
`last_pass` in gpu_baseline.json: `--record` writes it for every part of a passing check.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _measured import commit_measured

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "benchmarks" / "results" / "gpu_baseline.json"
PARTS = ("engine", "trainer", "loss", "opd", "loop", "realsize", "tests")
HOST_BOUND = ("engine", "opd", "loop")  # figures the host's CPU moves 10-20% between machines: judged in the same call
AGAINST = ROOT / ".gpu_check" / "against"  # --prepare-against writes it; a check without --against reads it
TOLERANCE = 0.10
LOSS_SHAPE = "x151936x2048x4096"  # N x V x H_s x H_t: the 1.7B student's head against an 8B-wide teacher


def fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def card_kind(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100': baselines are compared within one card kind."""
    found = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", name)
    return found.group(1) if found else name


TREE = ROOT  # the tree a part runs in: this checkout, or --against's for the same-call baseline
TOKENIZER: Path | None = None  # --tokenizer: the realsize part's real vocabulary


def run(cmd: list[str], log: Path, timeout: int) -> subprocess.CompletedProcess:
    print(f"$ {' '.join(cmd)}" + (f"   (in {TREE})" if TREE != ROOT else ""), flush=True)
    t = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{TREE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(cmd, cwd=TREE, capture_output=True, text=True, timeout=timeout, env=env)
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)} (in {TREE})\n{done.stdout}\n{done.stderr}\n(exit {done.returncode}, {time.perf_counter() - t:.0f} s)\n")
    print(f"  exit {done.returncode} in {time.perf_counter() - t:.0f} s", flush=True)
    return done


def engine(out: Path, log: Path) -> dict[str, float]:
    path = out / "engine.json"
    done = run([sys.executable, "benchmarks/engine_gpu.py", "--check-json", str(path)], log, 300)
    return json.loads(path.read_text()) if done.returncode == 0 else {}


def trainer(out: Path, log: Path) -> dict[str, float]:
    figures = {}
    for tokens in (16384, 32768):
        path = out / f"trainer_{tokens}.jsonl"
        run([sys.executable, "benchmarks/trainer_gpu.py", "--shape", "qwen3-0.6b", "--configs", "compile",
             "--micro-batch-tokens", str(tokens), "--chunk-size", "4096", "--seqs", "16", "--steps", "5",
             "--jsonl", str(path)], log, 300)  # fmt: skip
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        row = next((r for r in rows if "tokens_per_s" in r), None)
        if row is None:
            print(f"  trainer at {tokens} tokens: {rows[-1]['error'] if rows else 'no result'}", flush=True)
            continue
        k = tokens // 1024
        figures |= {f"trainer/0.6b_{k}k_tok_s": row["tokens_per_s"], f"trainer/0.6b_{k}k_mfu": row["mfu"],
                    f"trainer/0.6b_{k}k_peak_gib": row["peak_GiB"]}
    return figures


def loss(out: Path, log: Path) -> dict[str, float]:
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        print("  liger_kernel is not importable: the loss part needs it (pip install liger-kernel)", flush=True)
        return {}
    path = out / "loss.json"
    run([sys.executable, "benchmarks/loss.py", "--device", "cuda", "--kinds", "jsd", "--variants", "default:4096",
         "--shapes", f"4096{LOSS_SHAPE},16384{LOSS_SHAPE}", "--json", str(path)], log, 300)  # fmt: skip
    rows = json.loads(path.read_text()) if path.exists() else []
    figures = {}
    for n in (4096, 16384):
        ours = next((r for r in rows if r["n"] == n and r["impl"] == "default" and not r["error"]), None)
        liger = next((r for r in rows if r["n"] == n and r["impl"] == "liger_chunked_compiled" and not r["error"]), None)
        k = n // 1024
        if ours:
            figures[f"loss/jsd_{k}k_tok_s"] = n / ours["seconds"]
            figures[f"loss/jsd_{k}k_peak_gib"] = ours["peak_bytes"] / 2**30
        if ours and liger:
            figures[f"loss/jsd_{k}k_speed_vs_liger"] = liger["seconds"] / ours["seconds"]
    return figures


def opd(out: Path, log: Path) -> dict[str, float]:
    run_out = out / "opd"
    done = run([sys.executable, "benchmarks/gpu_opd.py", "--steps", "8", "--out", str(run_out),
                "engine.kind=fast", "trainer.compile=true"], log, 400)  # fmt: skip
    if done.returncode != 0:
        return {}
    steps = [json.loads(x) for x in (run_out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r][1:]  # step 1 compiles
    names = {"perf/rollout_tokens_per_s": "opd/rollout_tok_s", "perf/rollout_s": "opd/rollout_s",
             "perf/teacher_s": "opd/teacher_s", "perf/weight_sync_s": "opd/weight_sync_s"}
    figures = {ours: statistics.median(r[k] for r in steps) for k, ours in names.items() if all(k in r for r in steps)}
    if steps and all("perf/train_step_s" in r and "train/tokens" in r for r in steps):
        figures["opd/train_steady_s"] = steady_train_s(steps)
    return figures


def steady_train_s(steps: list[dict]) -> float:
    """The train phase's seconds at the steps' median token count, over the steady steps: their seconds summed over
    their tokens, those that ran under 3x the fastest (a step that recompiled the layers took 6-9 s).

    The median of the steps' seconds it replaces (opd/train_s) picked between two kinds of step: ~28-32k tokens a step
    fall either side of two 16,384-token micro-batches, and a step whose samples share their prompts in one micro-batch
    ran in ~0.24 s where two took ~0.38-0.43; with one or two recompiling steps among the seven, the median landed on
    either kind, and the gate failed on trees whose steps of each kind ran alike (2026-11-30, d348585: median 0.479 against
    dde3275's 0.415 in one call; per step in the next: benchmarks/results/small_batch.md)."""
    fastest = min(r["perf/train_step_s"] for r in steps)
    steady = [r for r in steps if r["perf/train_step_s"] < 3 * fastest]
    per_token = sum(r["perf/train_step_s"] for r in steady) / sum(r["train/tokens"] for r in steady)
    return per_token * statistics.median(r["train/tokens"] for r in steps)


def loop(out: Path, log: Path) -> dict[str, float]:
    path = out / "loop.json"
    run([sys.executable, "benchmarks/rollout_loop.py", "--device", "cuda", "--envs", "math,sql_db", "--out",
         str(out / "loop"), "--json", str(path)], log, 300)  # fmt: skip
    return json.loads(path.read_text()) if path.exists() else {}


def realsize(out: Path, log: Path) -> dict[str, float]:
    if TOKENIZER is None:
        print("  realsize needs --tokenizer DIR (`agentopd make-tokenizer qwen3 DIR`)", flush=True)
        return {}
    path = out / "realsize"
    run([sys.executable, "benchmarks/realsize.py", "--tokenizer", str(TOKENIZER), "--out", str(path)], log, 580)
    return json.loads((path / "realsize.json").read_text()) if (path / "realsize.json").exists() else {}


def tests(out: Path, log: Path) -> dict[str, float]:
    # only the files that hold GPU-marked tests: the others import what a GPU machine may lack (fastapi, ray, vllm)
    files = sorted(str(p.relative_to(TREE)) for p in (TREE / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())
    done = run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files], log, 400)
    counts = {w: int(n) for n, w in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", done.stdout)}
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    if done.returncode not in (0, 5) and not failed:
        failed = 1  # pytest itself broke: count it as a failure
    return {"tests/gpu_passed": counts.get("passed", 0), "tests/gpu_failed": failed}


def compare(figures: dict[str, float], baseline: dict, card: str, against: dict[str, float] | None = None,
            against_commit: str = "") -> tuple[list[str], bool]:
    """The table rows, and whether every gated figure holds against its baseline on this card. With `against` (the
    same parts run in another commit's tree in this call) a figure it has is judged against that instead: the same
    host and card, so what the host adds or takes (one H100 host's CPU-bound figures ran ~10% under another's) cancels;
    the recorded baseline stays beside it in the row."""
    rows = ["| figure | now | baseline | ratio | baseline from | verdict |", "|---|---|---|---|---|---|"]
    ok = True
    for name in sorted(set(figures) | {k for k, cards in baseline.items() if card in cards}):
        now, base = figures.get(name), baseline.get(name, {}).get(card)
        if against and name in against and now is not None and not name.startswith("tests/"):
            kept = base or {"better": "lower" if _lower(name) else "higher", "gate": True}
            recorded_note = f"; recorded {fmt(base['value'])} ({base['commit']}): {now / base['value']:.2f}" if base else ""
            base = {**kept, "value": against[name], "commit": f"same call, {against_commit}", "date": recorded_note.lstrip("; ")}
        if name == "tests/gpu_failed":
            ok &= now == 0
            rows.append(f"| {name} | {now} | 0 | - | - | {'ok' if now == 0 else 'FAIL'} |")
            continue
        if now is None:
            rows.append(f"| {name} | not measured | {fmt(base['value'])} | - | {base['commit']} {base['date']} | MISSING |")
            ok = False
            continue
        if base is None:
            rows.append(f"| {name} | {fmt(now)} | none on {card} | - | - | new |")
            continue
        higher = base["better"] == "higher"
        ratio = now / base["value"]
        worse = ratio < 1 - TOLERANCE if higher else ratio > 1 + TOLERANCE
        gated = base.get("gate", True)
        ok &= not (worse and gated)
        verdict = ("FAIL" if gated else "worse (not gated)") if worse else "ok"
        rows.append(f"| {name} | {fmt(now)} | {fmt(base['value'])} | {ratio:.2f} ({'higher' if higher else 'lower'} is "
                    f"better) | {base['commit']} {base['date']} | {verdict} |")
    return rows, ok


def _lower(name: str) -> bool:
    """Seconds and memory: lower is better; rates and ratios: higher."""
    return name.endswith(("_s", "_gib")) and not name.endswith("tok_s")


def last_passing(last_pass: dict) -> str:
    """The newest commit (by date) at which a host-bound part passed on any card (gpu_baseline.json's `last_pass`)."""
    passes = [entry for part in HOST_BOUND for entry in last_pass.get(part, {}).values()]
    if not passes:
        raise SystemExit("--prepare-against: gpu_baseline.json records no passing check of engine, opd or loop; "
                         "name a commit: --prepare-against REF")
    return max(passes, key=lambda e: e["date"])["commit"]


def prepare_against(ref: str, dest: Path = AGAINST, repo: Path = ROOT) -> str:
    """Write `ref`'s tree (git archive) to `dest`, its short commit in dest/COMMIT; the commit."""
    import shutil

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", f"{ref}^{{commit}}"], cwd=repo, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        said = (getattr(e, "stderr", None) or str(e)).strip().splitlines()
        raise SystemExit(f"--prepare-against {ref}: not a commit of this checkout ({said[0] if said else 'git failed'})") from None
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit], cwd=repo, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    (dest / "COMMIT").write_text(commit + "\n")
    return commit


def default_against(dest: Path = AGAINST) -> tuple[Path | None, str]:
    """The tree --prepare-against left (and its commit), or (None, "") when there is none."""
    if (dest / "benchmarks" / "gpu_check.py").exists():
        commit = (dest / "COMMIT").read_text().strip() if (dest / "COMMIT").exists() else str(dest)
        return dest, commit
    return None, ""


def runs_against(part: str, against: Path | None, default: bool) -> bool:
    """Whether `part` also runs in the --against tree: every part but the GPU tests when it was given, the host-bound
    ones when it is the default one."""
    return against is not None and part != "tests" and (not default or part in HOST_BOUND)


def passed(last_pass: dict, parts: list[str], card: str, commit: str, ok: bool) -> dict:
    """`last_pass` with this check's parts at `commit` on `card` when the check passed (else unchanged)."""
    new = {part: dict(cards) for part, cards in last_pass.items()}
    if ok:
        for part in parts:
            if part != "tests":
                new.setdefault(part, {})[card] = {"commit": commit, "date": datetime.date.today().isoformat()}
    return new


def recorded(figures: dict[str, float], baseline: dict, card: str, commit: str) -> dict:
    """The baseline with this run's figures added where it has none on this card (never moving one it has)."""
    new = {name: dict(cards) for name, cards in baseline.items()}
    for name, value in figures.items():
        if name.startswith("tests/") or card in new.get(name, {}):
            continue
        new.setdefault(name, {})[card] = {
            "value": round(value, 4), "better": "lower" if _lower(name) else "higher", "commit": commit,
            "date": datetime.date.today().isoformat(), "source": "benchmarks/gpu_check.py",
            # a weight sync is ~0.01 s: a few ms either way is noise; a checkpoint's seconds are the host's disk
            "gate": not name.endswith(("weight_sync_s", "checkpoint_s")),
        }
    return new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="logs, each part's raw results, check.md, check.json (required to check)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma list of parts: {', '.join(PARTS)}")
    ap.add_argument("--baseline", type=Path, default=BASELINE)
    ap.add_argument("--commit", default=None,
                    help="the commit measured (default: AGENTOPD_COMMIT, else the checkout's HEAD; a device machine's copy of the tree has no .git)")
    ap.add_argument("--record", action="store_true", help="write OUT/gpu_baseline.json with new figures added")
    ap.add_argument("--against", type=Path, metavar="DIR",
                    help="another commit's tree (`git archive REF | tar -x -C DIR`): each part runs there too, right "
                         "before this tree's, and its figures are the baseline (same host, same call)")
    ap.add_argument("--against-commit", default="", help="the commit --against holds (for the table)")
    ap.add_argument("--tokenizer", type=Path, help="the realsize part's real-vocabulary tokenizer folder (agentopd make-tokenizer qwen3 DIR)")
    ap.add_argument("--prepare-against", nargs="?", const="", metavar="REF",
                    help=f"write REF's tree (default: the last commit the host-bound parts passed at) to {AGAINST.relative_to(ROOT)}, "
                         "the default --against of a later check; needs git, no GPU")
    args = ap.parse_args()
    if args.prepare_against is not None:
        doc = json.loads(args.baseline.read_text()) if args.baseline.exists() else {}
        ref = args.prepare_against or last_passing(doc.get("last_pass", {}))
        print(f"{AGAINST.relative_to(ROOT)}: the tree of {prepare_against(ref)} (carry it with the device call)")
        return
    if args.out is None:
        ap.error("--out is required to check")
    args.commit = args.commit or commit_measured()
    args.out = args.out.resolve()  # the parts of --against run in its tree: a relative path would land there
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    parts = args.only.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"--only: unknown part(s) {', '.join(sorted(unknown))}; parts are {', '.join(PARTS)}")
    device = torch.cuda.get_device_name()
    card = card_kind(device)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "gpu_check_log.txt"
    log.write_text("")
    doc = json.loads(args.baseline.read_text()) if args.baseline.exists() else {}
    recorded_all = doc.get("figures", {})
    figures: dict[str, float] = {}
    against: dict[str, float] = {}
    if args.against is not None and not (args.against / "benchmarks" / "gpu_check.py").exists():
        raise SystemExit(f"--against {args.against}: not a tree of agentopd (no benchmarks/gpu_check.py in it)")
    default = args.against is None
    if default:
        args.against, args.against_commit = default_against()
        host_bound = [p for p in parts if p in HOST_BOUND]
        if args.against is not None and host_bound:
            print(f"host-bound parts ({', '.join(host_bound)}) also run in {args.against} ({args.against_commit}): "
                  "the same call's baseline", flush=True)
        elif host_bound:
            print(f"host-bound parts ({', '.join(host_bound)}) are judged against recorded baselines of other calls "
                  "(hosts move them 10-20%): `python benchmarks/gpu_check.py --prepare-against` where git is, and "
                  "carry .gpu_check", flush=True)
    global TREE, TOKENIZER
    TOKENIZER = args.tokenizer.resolve() if args.tokenizer is not None else None
    t0 = time.perf_counter()
    for part in PARTS:
        if part in parts:
            if runs_against(part, args.against, default):  # its tests are its own commit's business
                print(f"## {part} (against: {args.against})", flush=True)
                TREE = args.against.resolve()
                (args.out / "against").mkdir(exist_ok=True)
                against |= globals()[part](args.out / "against", log)
                TREE = ROOT
            print(f"## {part}", flush=True)
            figures |= globals()[part](args.out, log)
    wall = time.perf_counter() - t0
    baseline = {k: v for k, v in recorded_all.items() if k.split("/")[0] in parts}  # compare only what was measured
    rows, ok = compare(figures, baseline, card, against, args.against_commit or str(args.against))
    head = (f"gpu_check: {device} ({card}), torch {torch.__version__}, commit {args.commit}, "
            f"{datetime.date.today().isoformat()}, {wall:.0f} s: {'PASS' if ok else 'FAIL'}")
    text = "\n".join([head, "", *rows])
    print("\n" + text, flush=True)
    (args.out / "check.md").write_text(text + "\n")
    (args.out / "check.json").write_text(json.dumps({"device": device, "card": card, "commit": args.commit,
                                                     "figures": figures, "ok": ok, "against": against,
                                                     "against_commit": args.against_commit}, indent=1))
    if args.record:
        new = {"figures": recorded(figures, recorded_all, card, args.commit),
               "last_pass": passed(doc.get("last_pass", {}), parts, card, args.commit, ok)}
        (args.out / "gpu_baseline.json").write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
