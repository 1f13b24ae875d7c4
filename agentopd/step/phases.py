"""The phases of a run (rollout, teacher, train, sync, eval): the one running now, its progress bar, its memory.

    phases = Phases(progress)                          # the run's; phase "setup" until the first stage
    phases.measure_memory(backend, memory_plan, per_gpu=False)   # where the phases' peaks are measured
    phases.measure_host(host_plan)                     # or, a CPU run: this process's resident memory
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

A CPU run on the local backend (not async) measures this process's peak resident memory in each phase instead, beside
its host plan (agentopd.memory_host): `mem/<phase>_host_peak_gib` (VmHWM of /proc/self/status, reset at the phase's
start through /proc/self/clear_refs: what the kernel's OOM killer counts) and `mem/<phase>_host_plan_gib`.
The reset also resets what `/usr/bin/time -v` reports as the maximum resident set size (the kernel's high-water mark
of the process): it then covers only the last phase; the largest `mem/<phase>_host_peak_gib` is the run's peak.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from agentopd.heap import release_freed_memory
from agentopd.memory_host import HostPhase
from agentopd.memory_plan import Phase

if TYPE_CHECKING:
    from agentopd.backends.base import Backend
    from agentopd.memory_host import HostPlan
    from agentopd.memory_plan import MemoryPlan
    from agentopd.progress import RunProgress


class Phases:
    def __init__(self, progress: RunProgress):
        self.progress = progress
        self.now = "setup"
        self.backend: Backend | None = None  # set by measure_memory: whose peaks are read
        self.memory_plan: MemoryPlan | None = None
        self.per_gpu = False  # Ray: mem/gpu<g>_<phase>_*; local: mem/<phase>_*
        self.host_plan: HostPlan | None = None  # set by measure_host: a CPU run's resident memory is measured
        self._memory: dict[str, float] = {}

    @property
    def measure(self) -> bool:
        return self.backend is not None and self.memory_plan is not None

    def measure_memory(self, backend: Backend, memory_plan: MemoryPlan, *, per_gpu: bool) -> None:
        """Measure each phase's peaks on `backend`'s GPUs from now on, beside `memory_plan`'s prediction."""
        self.backend, self.memory_plan, self.per_gpu = backend, memory_plan, per_gpu

    def measure_host(self, host_plan: HostPlan) -> None:
        """Measure this process's peak resident memory in each phase from now on, beside `host_plan`'s prediction; not
        where the kernel has no /proc/self/clear_refs and VmHWM (macOS): there nothing is measured."""
        try:
            reset_resident_peak()
            resident_peak_gib()
        except (OSError, RuntimeError):
            return
        self.host_plan = host_plan

    def enter(self, name: str) -> None:
        self.now = name

    @contextmanager
    def __call__(self, name: str, total: int | None = None) -> Iterator[Callable[[], None]]:
        self.now = name
        if self.measure:
            self.backend.memory_peaks()  # resets them
        if self.host_plan is not None:
            reset_resident_peak()
        with self.progress.phase(name, total=total) as advance:
            yield advance
        if self.host_plan is not None:
            self._memory[f"mem/{name}_host_peak_gib"] = resident_peak_gib()
            release_freed_memory()  # what the phase freed, back to the kernel: the next phase starts from what is held
            if name in HOST_PHASE:
                self._memory[f"mem/{name}_host_plan_gib"] = self.host_plan.peak(HOST_PHASE[name])
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


# the run's phases the host plan has a figure for (the eval phase: its largest, with the teacher's engine of eval.teacher)
HOST_PHASE = {"rollout": HostPhase.ROLLOUT, "teacher": HostPhase.SCORE, "train": HostPhase.TRAIN, "eval": HostPhase.EVAL}


def reset_resident_peak() -> None:
    """Set this process's VmHWM to its current resident size (Linux >= 4.0: "5" to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def resident_peak_gib() -> float:
    """This process's peak resident memory (VmHWM) since the last reset, GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 2**30
    raise RuntimeError("/proc/self/status has no VmHWM line")
