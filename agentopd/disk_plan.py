"""The disk plan: what a run writes to its run directory at its peak (resumable checkpoints and final/) against the free
space of that directory's file system, before any model loads; the refusal of a run whose checkpoints cannot fit.

    plan = plan_disk(cfg, ModelShape.from_ref(student), RunDir(run_dir), start=0)
    print(plan.line())        # "disk: 2 checkpoints of 20.4 GiB + final/ 6.4 GiB at the peak: 47.2 of 58.0 GiB free ..."
    plan.check()              # DiskPlanError (a ValueError): one line naming the shortfall and the keys to change

`agentopd run` refuses such a run (local and Ray backends, CPU and GPU), `agentopd plan-memory` prints the line under
the memory plan. Sizes are GiB (2**30 bytes). What is counted, bytes (P = the student's parameters, the embedding
table once when tied; V vocabulary rows, H hidden, L layers):
- a checkpoint (agentopd.trainer.checkpoint: torch.distributed.checkpoint of the fp32 master weights and AdamW's two
  fp32 moments, the RNG states, meta.json, config.json): 4P + 8P, plus 4VH more when the embeddings are tied (the model
  state dict names the shared table twice and DCP writes it under both names; the optimizer holds it once), plus
  ~8 KiB of records per tensor (11 tensors a Qwen3 layer, 3 more). Measured on CPU 2026-11-29 at db33513 (tests/test_disk_plan.py
  checks it against a written checkpoint): within 1% of what a 0.2M-5.7M model wrote, tied or not.
- final/ (Trainer.export: save_pretrained of the fp32 weights, the table once, and the tokenizer): 4P + 32 MiB.
- how many at once: the run writes a checkpoint every `run.checkpoint_every` steps and at its last step; each is written
  whole beside the ones kept before (agentopd.rundir.write_checkpoint), then the finished ones beyond
  `run.keep_checkpoints` are removed (0 keeps all). A resumed run's checkpoints already on disk are in its used space;
  final/ is written after the last checkpoint.
Not counted: trajectories.db, metrics.jsonl and tb/ (they grow with the steps' tokens), and the extra checkpoint a
Ctrl-C or an out-of-memory writes between two scheduled ones. The plan fits when its peak stays within the free space
less SLACK_GIB (for those files), or within `run.disk_gib` for a run that must leave the rest of the disk alone.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agentopd.shape import ModelShape

if TYPE_CHECKING:
    from agentopd.config import Config
    from agentopd.rundir import CheckpointError, RunDir

GIB = 2**30
TENSOR_RECORD_BYTES = 8 * 1024  # DCP's per-tensor records in a checkpoint (measured: 7.6-9.5 KiB, model + optimizer)
TENSORS_PER_LAYER = 11  # Qwen3: q, k, v, o, q_norm, k_norm, gate, up, down, two norms
CHECKPOINT_FILES = 64 * 1024  # rng_rank<r>.pt (~14 KiB), meta.json, config.json, DCP's .metadata
EXPORT_FILES = 32 * 2**20  # final/'s tokenizer (Qwen3's tokenizer.json is ~11 MiB), config and generation config
SLACK_GIB = 1.0  # of the free space, for the store, the metrics and TensorBoard


def size(gib: float) -> str:
    """A size for a message: GiB, or MiB below a tenth of one (the embedded models' checkpoints)."""
    return f"{gib:.1f} GiB" if gib >= 0.1 or gib == 0 else f"{gib * 1024:.1f} MiB"


def checkpoint_bytes(s: ModelShape) -> int:
    """Bytes one resumable checkpoint of a student of shape `s` takes on disk (the module docstring)."""
    table_twice = s.vocab * s.hidden if s.tied else 0
    tensors = TENSORS_PER_LAYER * s.layers + 3
    return 4 * (s.params + table_twice) + 8 * s.params + TENSOR_RECORD_BYTES * tensors + CHECKPOINT_FILES


def export_bytes(s: ModelShape) -> int:
    """Bytes of final/: the student's fp32 weights as a Hugging Face folder, and its tokenizer."""
    return 4 * s.params + EXPORT_FILES


def checkpoint_steps(steps: int, every: int, start: int = 0) -> list[int]:
    """The steps after `start` whose checkpoint a run of `steps` steps writes: every `every`-th and the last."""
    due = {k for k in range(start + 1, steps + 1) if every and k % every == 0}
    return sorted(due | ({steps} if steps > start else set()))


def checkpoint_counts(writes: int, keep: int, existing: int = 0) -> tuple[int, int]:
    """How many checkpoints the run adds to the disk at its peak and after its last one: `writes` new ones, each written
    whole beside the finished ones kept (`keep`, 0 = all; `existing` already there when a run resumes), then those beyond
    `keep` removed, the oldest first (after the last one: fewer than `existing` where old ones went)."""
    on_disk, peak = existing, existing
    for _ in range(writes):
        peak = max(peak, on_disk + 1)  # the new one complete, before the oldest goes
        on_disk = on_disk + 1 if keep == 0 else min(keep, on_disk + 1)
    return peak - existing, on_disk - existing


def need_gib(writes: int, keep: int, existing: int, checkpoint_gib: float, export_gib: float) -> float:
    """GiB a run adds to its disk at the peak: the checkpoints beside the kept ones, or the kept ones and final/ after
    the last (checkpoint_counts)."""
    peak, after = checkpoint_counts(writes, keep, existing)
    return max(peak * checkpoint_gib, after * checkpoint_gib + export_gib, 0.0)


@dataclass
class DiskPlan:
    """What the run writes at its peak against the space it may fill (the module docstring)."""

    folder: Path  # where the free space was read (the run directory, or its nearest existing parent)
    free_gib: float  # free there at start, or run.disk_gib
    budget: bool  # free_gib is run.disk_gib, not the file system's figure
    checkpoint_gib: float
    writes: int  # checkpoints the run writes
    keep: int
    export_gib: float  # 0 when final/ is already there (a resumed run that finished before)
    existing: int  # a resumed run's finished checkpoints, already in the used space

    @property
    def checkpoints(self) -> int:
        """Checkpoints added at the peak."""
        return checkpoint_counts(self.writes, self.keep, self.existing)[0]

    @property
    def need_gib(self) -> float:
        return need_gib(self.writes, self.keep, self.existing, self.checkpoint_gib, self.export_gib)

    def remedies(self) -> str:
        """What to change, in words: the keys that lower this plan's peak (none where one checkpoint and final/ are
        all it writes, as at a resumed run's last step), then another disk (a resume reads its run directory: that
        moves whole, or its disk gets room)."""
        keys = []
        if self.keep != 1 and need_gib(self.writes, 1, self.existing, self.checkpoint_gib, self.export_gib) < self.need_gib:
            keys.append("run.keep_checkpoints=1 (the newest kept; a new one is complete before the old one goes)")
        if self.writes > 1 and need_gib(1, self.keep, self.existing, self.checkpoint_gib, self.export_gib) < self.need_gib:
            keys.append("run.checkpoint_every (fewer checkpoints)")
        if self.budget:
            keys.append("run.disk_gib (the space the run may fill)")
        if not self.existing:
            return "change " + ", ".join([*keys, "--run-dir on a larger disk"])
        elsewhere = (f"make room under {self.folder} (the run's older checkpoints can go) or move the run directory "
                     "whole to a larger disk and --resume it there")  # fmt: skip
        return f"change {', '.join(keys)}, or {elsewhere}" if keys else elsewhere

    @property
    def room_gib(self) -> float:
        return self.free_gib if self.budget else max(0.0, self.free_gib - SLACK_GIB)

    @property
    def fits(self) -> bool:
        return self.need_gib <= self.room_gib

    def line(self, judged: bool = True) -> str:
        """The plan in one line; `judged=False`: what the run writes alone (a plan for another machine's disk)."""
        kept = "all kept" if self.keep == 0 else f"run.keep_checkpoints={self.keep}"
        need = (f"disk: {size(self.need_gib)} at the peak ({self.checkpoints} of {self.writes} checkpoint(s) of "
                f"{size(self.checkpoint_gib)}, {kept}; final/ {size(self.export_gib)})")  # fmt: skip
        if not judged:
            return need
        where = "run.disk_gib" if self.budget else f"free under {self.folder}"
        room = "" if self.budget else f", less {SLACK_GIB:g} for the store and logs"
        return f"{need} of {size(self.free_gib)} {where}{room}: {'fits' if self.fits else 'DOES NOT FIT'}"

    def check(self) -> None:
        if not self.fits:
            raise DiskPlanError(self)


class DiskPlanError(ValueError):
    """A run whose checkpoints cannot fit its disk: one line naming the shortfall and the keys to change."""

    def __init__(self, plan: DiskPlan) -> None:
        self.plan = plan
        where = (f"run.disk_gib allows {size(plan.free_gib)}" if plan.budget else
                 f"{size(plan.free_gib)} are free under {plan.folder} ({SLACK_GIB:g} GiB of it left to the store and logs)")  # fmt: skip
        super().__init__(
            f"this run's checkpoints do not fit its disk: it writes {size(plan.need_gib)} at its peak ({plan.checkpoints} "
            f"checkpoint(s) of {size(plan.checkpoint_gib)} and final/ {size(plan.export_gib)}), {where}: short by "
            f"{size(plan.need_gib - plan.room_gib)}; {plan.remedies()}"
        )


def free_gib(path: Path) -> tuple[Path, float]:
    """The free space (for an unprivileged writer) of the file system `path` is on, from its nearest existing folder."""
    folder = path.absolute()
    while not folder.exists():
        folder = folder.parent
    return folder, shutil.disk_usage(folder).free / GIB


def plan_disk(cfg: Config, student: ModelShape, rd: RunDir, start: int = 0) -> DiskPlan:
    """The plan of a run from its config (`run.steps`, `checkpoint_every`, `keep_checkpoints`, `disk_gib`), its
    student's shape and its run directory (a resumed run's checkpoints at `start` and before are there already)."""
    r = cfg.run
    writes = len(checkpoint_steps(r.steps, r.checkpoint_every, start))
    existing = len(rd.finished_checkpoints()) if start else 0
    folder, free = free_gib(rd.root)
    return DiskPlan(
        folder=folder, free_gib=r.disk_gib if r.disk_gib is not None else free, budget=r.disk_gib is not None,
        checkpoint_gib=checkpoint_bytes(student) / GIB, writes=writes, keep=r.keep_checkpoints, export_gib=0.0 if rd.final.is_dir() else export_bytes(student) / GIB, existing=existing,
    )  # fmt: skip


def checkpoint_failed(rd: RunDir, step: int, error: BaseException, plan: DiskPlan | None) -> CheckpointError:
    """The one line of a checkpoint write that failed (agentopd.rundir.write_checkpoint left nothing of it): why, the
    free space, and the checkpoint a --resume would take."""
    from agentopd.rundir import CheckpointError

    folder, free = free_gib(rd.checkpoints)
    took = f", a checkpoint takes {size(plan.checkpoint_gib)}" if plan is not None else ""
    last = rd.latest_checkpoint()
    kept = (f"the last good checkpoint is {last.name} (--resume continues from it)" if last is not None
            else "there is no earlier checkpoint to resume from")  # fmt: skip
    return CheckpointError(f"checkpoint of step {step} not written: {write_error(error)} ({size(free)} free under "
                           f"{folder}{took}); nothing of it was kept, {kept}")  # fmt: skip


def write_error(error: BaseException) -> str:
    """What made a checkpoint write fail, in a few words: the operating system's error where one is inside (a full disk:
    'No space left on device'), through torch.distributed.checkpoint's per-rank failures, Ray's task errors and the
    exceptions' causes; else the first line of the innermost error."""
    stack, seen, inner = [error], set(), error
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return os.strerror(e.errno) + (f": {e.filename}" if e.filename else "")
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException: rank -> (error, tb)
        nested = [f[0] for f in failures.values() if isinstance(f, tuple) and f] if isinstance(failures, dict) else []
        nested += [getattr(e, "cause", None), e.__cause__, e.__context__]  # Ray's RayTaskError keeps the task's in .cause
        nested = [n for n in nested if isinstance(n, BaseException)]
        if nested:
            inner = nested[0]
        stack += nested
    text = str(inner).strip()
    return f"{type(inner).__name__}: {text.splitlines()[0]}" if text else type(inner).__name__
