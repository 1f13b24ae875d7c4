"""The teacher's hidden rows on the Ray backend: through the driver (the path before 06115d2) against left in the
object store for the trainer rank (TeacherWorker.score_apart + HiddenRef), on a local CPU Ray cluster.

    python benchmarks/ray_hidden_path.py [--streams 512 --rows 500 --hidden 4096 --repeats 3]

Two actors stand in for a teacher replica and a trainer rank (no models: the teacher returns bf16 rows of the
given shape, as HFTeacher.score does in HIDDEN mode; the trainer sums them, so every row is read). Per path, the
seconds from the teacher's call to the trainer's answer (actors started first), best of --repeats: `driver` ray.gets the scores with their
rows and passes the samples on as the argument (what RayBackend.score and .train did), `refs` ray.gets the scores
alone and passes each stream's rows as a HiddenRef the trainer fetches (`fetch_hidden`). Prints both and the ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from agentopd.backends.ray_actors import TeacherWorker, fetch_hidden, with_hidden_refs  # noqa: E402
from agentopd.batch import TrainSample  # noqa: E402
from agentopd.teacher.base import TeacherScores  # noqa: E402


class Teacher(TeacherWorker):
    """A teacher actor without a model: `score` returns bf16 rows of the given shape (HIDDEN mode's TeacherScores);
    `score_apart` is TeacherWorker's own."""

    def __init__(self, streams: int, rows: int, hidden: int):
        self.shape = streams, rows, hidden

    def score(self, streams: list | None = None, mode: object = None) -> list[TeacherScores]:
        n, rows, hidden = self.shape
        return [TeacherScores([-0.5] * rows, hidden=torch.full((rows, hidden), 0.5, dtype=torch.bfloat16)) for _ in range(n)]


class Trainer:
    def train(self, samples: list[TrainSample]) -> float:
        samples = fetch_hidden(samples)
        return float(sum(s.teacher_hidden[0, 0].item() for s in samples))


def samples_of(scores: list[TeacherScores], rows: int) -> list[TrainSample]:
    ids = [1] * (rows + 1)
    return [TrainSample(token_ids=ids, prompt_len=1, response_mask=[1] * rows, old_logprobs=[0.0] * rows,
                        teacher_logprobs=s.logprobs, teacher_hidden=s.hidden) for s in scores]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=512)
    ap.add_argument("--rows", type=int, default=500)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    teacher = ray.remote(Teacher).options(num_cpus=0).remote(args.streams, args.rows, args.hidden)
    trainer = ray.remote(Trainer).options(num_cpus=0).remote()
    gb = args.streams * args.rows * args.hidden * 2 / 1e9
    ray.get([teacher.__ray_ready__.remote(), trainer.__ray_ready__.remote()])  # both actors up before any timing
    best = {}
    for _ in range(args.repeats):
        for path in ("driver", "refs"):
            t = time.perf_counter()
            if path == "driver":
                scores = ray.get(teacher.score.remote([], None))
            else:
                refs = teacher.score_apart.options(num_returns=args.streams + 1).remote([], None)
                scores = with_hidden_refs(ray.get(refs[0]), refs[1:])
            total = ray.get(trainer.train.remote(samples_of(scores, args.rows)))
            assert total == 0.5 * args.streams
            best[path] = min(best.get(path, float("inf")), time.perf_counter() - t)
            del scores
    ray.shutdown()
    print(f"{args.streams} streams x {args.rows} rows x {args.hidden} hidden, bf16: {gb:.2f} GB a step; best of {args.repeats}")
    print(f"through the driver:        {best['driver']:.2f} s")
    print(f"left in the object store:  {best['refs']:.2f} s")
    print(f"ratio: {best['driver'] / best['refs']:.2f}x")


if __name__ == "__main__":
    main()
