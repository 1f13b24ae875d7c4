"""One run of benchmarks/scale_gpu.py in a process of its own (the parent stops it at its timeout), with what the
report needs from inside the driver: when each step ended, each actor's pid and GPUs, and the fault injected.

    python benchmarks/_scale_run.py SPEC.json     # written by scale_gpu.py: config, keys, run_dir, info, fault...

`info` (JSON, rewritten whole as the run goes): step_end (step -> time.time() when it ended), actors (role, pid, Ray's
GPU ids), fault (role, pid, step, killed_at; for a teacher also scoring_started / scoring_ended).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from enum import StrEnum
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _faults import stored, when_step_plays  # noqa: E402


class Fault(StrEnum):
    ROLLOUT = "rollout"  # the first rollout worker, killed once the step's first training episode is stored
    TEACHER = "teacher"  # the first teacher replica, killed `fault_delay` s into the step's scoring


def run(spec_path: Path) -> None:
    """One run (`spec.json` from `measure`): records when each step ended, each actor's pid and GPUs once they are up,
    and injects the fault; writes all of it to the spec's `info` file as it goes."""
    import ray

    from agentopd.config import load_config
    from agentopd.runner import Runner

    spec = json.loads(spec_path.read_text())
    run_dir, info_path = Path(spec["run_dir"]), Path(spec["info"])
    runner = Runner(load_config("sql_db", config_file=Path(spec["config"]), overrides=spec["keys"]), run_dir)
    info: dict = {"step_end": {}, "actors": [], "fault": None}
    lock = threading.Lock()

    def save() -> None:
        with lock:  # whole or not at all: the parent may kill this process at any time
            info_path.with_suffix(".tmp").write_text(json.dumps(info))
            info_path.with_suffix(".tmp").replace(info_path)

    step = runner._step

    def timed_step(k: int) -> dict:
        out = step(k)
        info["step_end"][str(k)] = time.time()
        save()
        return out

    runner._step = timed_step
    threading.Thread(target=_watch_actors, args=(ray, runner, spec, info, save), daemon=True).start()
    summary = runner.run()
    info["interrupted"] = summary.interrupted
    save()


def _watch_actors(ray, runner, spec: dict, info: dict, save) -> None:
    """Once the backend has its actors: their pids and GPUs by role; then arm the fault (killed by SIGKILL)."""
    while getattr(getattr(runner, "backend", None), "group", None) is None:
        time.sleep(0.2)
    backend = runner.backend
    actors = [("trainer", a) for a in backend.group.ranks] + [("rollout", a) for a in backend.workers]
    actors += [("teacher", a) for pool in backend.teachers.values() for a in pool]
    pids = ray.get([a.pid.remote() for _, a in actors])
    gpus = ray.get([a.gpu_ids.remote() for _, a in actors])
    info["actors"] = [{"role": role, "pid": pid, "gpus": g} for (role, _), pid, g in zip(actors, pids, gpus)]
    save()
    step, victim = spec["fault_step"], next((a["pid"] for a in info["actors"] if a["role"] == spec["fault"]), None)

    def kill() -> None:
        os.kill(victim, signal.SIGKILL)
        info["fault"] = {**(info["fault"] or {}), "role": spec["fault"], "pid": victim, "step": step, "killed_at": time.time()}
        save()

    if spec["fault"] == Fault.ROLLOUT:
        when_step_plays(Path(spec["run_dir"]), step, kill, timeout=3600)
    elif spec["fault"] == Fault.TEACHER:
        score, run_dir = backend.score, Path(spec["run_dir"])

        def scoring(by_teacher, mode):  # the scoring of `step`: the teacher replica dies `fault_delay` s into it
            if info["fault"] is not None or not stored(run_dir, step):
                return score(by_teacher, mode)
            info["fault"] = {"scoring_started": time.time()}
            threading.Timer(spec["fault_delay"], kill).start()
            out = score(by_teacher, mode)
            info["fault"]["scoring_ended"] = time.time()
            save()
            return out

        backend.score = scoring


if __name__ == "__main__":
    run(Path(sys.argv[1]))
