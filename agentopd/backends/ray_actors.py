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
from pathlib import Path
from typing import Any

import torch

from agentopd.backends.stages import STUDENT, Players, RunContext, build_teacher
from agentopd.plan import Planned
from agentopd.rollout import RolloutConfig
from agentopd.types import Episode


def _role_ctx(ctx: RunContext, gpus: float, threads: int) -> RunContext:
    os.environ.update(ctx.env_vars)  # e.g. AGENTOPD_HOME, where sql_db keeps its generated database
    torch.set_num_threads(threads)
    if gpus > 0:
        return dataclasses.replace(ctx, device=torch.device("cuda"), dtype=torch.bfloat16)
    return dataclasses.replace(ctx, device=torch.device("cpu"), dtype=torch.float32)


class RolloutWorker:
    def __init__(self, ctx: RunContext, gpus: float, threads: int, weights: dict | None = None, version: int = 0):
        from transformers import AutoTokenizer

        self.ctx = _role_ctx(ctx, gpus, threads)
        self.players = Players(self.ctx, AutoTokenizer.from_pretrained(ctx.student_ref))
        self.players.engine(STUDENT)  # load now: start-up cost belongs to set-up, not the first step
        self.version = 0
        if weights is not None:
            self.update_weights(weights, version)

    def play(self, planned: list[Planned], config: RolloutConfig, who: str) -> list[Episode]:
        """Episodes of `planned`; the student's carry the weights version they were played with."""
        if who == STUDENT:
            planned = [Planned(p.source, dataclasses.replace(p.spec, policy_version=self.version)) for p in planned]
        return self.players.play(planned, config, None, who)

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> int:
        self.players.update_weights(state_dict)
        self.version = version
        return version

    def pid(self) -> int:
        return os.getpid()


class TeacherWorker:
    def __init__(self, ctx: RunContext, name: str, gpus: float, threads: int):
        self.teacher = build_teacher(_role_ctx(ctx, gpus, threads), name)

    def score(self, streams: list[Any], mode: Any) -> list[Any]:
        return self.teacher.score(streams, mode=mode)

    def head_weight(self) -> torch.Tensor:
        return self.teacher.head_weight()


class TrainerWorker:
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
        self.trainer = Trainer(str(self.ctx.student_ref), self.ctx.trainer_cfg, device=self.ctx.device)
        return self.rank

    def train(self, samples: list[Any], head: torch.Tensor | None, loss: Any = None, temperature: float | None = None) -> dict[str, float]:
        return self.trainer.train_step(samples, teacher_head_VH=head, loss=loss, temperature=temperature)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every rank must call it (a collective gather); rank 0 returns the full weights, the others {}."""
        return self.trainer.state_dict_for_engine()

    def step(self) -> int:
        return self.trainer.step

    def pid(self) -> int:
        return os.getpid()

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
