"""Placement of the Ray backend's actors: what each role gets, reserved up front, or a clear error.

    cluster = Cluster.of(ray)                                   # what the cluster has (free and in all)
    placement = place(ray_cfg, teachers=["calculator", "sql_db"], cluster=cluster)        # or PlacementError
    reservation = Reservation.make(ray, placement, timeout_s=ray_cfg.placement_timeout_s)  # or PlacementError
    Actor.options(**reservation.options("rollout", 0)).remote(...)

Sizing (`ray.cpus_per_<role>` null, the default): the free CPUs are shared equally among every actor
of the roles left null, at most 1 CPU each. Fractions are fine: on CPU each role mostly waits while
another stage runs (rollout during training, the trainer during rollout, teachers in between). A
share below `ray.min_cpus_per_actor` (default 0.25: at most four model-holding processes per core)
is refused: the run fails before any actor starts, naming the roles, what they need and what the
cluster has. A role given explicitly gets exactly that; roles asking for nothing (0 CPU, 0 GPU)
are not reserved.

Reservation: one placement group holds a bundle per reserved actor (rollout workers, each teacher's
replicas, trainer ranks) in `bundle_order`: the largest GPU shares first, trainer ranks first among equal shares,
then replica by replica (rollout worker 0, each teacher's replica 0, rollout worker 1, ...). Ray gives a bundle
whole GPUs in index order and a fraction to the GPU it fills best (`gpu_index` models it), so rollout workers
and teacher replicas of half a GPU pair up, one of each on a GPU: in a synchronous step each has the whole GPU
while the other waits (rollout, then scoring), where rollout workers packed together would play on one GPU with
the teachers idle on the next. It must be ready within `ray.placement_timeout_s`; otherwise it is removed
and the run fails with what was asked and what is free. A replacement actor (a dead rollout worker,
teacher replica or trainer rank) goes back into its predecessor's bundle.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Collection

    from agentopd.config import RayConfig

ROLLOUT, TRAINER = "rollout", "trainer"


def teacher_role(name: str) -> str:
    return f"teacher/{name}"


class PlacementError(ValueError):
    """The cluster cannot hold what the run asks for (the message says what and why)."""


@dataclass(frozen=True)
class Cluster:
    """CPUs and GPUs of a Ray cluster: in all, free now, and on its largest node."""

    cpus: float
    gpus: float
    free_cpus: float
    free_gpus: float
    node_cpus: float  # the most CPUs one node has (a bundle never spans nodes)
    node_gpus: float

    @classmethod
    def of(cls, ray: Any) -> Cluster:
        total, free = ray.cluster_resources(), ray.available_resources()
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        return cls(
            cpus=total.get("CPU", 0.0), gpus=total.get("GPU", 0.0),
            free_cpus=free.get("CPU", 0.0), free_gpus=free.get("GPU", 0.0),
            node_cpus=max((n.get("CPU", 0.0) for n in nodes), default=0.0),
            node_gpus=max((n.get("GPU", 0.0) for n in nodes), default=0.0),
        )  # fmt: skip

    def describe(self) -> str:
        return f"{_n(self.free_cpus)} CPU and {_n(self.free_gpus)} GPU free ({_n(self.cpus)} CPU, {_n(self.gpus)} GPU in all)"


@dataclass(frozen=True)
class Role:
    """`count` actors of one role, each with `cpus` CPUs and `gpus` GPUs."""

    name: str  # rollout | teacher/<name> | trainer
    count: int
    cpus: float
    gpus: float
    label: str  # how the error messages call it: "2 rollout workers"

    @property
    def reserved(self) -> bool:
        return self.cpus > 0 or self.gpus > 0

    def describe(self) -> str:
        return f"{self.label} x {_n(self.cpus)} CPU" + (f" + {_n(self.gpus)} GPU" if self.gpus else "")


@dataclass(frozen=True)
class Placement:
    """Every role's actors and what each gets; `strategy` is the placement group's (ray.placement_strategy)."""

    roles: list[Role]
    strategy: str = "PACK"

    def role(self, name: str) -> Role:
        return next(r for r in self.roles if r.name == name)

    @property
    def cpus(self) -> float:
        return sum(r.count * r.cpus for r in self.roles)

    @property
    def gpus(self) -> float:
        return sum(r.count * r.gpus for r in self.roles)

    def describe(self) -> str:
        return " + ".join(r.describe() for r in self.roles) + f" = {_n(self.cpus)} CPU, {_n(self.gpus)} GPU"


def _n(x: float) -> str:
    return f"{x:g}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _asked(rc: RayConfig, teachers: list[str], servers: Collection[str] = ()) -> list[tuple[str, int, float | None, float, str]]:
    """Every role the run asks for, in the order `bundle_order` breaks ties by: (name, count, cpus or None = auto,
    gpus, label). A teacher behind a server (`servers`) is scored over HTTP: its replicas are clients that hold no
    model, so they get no GPU share whatever `ray.gpus_per_teacher` says."""
    per_teacher = _count(rc.teacher_replicas, "replica")

    def teacher(t: str) -> tuple[str, int, float | None, float, str]:
        if t in servers:
            return teacher_role(t), rc.teacher_replicas, rc.cpus_per_teacher, 0.0, f"teacher {t!r} ({per_teacher}, a server's clients: no GPU)"
        return teacher_role(t), rc.teacher_replicas, rc.cpus_per_teacher, rc.gpus_per_teacher, f"teacher {t!r} ({per_teacher})"

    return [
        (ROLLOUT, rc.rollout_workers, rc.cpus_per_rollout_worker, rc.gpus_per_rollout_worker, _count(rc.rollout_workers, "rollout worker")),
        *(teacher(t) for t in teachers),
        (TRAINER, rc.trainer_workers, rc.cpus_per_trainer_worker, rc.gpus_per_trainer_worker, _count(rc.trainer_workers, "trainer rank")),
    ]  # fmt: skip


def gpu_roles(rc: RayConfig, teachers: list[str]) -> list[Role]:
    """The roles as `place` makes them, GPU shares only (no CPUs: they place nothing on a GPU), for `gpu_index`
    without a cluster (the memory plan). `teachers` are the ones that hold a model: a server's clients take no GPU,
    so leaving them out places every other actor where Ray does."""
    return [Role(name, n, 0.0, g, label) for name, n, _, g, label in _asked(rc, teachers)]


def place(rc: RayConfig, teachers: list[str], cluster: Cluster, servers: Collection[str] = ()) -> Placement:
    """Every role's size (module docstring); raises PlacementError when the cluster cannot hold them. `servers`: the
    teachers (of `teachers`) scored through a server, whose replicas take no GPU."""
    asked = _asked(rc, teachers, servers)
    fixed = sum(n * c for _, n, c, _, _ in asked if c is not None)
    auto = [(label, n) for _, n, c, _, label in asked if c is None]
    share = 0.0
    if auto:
        actors = sum(n for _, n in auto)
        share = min(1.0, math.floor(100 * max(cluster.free_cpus - fixed, 0.0) / actors) / 100)
        if share < rc.min_cpus_per_actor:
            fixed_note = f" after the {_n(fixed)} CPU asked for explicitly" if fixed else ""
            raise PlacementError(
                f"ray: {actors} actors ({', '.join(label for label, _ in auto)}) need at least "
                f"ray.min_cpus_per_actor={_n(rc.min_cpus_per_actor)} CPU each ({_n(actors * rc.min_cpus_per_actor)} CPU){fixed_note}; "
                f"the cluster has {cluster.describe()}. Ask for fewer actors (ray.rollout_workers, ray.teacher_replicas, "
                f"ray.trainer_workers) or a bigger cluster (ray.num_cpus, ray.address)"
            )
    placement = Placement([Role(name, n, share if c is None else c, g, label) for name, n, c, g, label in asked], rc.placement_strategy)
    short = []
    if placement.cpus > cluster.free_cpus + 1e-9:
        short.append(f"{_n(placement.cpus)} CPU asked, {_n(cluster.free_cpus)} free")
    if placement.gpus > cluster.free_gpus + 1e-9:
        short.append(f"{_n(placement.gpus)} GPU asked, {_n(cluster.free_gpus)} free")
    for r in placement.roles:
        if r.cpus > cluster.node_cpus + 1e-9 or r.gpus > cluster.node_gpus + 1e-9:
            short.append(f"one of {r.label} needs {_n(r.cpus)} CPU / {_n(r.gpus)} GPU, the largest node has "
                         f"{_n(cluster.node_cpus)} CPU / {_n(cluster.node_gpus)} GPU")  # fmt: skip
    if short:
        raise PlacementError(f"ray: the run asks for {placement.describe()}; the cluster has {cluster.describe()} ({'; '.join(short)})")
    return placement


def bundle_order(roles: list[Role]) -> list[tuple[Role, int]]:
    """The reserved actors, (role, i), in the order their bundles are made (module docstring)."""
    position = {r.name: k for k, r in enumerate(roles)}
    actors = [(r, i) for r in roles if r.reserved for i in range(r.count)]
    return sorted(actors, key=lambda a: (-a[0].gpus, a[0].name != TRAINER, a[1], position[a[0].name]))


def gpu_index(roles: list[Role]) -> dict[tuple[str, int], int]:
    """The GPU of one node that Ray gives each actor, (role, i) -> index (-1: none), bundle by bundle in
    `bundle_order`: a whole share takes the first wholly free GPUs (the first of them named here), a fraction the GPU
    it leaves the least room on, the lower index on a tie (Ray's NodeResourceInstanceSet::TryAllocate)."""
    free: list[float] = []  # per GPU of the node, what is left; one more appears when nothing fits
    out = {}
    for r, i in bundle_order(roles):
        if r.gpus <= 0:
            out[r.name, i] = -1
            continue
        if r.gpus >= 1.0 - 1e-9:
            idle = [g for g, f in enumerate(free) if f >= 1.0 - 1e-9][: round(r.gpus)]
            idle += range(len(free), len(free) + round(r.gpus) - len(idle))
            free += [1.0] * (max(idle) + 1 - len(free))
            for g in idle:
                free[g] = 0.0
            out[r.name, i] = idle[0]
            continue
        fits = [g for g, f in enumerate(free) if f >= r.gpus - 1e-9]
        g = min(fits, key=lambda g: (free[g] - r.gpus, g)) if fits else len(free)
        free += [1.0] * (g + 1 - len(free))
        free[g] -= r.gpus
        out[r.name, i] = g
    return out


@dataclass
class Reservation:
    """A ready placement group with one bundle per reserved actor (`options(role, i)` places actor i of a role)."""

    placement: Placement
    group: Any = None  # the PlacementGroup (None when no role needs resources)
    index: dict[tuple[str, int], int] = field(default_factory=dict)  # (role, i) -> bundle index

    @classmethod
    def make(cls, ray: Any, placement: Placement, timeout_s: float) -> Reservation:
        from ray.util.placement_group import placement_group

        bundles, index = [], {}
        for r, i in bundle_order(placement.roles):
            index[r.name, i] = len(bundles)
            bundles.append({k: v for k, v in (("CPU", r.cpus), ("GPU", r.gpus)) if v > 0})
        if not bundles:
            return cls(placement)
        group = placement_group(bundles, strategy=placement.strategy)
        if not group.wait(timeout_seconds=timeout_s):
            cls(placement, group, index).release(ray)
            raise PlacementError(
                f"ray: the run's actors could not be placed within ray.placement_timeout_s={_n(timeout_s)} s "
                f"(strategy {placement.strategy}): it asks for {placement.describe()}; the cluster has {Cluster.of(ray).describe()}"
            )
        return cls(placement, group, index)

    def options(self, role: str, i: int) -> dict[str, Any]:
        """`ray.remote(...).options(**this)` for actor i of a role: its resources and bundle."""
        r = self.placement.role(role)
        opts: dict[str, Any] = {"num_cpus": r.cpus, "num_gpus": r.gpus}
        if (role, i) in self.index:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=self.index[role, i]
            )
        return opts

    def release(self, ray: Any, wait_s: float = 10.0) -> None:
        """Give the bundles back and wait (at most `wait_s`) until the cluster shows them free again, so a
        run that starts next in this process sizes itself on what is really free."""
        if self.group is None:
            return
        from ray.util.placement_group import remove_placement_group

        cpus, gpus = (ray.available_resources().get(k, 0.0) for k in ("CPU", "GPU"))
        remove_placement_group(self.group)
        self.group = None
        total = ray.cluster_resources()
        want_cpus = min(total.get("CPU", 0.0), cpus + sum(r.count * r.cpus for r in self.placement.roles if r.reserved))
        want_gpus = min(total.get("GPU", 0.0), gpus + sum(r.count * r.gpus for r in self.placement.roles if r.reserved))
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            free = ray.available_resources()
            if free.get("CPU", 0.0) >= want_cpus - 1e-6 and free.get("GPU", 0.0) >= want_gpus - 1e-6:
                return
            time.sleep(0.05)
