"""The Ray actors of the Ray backend: one class per role, each a thin shell around the stage code.

    RolloutWorker   an engine + env instances of every source; plays planned episodes, takes new weights
    TeacherWorker   one teacher model; scores token streams (one pool of replicas per teacher)
    TrainerWorker   one rank of the trainer's torch.distributed group (FSDP2 `Trainer`)

They are plain classes here; `agentopd.backends.ray` wraps them with `ray.remote(...)` and the
resources of `ray.*`. Each sets its torch thread count and, for a GPU role, uses `cuda`.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentopd.backends.stages import STUDENT, Players, RunContext, build_teacher
from agentopd.backends.weight_sync import (
    WeightGroup,
    WeightLayout,
    flatten,
    from_ipc,
    ipc_handle,
)
from agentopd.memory_plan import PhaseMemory, measure_since_last
from agentopd.plan import Planned
from agentopd.rollout import RolloutConfig
from agentopd.types import Episode

if TYPE_CHECKING:
    from agentopd.batch import TrainSample
    from agentopd.teacher import TeacherMode, TeacherScores
    from agentopd.trainer.config import LossKind
    from agentopd.types import TokenStream


class _OnGPU:
    """What every actor answers about its process and GPU."""

    def pid(self) -> int:
        return os.getpid()

    def gpu_ids(self) -> list[str]:
        """The physical GPUs this actor was given (Ray's ids; [] without one)."""
        import ray

        return [str(g) for g in ray.get_gpu_ids()]

    def memory_peak(self) -> PhaseMemory:
        """This actor's PhaseMemory since the last call (zeros without CUDA)."""
        return measure_since_last()


class _WeightMember(_OnGPU):
    """What trainer rank 0 and the rollout workers share as members of a weight group (weight_sync.py)."""

    weight_group: WeightGroup | None = None

    def leave_weights(self) -> None:
        if self.weight_group is not None:
            self.weight_group.close()
        self.weight_group = None


def _role_ctx(ctx: RunContext, gpus: float, threads: int) -> RunContext:
    os.environ.update(ctx.env_vars)  # e.g. AGENTOPD_HOME, where sql_db keeps its generated database
    torch.set_num_threads(threads)
    if gpus > 0:
        return dataclasses.replace(ctx, device=torch.device("cuda"), dtype=torch.bfloat16)
    return dataclasses.replace(ctx, device=torch.device("cpu"), dtype=torch.float32)


class RolloutWorker(_WeightMember):
    def __init__(self, ctx: RunContext, gpus: float, threads: int, weights: dict | None = None, version: int = 0):
        from transformers import AutoTokenizer

        self.ctx = _role_ctx(ctx, gpus, threads)
        self.players = Players(self.ctx, AutoTokenizer.from_pretrained(ctx.student_ref))
        self.players.engine(STUDENT)  # load now: start-up cost belongs to set-up, not the first step
        self.version = 0
        self._timed: dict[str, dict[str, float]] = {}  # a tagged play's change of the engine's timings (take_timings)
        if weights is not None:
            self.update_weights(weights, version)

    def play(self, planned: list[Planned], config: RolloutConfig, who: str, tag: str | None = None) -> list[Episode]:
        """Episodes of `planned`; the student's carry the weights version they were played with. With a `tag`, the
        play's share of the student's engine timings (FastEngine.timings) is kept for `take_timings`: an actor runs
        one call at a time, so the share is this play's alone, whatever else is queued behind it."""
        if who == STUDENT:
            planned = [Planned(p.source, dataclasses.replace(p.spec, policy_version=self.version)) for p in planned]
        engine = self.players.engine(STUDENT) if tag is not None else None
        before = dict(getattr(engine, "timings", None) or {})
        episodes = self.players.play(planned, config, None, who)
        after = getattr(engine, "timings", None) or {}
        if tag is not None and after:
            self._timed[tag] = {k: v - before.get(k, 0) for k, v in after.items()}
        return episodes

    def take_timings(self, tags: list[str]) -> dict[str, float]:
        """The engine timings of the plays tagged `tags` (played here), summed; each tag is forgotten."""
        out: dict[str, float] = {}
        for tag in tags:
            for k, v in self._timed.pop(tag, {}).items():
                out[k] = out.get(k, 0) + v
        return out

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> int:
        self.players.update_weights(state_dict)
        self.version = version
        return version

    def sleep(self) -> float:
        """Free the engine's KV pool for the trainer on this GPU (`ray.engine_sleep`); its seconds."""
        t0 = time.perf_counter()
        self.players.sleep()
        return time.perf_counter() - t0

    def wake(self) -> None:
        self.players.wake()

    def drop(self, who: str) -> None:
        """Close the engine of `who` (a teacher whose evals are done) and give its memory back to the GPU: the
        teacher actor sharing this GPU allocates from another process, which this one's cached blocks would starve."""
        self.players.drop(who)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ---- weight sync other than the object store (agentopd.backends.weight_sync) ----------------
    def join_weights(self, addr: str, port: int, rank: int, world: int) -> int:
        self.leave_weights()
        self.weight_group = WeightGroup.join(addr, port, rank, world, self.ctx.device)
        return rank

    def receive_weights(self, layout: WeightLayout, version: int) -> int:
        return self.update_weights(self.weight_group.receive(layout), version)

    def load_ipc(self, handle: Any, layout: WeightLayout, version: int) -> int:
        """Copy the weights out of trainer rank 0's shared buffer (same GPU) into the engine."""
        flat = from_ipc(handle)
        version = self.update_weights(layout.views(flat), version)
        del flat
        torch.cuda.synchronize()
        return version


@dataclasses.dataclass(frozen=True)
class HiddenRef:
    """A stream's teacher hidden rows (TeacherScores.hidden, HIDDEN mode) left in Ray's object store: the driver
    passes the reference on in its TrainSample and the trainer rank that trains on the stream fetches the rows
    (`fetch_hidden`), so the rows (~4.5 GB a step for an 8B teacher's 540k tokens) no longer go through the driver."""

    ref: Any  # the ObjectRef of one return value of TeacherWorker.score_apart
    rows: int  # the stream's response length

    def __len__(self) -> int:
        return self.rows


def with_hidden_refs(scores: list[TeacherScores], refs: list[Any]) -> list[TeacherScores]:
    """The scores of `TeacherWorker.score_apart` (its first return value) with each stream's rows as a HiddenRef to
    its own return value (`refs`, the others in order)."""
    return [dataclasses.replace(s, hidden=HiddenRef(ref, len(s.logprobs))) for s, ref in zip(scores, refs, strict=True)]


def fetch_hidden(samples: list[TrainSample]) -> list[TrainSample]:
    """`samples` with every HiddenRef replaced by the rows it names (one ray.get for all of them)."""
    import ray

    refs = [s.teacher_hidden.ref for s in samples if isinstance(s.teacher_hidden, HiddenRef)]
    if not refs:
        return samples
    rows = iter(ray.get(refs))
    return [dataclasses.replace(s, teacher_hidden=next(rows)) if isinstance(s.teacher_hidden, HiddenRef) else s for s in samples]


class TeacherWorker(_OnGPU):
    def __init__(self, ctx: RunContext, name: str, gpus: float, threads: int):
        self.teacher = build_teacher(_role_ctx(ctx, gpus, threads), name)

    def score(self, streams: list[TokenStream], mode: TeacherMode) -> list[TeacherScores]:
        return self.teacher.score(streams, mode=mode)

    def score_apart(self, streams: list[TokenStream], mode: TeacherMode) -> tuple[list[TeacherScores] | torch.Tensor | None, ...]:
        """`score` with the hidden rows returned apart, for `.options(num_returns=len(streams) + 1)`: the scores
        without their rows, then each stream's rows (None outside HIDDEN mode) as a return value of its own."""
        scores = self.score(streams, mode)
        return ([dataclasses.replace(s, hidden=None) for s in scores], *(s.hidden for s in scores))

    def score_played(self, episodes: list[Episode], idx: list[int], mode: TeacherMode) -> tuple[list[TeacherScores] | torch.Tensor | None, ...]:
        """`score_apart` of the episodes `idx` of one work item, passed as the rollout call's ObjectRef: Ray runs it
        once the item is played (RayBackend.score_ahead)."""
        return self.score_apart([episodes[i].tokens for i in idx], mode)

    def head_weight(self) -> torch.Tensor:
        return self.teacher.head_weight()

    def reconnects(self) -> list[str]:
        """A server teacher's reconnects since the last call (ServerTeacher.take_reconnects); [] for a local one."""
        take = getattr(self.teacher, "take_reconnects", None)
        return take() if take is not None else []


class TrainerWorker(_WeightMember):
    """One rank. `rendezvous()` on rank 0 gives the address; `init(addr, port)` on every rank (at once)
    forms the process group (gloo on CPU, NCCL on GPU) and builds the FSDP2 Trainer."""

    def __init__(self, ctx: RunContext, rank: int, world: int, gpus: float, threads: int):
        self.ctx = _role_ctx(ctx, gpus, threads)
        self.rank, self.world = rank, world

    def rendezvous(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init(self, addr: str, port: int) -> int:
        import torch.distributed as dist

        from agentopd.trainer import Trainer

        backend = "nccl" if self.ctx.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=self.rank, world_size=self.world)
        self.trainer = Trainer(str(self.ctx.student_ref), self.ctx.trainer_cfg, device=self.ctx.device,
                               vocab_size=self.ctx.vocab_size)
        return self.rank

    def train(self, samples: list[TrainSample], head: torch.Tensor | list | None, loss: LossKind | None = None,
              temperature: float | None = None) -> dict[str, float]:
        """`head`: the teacher's lm_head, or one per teacher (tensors, or the ObjectRefs the backend keeps of them)."""
        import ray

        if isinstance(head, list) and any(isinstance(h, ray.ObjectRef) for h in head):
            head = ray.get(head)
        return self.trainer.train_step(fetch_hidden(samples), teacher_head_VH=head, loss=loss, temperature=temperature)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every rank must call it (a collective gather); rank 0 returns the full weights, the others {}."""
        return self.trainer.state_dict_for_engine()

    # ---- weight sync other than the object store (agentopd.backends.weight_sync) ----------------
    def weight_layout(self, dtype: torch.dtype) -> WeightLayout:
        return WeightLayout.of(self.trainer.hf, dtype)

    def host_weights(self, world: int) -> tuple[str, int]:
        """Rank 0: a store for a new weight group of `world` members (itself and the rollout workers)."""
        self.leave_weights()
        self._weight_store, addr, port = WeightGroup.host(world)
        return addr, port

    def join_weights(self, addr: str, port: int, world: int) -> int:
        self.weight_group = WeightGroup.join(addr, port, 0, world, self.ctx.device, store=self._weight_store)
        return 0

    def send_weights(self, layout: WeightLayout) -> float:
        """Every rank (the gather is a collective); rank 0 broadcasts. Its seconds."""
        t0 = time.perf_counter()
        tensors = self.trainer.full_tensors()
        if self.rank == 0:
            self.weight_group.send(layout, tensors)
        else:
            for _ in tensors:
                pass
        return time.perf_counter() - t0

    def share_weights(self, layout: WeightLayout) -> Any:
        """Every rank (a collective); rank 0 keeps the weights in one GPU buffer and returns its IPC handle."""
        tensors = self.trainer.full_tensors()
        if self.rank != 0:
            for _ in tensors:
                pass
            return None
        self._shared = flat = flatten(layout, tensors, self.ctx.device)
        torch.cuda.synchronize()
        return ipc_handle(flat)

    def unshare_weights(self) -> None:
        self._shared = None

    def step(self) -> int:
        return self.trainer.step

    def save(self, path: str, extra: dict[str, Any]) -> None:
        self.trainer.save_checkpoint(Path(path), extra=extra)

    def load(self, path: str) -> dict[str, Any]:
        return self.trainer.load_checkpoint(Path(path))

    def export(self, out_dir: str, tokenizer_dir: str) -> None:
        from transformers import AutoTokenizer

        self.trainer.export(Path(out_dir), AutoTokenizer.from_pretrained(tokenizer_dir))

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
