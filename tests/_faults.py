"""Fault injection and the checks after it, shared by the Ray tests (test_ray_backend.py, test_ray_weight_sync.py,
test_ray_faults.py) and benchmarks/scale_gpu.py (the same faults on GPUs)."""

import json
import sqlite3
import threading
import time
from pathlib import Path


def stored(run: Path, step: int) -> int:
    """Training episodes of `step` in the run's store (0 before the store exists)."""
    try:
        with sqlite3.connect(f"file:{run / 'trajectories.db'}?mode=ro", uri=True) as db:
            return db.execute("select count(*) from episodes where split='train' and step=?", [step]).fetchone()[0]
    except sqlite3.OperationalError:  # not created yet
        return 0


def loss_steps(run: Path) -> list[int]:
    """The steps the run logged, in the order it logged them."""
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if "loss" in r]


def train_tokens(run: Path) -> dict[str, str]:
    """Each training episode's token ids (JSON) by episode id; asserts no id is stored twice."""
    with sqlite3.connect(f"file:{run / 'trajectories.db'}?mode=ro", uri=True) as db:
        rows = db.execute("select id, token_ids from episodes where split='train'").fetchall()
    assert len(rows) == len(dict(rows)), "duplicate episode ids"
    return dict(rows)


def lost_or_duplicated(run: Path, per_step: int) -> list[str]:
    """What a run lost or duplicated ([] when nothing): each step it finished logged once and in order, each of their
    `per_step` training episodes stored once and scored by the teacher."""
    steps = loss_steps(run) if (run / "metrics.jsonl").exists() else []
    finished = sorted(set(steps))
    wrong = [] if steps == list(range(1, len(finished) + 1)) else [f"steps logged {steps}"]
    if not finished:
        return [*wrong, "no step finished"]
    with sqlite3.connect(f"file:{run / 'trajectories.db'}?mode=ro", uri=True) as db:
        rows = db.execute("select step, count(*), count(distinct id), count(teacher_logprobs) from episodes "
                          "where split='train' and step<=? group by step", [finished[-1]]).fetchall()  # fmt: skip
    counts = {step: (n, distinct, scored) for step, n, distinct, scored in rows}
    for step in finished:
        n, distinct, scored = counts.get(step, (0, 0, 0))
        if not n == distinct == scored == per_step:
            wrong.append(f"step {step}: {n} training episodes stored ({distinct} distinct, {scored} scored), {per_step} asked")
    return wrong


def when_step_plays(run: Path, step: int, action, timeout: float = 300) -> threading.Thread:
    """Call `action()` once the first training episode of `step` is stored (in a thread)."""

    def watch():
        deadline = time.time() + timeout
        while time.time() < deadline:
            if stored(run, step):
                action()
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def kill_rollout_worker_during(ray, runner, run_dir: Path, step: int, within_s: float = 180.0):
    """Start a thread that kills `runner`'s first rollout worker once a training episode of `step` is stored;
    returns (thread, killed): `killed` gets the victim's pid."""
    killed: list[int] = []

    def kill():
        victim = runner.backend.workers[0]
        killed.append(ray.get(victim.pid.remote()))
        ray.kill(victim, no_restart=True)

    return when_step_plays(run_dir, step, kill, timeout=within_s), killed
