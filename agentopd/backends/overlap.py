"""Scoring a rollout's episodes while it plays (`teacher.overlap`, the local backend): each finished episode goes to
its teacher on a thread of its own, so the teacher's compute-bound prefill runs beside the engine's bandwidth-bound
decode of the stragglers instead of after it (issue 52: on one GPU the phases ran one after another).

    scorer = OverlapScorer(teachers, teacher_of, mode, min_tokens=4096)
    scorer.add(i, stream)              # episode i of the rollout (plan order) is played: queued for its teacher
    scores, metrics = scorer.finish()  # the rollout is over: the rest scored, every score in plan order (None: never added)

Whenever the thread is free it takes every episode waiting for a teacher, once they hold at least `min_tokens`
tokens, and scores them in one call (the teacher packs them as it always does): the calls grow while the teacher
is slower than the rollout and stay small while it keeps up. What waits when the rollout ends is scored by
`finish`. On a GPU the thread runs
its kernels on a CUDA stream of its own, so they interleave with the engine's (a stream made by PyTorch does not
synchronise with the default one); every score it returns is on the host. An error in the thread is raised by
`finish` (or by `add`, once seen), naming the teacher. `cancel` stops the thread without scoring the rest (a
rollout that failed).

Metrics: `teacher/overlap_s` (seconds the thread spent scoring before the rollout ended) and
`teacher/overlap_share` (the share of the rollout's scored tokens that were scored by then).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from agentopd.teacher import TeacherMode, TeacherScores
    from agentopd.types import TokenStream

_END = object()


class OverlapScorer:
    def __init__(self, teachers: Mapping[str, Any], teacher_of: Sequence[str], mode: TeacherMode, min_tokens: int,
                 device: torch.device | None = None):  # fmt: skip
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        self.teachers, self.teacher_of, self.mode = teachers, list(teacher_of), mode
        self.min_tokens = min_tokens
        self.scores: list[TeacherScores | None] = [None] * len(self.teacher_of)
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._playing = True  # the rollout has not ended: what is scored now counts as overlapped
        self._lock = threading.Lock()
        self.busy_s = 0.0  # seconds scoring while the rollout played
        self.tokens_during = 0  # tokens scored while it played
        self.tokens = 0  # every token scored
        cuda = device is not None and device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if cuda else None
        self._thread = threading.Thread(target=self._work, name="agentopd-overlap-scorer", daemon=True)
        self._thread.start()

    def add(self, index: int, stream: TokenStream) -> None:
        """Episode `index` (plan order) is played: its stream is queued for its teacher."""
        if self._error is not None:
            raise RuntimeError(f"teacher.overlap: scoring beside the rollout failed: {self._error}") from self._error
        if not 0 <= index < len(self.scores):
            raise IndexError(f"episode {index} is outside the rollout's {len(self.scores)}")
        self._queue.put((index, stream))

    def finish(self) -> tuple[list[TeacherScores | None], dict[str, float]]:
        """The rollout is over: what still waits is scored; every score in plan order, and the overlap's metrics."""
        with self._lock:
            self._playing = False
        self._queue.put(_END)
        self._thread.join()
        if self._error is not None:
            raise self._error
        share = self.tokens_during / self.tokens if self.tokens else 0.0
        return self.scores, {"teacher/overlap_s": self.busy_s, "teacher/overlap_share": share}

    def cancel(self) -> None:
        """Stop without scoring what waits (the rollout failed); returns once the thread has ended."""
        self._stop.set()
        self._queue.put(_END)
        self._thread.join()

    # ---- the thread ----
    def _work(self) -> None:
        waiting: dict[str, list[tuple[int, TokenStream]]] = {}
        try:
            with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
                if self._stream is not None:  # what the default stream queued (a teacher moved to the GPU) comes first
                    self._stream.wait_stream(torch.cuda.default_stream(self._stream.device))
                while True:
                    items = [self._queue.get()]  # wait for one, then take all that wait
                    while True:
                        try:
                            items.append(self._queue.get_nowait())
                        except queue.Empty:
                            break
                    if self._stop.is_set():
                        return
                    ended = any(item is _END for item in items)
                    for item in items:
                        if item is not _END:
                            index, stream = item
                            name = self.teacher_of[index]
                            waiting.setdefault(name, []).append((index, stream))
                    for name in list(waiting):
                        if ended or sum(len(s.token_ids) for _, s in waiting[name]) >= self.min_tokens:
                            self._score(name, waiting.pop(name))
                    if ended:
                        return
        except BaseException as e:  # noqa: BLE001 -- raised by add/finish in the caller's thread
            self._error = e

    def _score(self, name: str, items: list[tuple[int, TokenStream]]) -> None:
        t0 = time.perf_counter()
        try:
            scores = self.teachers[name].score([s for _, s in items], mode=self.mode)
        except Exception as e:
            raise RuntimeError(f"teacher {name!r}: {e}") from e
        if self._stream is not None:
            self._stream.synchronize()  # its results are on the host already; nothing of it still runs
        n = sum(len(s.token_ids) for _, s in items)
        with self._lock:
            if self._playing:
                self.busy_s += time.perf_counter() - t0
                self.tokens_during += n
            self.tokens += n
        for (i, _), sc in zip(items, scores, strict=True):
            self.scores[i] = sc
