"""The bootstrap stage: the run's student and teacher references, the embedded models built where a run names them.

    models = resolve_models(cfg, mixture, router, progress=callback, device=device)
    models.student, models.teachers          # from_pretrained references; teachers by the router's names

The router (agentopd.routing) says which teachers a run has and which env's built-in teacher a `builtin` name means; it
builds nothing. Here each reference becomes something from_pretrained takes: a folder, a hub id, a server URL, or an
embedded model (agentopd.bootstrap), trained on first use and cached under $AGENTOPD_HOME. `self` is the student's
reference, loaded again as a frozen copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agentopd.kinds import EmbeddedSize
from agentopd.models import BUILTIN, CROSS, SELF, resolve_model, resolve_student

if TYPE_CHECKING:
    import torch

    from agentopd.bootstrap import Progress
    from agentopd.config import Config
    from agentopd.plan import Mixture
    from agentopd.routing import Router

@dataclass
class RunModels:
    student: Path | str
    teachers: dict[str, Path | str]  # teacher name -> from_pretrained reference (or a server URL)


def resolve_models(cfg: Config, mixture: Mixture, router: Router, *, progress: Progress | None = None,
                   device: torch.device | None = None) -> RunModels:  # fmt: skip
    """The student's and every teacher's reference; the embedded ones of `embedded.size` built on `device`."""
    kwargs = next(iter(mixture.sources.values())).kwargs if not mixture.mixed else None
    size = cfg.embedded.size  # built on the run's device (a tiny pair: on the CPU, always)
    student = resolve_student(cfg.student.path, mixture.env_names, mixed=mixture.mixed, progress=progress, env_kwargs=kwargs,
                              size=size, device=device)  # fmt: skip
    return RunModels(student, teacher_refs(router, student, progress=progress, size=size, device=device))


def teacher_refs(router: Router, student: Path | str, *, progress: Progress | None = None, size: EmbeddedSize | None = None,
                 device: torch.device | None = None) -> dict[str, Path | str]:  # fmt: skip
    """Teacher name -> something from_pretrained takes (built-in teachers of `size` bootstrapped on demand, on `device`;
    `self` is the student's reference `student`, loaded again as a frozen copy)."""
    out: dict[str, Path | str] = {}
    for name, ref in router.refs.items():
        if ref == SELF:
            out[name] = student
            continue
        env = router.builtin_env(name, ref)
        builtin = ref if ref == f"{BUILTIN}:{CROSS}" else BUILTIN  # builtin:cross: the env's cross-tokenizer teacher
        out[name] = resolve_model(builtin if env else ref, env or "", "teacher", progress, env_kwargs=router.kwargs_of(env),
                                  size=size or EmbeddedSize.TINY, device=device)  # fmt: skip
    return out
