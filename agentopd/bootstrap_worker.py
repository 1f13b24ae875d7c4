"""The built-in student's SFT in its own process (agentopd.bootstrap.StudentProcess starts it).

    python -m agentopd.bootstrap_worker JOB.pkl

JOB.pkl holds an `agentopd.bootstrap.RoleJob`; stdout gets one JSON line per progress update
({"progress": [phase, fraction, info]}) and a last line {"report": {...}}.
"""

from __future__ import annotations

import json
import pickle
import sys

from agentopd.bootstrap import RoleJob, train_role


def main(job_file: str) -> None:
    with open(job_file, "rb") as f:
        job: RoleJob = pickle.load(f)

    def progress(phase: str, fraction: float, info: dict) -> None:
        print(json.dumps({"progress": [phase, fraction, info]}), flush=True)

    report = train_role(job, progress)
    print(json.dumps({"report": report}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
