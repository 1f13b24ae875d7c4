"""The phases of a run (rollout, teacher, train, sync, eval): the one running now, its progress bar, its memory.

    phases = Phases(progress)                          # the run's; phase "setup" until the first stage
    phases.measure_memory(backend, memory_plan, per_gpu=False)   # where the phases' peaks are measured
    with phases("rollout", total=64) as advance: ...   # a bar; advance() per episode
    phases.enter("sync")                               # a phase without a bar
    phases.now                                         # what a CUDA out-of-memory names
    phases.take_memory()                               # mem/* measured since the last call (then forgotten)

Where the run has a memory plan (CUDA) and its phases do not overlap (not async on Ray), each phase's peak memory per
GPU is measured beside the plan's prediction and reported with the next step's metrics: `mem/<phase>_peak_gib`
(reserved by the caching allocator: what the GPU holds, blocks cached from earlier phases included),
`mem/<phase>_alloc_gib` (held in tensors: what the plan models), `mem/<phase>_alloc_retries` (the caching allocator's
failed-and-retried cudaMallocs: stalls of a GPU run near its memory) and `mem/<phase>_plan_gib` on the local backend
(its one GPU); `mem/gpu<g>_<phase>_...` per GPU of the plan on Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from agentopd.memory_plan import Phase

if TYPE_CHECKING:
    from agentopd.backends.base import Backend
    from agentopd.memory_plan import MemoryPlan
    from agentopd.progress import RunProgress


class Phases:
    def __init__(self, progress: RunProgress):
        self.progress = progress
        self.now = "setup"
        self.backend: Backend | None = None  # set by measure_memory: whose peaks are read
        self.memory_plan: MemoryPlan | None = None
        self.per_gpu = False  # Ray: mem/gpu<g>_<phase>_*; local: mem/<phase>_*
        self._memory: dict[str, float] = {}

    @property
    def measure(self) -> bool:
        return self.backend is not None and self.memory_plan is not None

    def measure_memory(self, backend: Backend, memory_plan: MemoryPlan, *, per_gpu: bool) -> None:
        """Measure each phase's peaks on `backend`'s GPUs from now on, beside `memory_plan`'s prediction."""
        self.backend, self.memory_plan, self.per_gpu = backend, memory_plan, per_gpu

    def enter(self, name: str) -> None:
        self.now = name

    @contextmanager
    def __call__(self, name: str, total: int | None = None) -> Iterator[Callable[[], None]]:
        self.now = name
        if self.measure:
            self.backend.memory_peaks()  # resets them
        with self.progress.phase(name, total=total) as advance:
            yield advance
        if self.measure:
            for gpu, measured in self.backend.memory_peaks().items():
                key = f"mem/gpu{gpu}_{name}" if self.per_gpu else f"mem/{name}"
                self._memory[f"{key}_peak_gib"] = measured.reserved
                self._memory[f"{key}_alloc_gib"] = measured.allocated
                self._memory[f"{key}_alloc_retries"] = float(measured.retries)
                self._memory[f"{key}_plan_gib"] = self.memory_plan.peak(gpu, Phase(name))

    def take_memory(self) -> dict[str, float]:
        out, self._memory = self._memory, {}
        return out
