"""Fault injection shared by the Ray tests (test_ray_backend.py, test_ray_weight_sync.py)."""

import sqlite3
import threading
import time
from pathlib import Path


def kill_rollout_worker_during(ray, runner, run_dir: Path, step: int, within_s: float = 180.0):
    """Start a thread that kills `runner`'s first rollout worker once a training episode of `step` is stored;
    returns (thread, killed): `killed` gets the victim's pid."""
    killed: list[int] = []

    def watch():
        deadline = time.time() + within_s
        while time.time() < deadline and not killed:
            try:
                with sqlite3.connect(f"file:{run_dir / 'trajectories.db'}?mode=ro", uri=True) as conn:
                    started = conn.execute("select count(*) from episodes where split='train' and step=?", (step,)).fetchone()[0]
            except sqlite3.OperationalError:  # not created yet
                started = 0
            if started:
                victim = runner.backend.workers[0]
                killed.append(ray.get(victim.pid.remote()))
                ray.kill(victim, no_restart=True)
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, killed
