"""Weight sync of the Ray backend: the trainer's new weights into every rollout engine (`ray.weight_sync`).

    object_store  rank 0's full state dict goes into Ray's object store; each worker loads it (CPU runs)
    broadcast     a process group of its own: trainer rank 0 (root) and every rollout worker; the weights
                  go through it in buckets, cast to the engines' dtype (NCCL on GPUs, gloo on CPU)
    ipc           trainer rank 0 and the workers share one GPU (colocated): rank 0 gathers the weights into
                  one flat GPU buffer and hands out a CUDA IPC handle to it; each worker copies from it

    layout = WeightLayout.of(named_params, dtype)          # what is sent, in order (every member knows it)
    host = WeightGroup.host(world)                         # trainer rank 0: a store on a free port
    group = WeightGroup.join(addr, port, rank, world, device)   # every member at once (rank 0 with the host)
    group.send(layout, named_params)                       # rank 0
    state_dict = group.receive(layout)                     # ranks 1..n: HF-named views of one flat buffer

The weight group lives outside the trainer's own torch.distributed group (a ProcessGroupNCCL/Gloo built
on a TCPStore), so engines never join the trainer's collectives. Tied weights are sent once and named
again on arrival (`WeightLayout.aliases`). A member that dies leaves the group unusable: the backend
forms a new one (a new store, every member joins again) before the next sync.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 << 20  # what rank 0 stages and sends at once


class WeightSync(StrEnum):
    """`ray.weight_sync`: how the trainer's weights reach the rollout engines (the module docstring)."""

    AUTO = "auto"  # resolved by the backend from where Ray placed trainer rank 0 and the workers
    OBJECT_STORE = "object_store"
    BROADCAST = "broadcast"
    IPC = "ipc"


@dataclass(frozen=True)
class WeightLayout:
    """The tensors a sync carries, in the order they are sent: HF names and shapes, one dtype, and the
    tied names that arrive as another name's tensor."""

    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    dtype: torch.dtype
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> the sent name it shares storage with

    @classmethod
    def of(cls, model: torch.nn.Module, dtype: torch.dtype) -> WeightLayout:
        """The layout of `model`'s state dict (parameters and buffers it persists), tied names as aliases: the
        order and names of `Trainer.full_tensors` (both walk `unique_state`)."""
        from agentopd.trainer.checkpoint import unique_state

        tensors, aliases = [], {}
        for name, t, first in unique_state(model):
            if name == first:
                tensors.append((name, tuple(t.shape)))
            else:
                aliases[name] = first
        return cls(tuple(tensors), dtype, aliases)

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.tensors)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """HF-named views into `flat` (the tensors laid end to end), aliases included."""
        out, at = {}, 0
        for name, shape in self.tensors:
            n = math.prod(shape)
            out[name] = flat[at : at + n].view(shape)
            at += n
        out.update({alias: out[name] for alias, name in self.aliases.items()})
        return out


def flatten(layout: WeightLayout, named: Iterable[tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """The layout's tensors cast and laid end to end in one new buffer on `device` (the ipc path)."""
    flat = torch.empty(layout.numel, dtype=layout.dtype, device=device)
    views = layout.views(flat)
    for name, t in named:
        if name in views and name not in layout.aliases:
            views[name].copy_(t)
    return flat


class WeightGroup:
    """One weight-broadcast group: rank 0 sends, every other rank receives (module docstring)."""

    def __init__(self, pg: Any, rank: int, world: int, device: torch.device, store: Any):
        self.pg, self.rank, self.world, self.device = pg, rank, world, device
        self._store = store  # rank 0's store must outlive the group

    @staticmethod
    def host(world: int, timeout_s: float = 300.0) -> tuple[Any, str, int]:
        """A master store on a free port of this node (trainer rank 0): (store, address, port)."""
        store = dist.TCPStore("0.0.0.0", 0, world, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        return store, _node_address(), store.port

    @classmethod
    def join(cls, addr: str, port: int, rank: int, world: int, device: torch.device, store: Any = None,
             timeout_s: float = 300.0) -> WeightGroup:  # fmt: skip
        """Every member calls it at once (rank 0 with the store `host` gave it); returns when all have."""
        if store is None:
            store = dist.TCPStore(addr, port, world, is_master=False, timeout=timedelta(seconds=timeout_s))
        store = dist.PrefixStore("agentopd/weights", store)
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=timeout_s)  # a member that died mid-sync fails it after this, not never
            pg = dist.ProcessGroupNCCL(store, rank, world, opts)
        else:
            pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout_s))
        group = cls(pg, rank, world, device, store)
        group._broadcast(torch.zeros(1, device=device))  # every member connected before the first sync
        return group

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()

    def send(self, layout: WeightLayout, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = BUCKET_BYTES) -> None:
        """Rank 0: every tensor of `layout` from `named` (in layout order), cast, in buckets."""
        bucket = torch.empty(max(1, bucket_bytes // layout.dtype.itemsize), dtype=layout.dtype, device=self.device)
        used = 0
        order = iter(layout.tensors)
        for name, t in named:
            if name in layout.aliases:
                continue
            want, shape = next(order)
            if name != want or tuple(t.shape) != shape:
                raise ValueError(f"weight sync: got {name} {tuple(t.shape)}, the layout expects {want} {shape} next")
            flat = t.detach().reshape(-1)
            at = 0
            while at < flat.numel():  # a tensor larger than the bucket spans several
                n = min(flat.numel() - at, bucket.numel() - used)
                bucket[used : used + n].copy_(flat[at : at + n])
                used, at = used + n, at + n
                if used == bucket.numel():
                    self._broadcast(bucket)
                    used = 0
        if next(order, None) is not None:
            raise ValueError("weight sync: the trainer sent fewer tensors than the layout has")
        if used:
            self._broadcast(bucket[:used])

    def receive(self, layout: WeightLayout, bucket_bytes: int = BUCKET_BYTES) -> dict[str, torch.Tensor]:
        """Ranks 1..n: the layout's tensors (views of one flat buffer), received bucket by bucket."""
        flat = torch.empty(layout.numel, dtype=layout.dtype, device=self.device)
        step = max(1, bucket_bytes // layout.dtype.itemsize)
        for at in range(0, flat.numel(), step):
            self._broadcast(flat[at : at + step])
        return layout.views(flat)

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None) or getattr(self.pg, "abort", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:  # already torn down
                pass
        self.pg = None


def ipc_handle(flat: torch.Tensor) -> Any:
    """A picklable CUDA IPC handle to `flat` (its owner must keep it alive until every reader copied it)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(flat)


def from_ipc(handle: Any) -> torch.Tensor:
    """The tensor behind `ipc_handle(...)`, mapped into this process (same GPU)."""
    rebuild, args = handle
    return rebuild(*args)


def _node_address() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (tests): this host's loopback
        return socket.gethostbyname("localhost")

