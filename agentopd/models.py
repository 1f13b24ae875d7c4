"""Which student and teacher a run uses, and where they run.

    student = resolve_student(cfg.student.path, mixture.env_names, mixed=mixture.mixed)   # built-ins bootstrapped on demand
    teacher = resolve_model(cfg.teacher.path, "sql_db", "teacher")
    device, dtype = pick_device(cfg.run.device)          # cuda + bf16 when available, else cpu + fp32

`builtin` (the default) means the embedded models of the env (agentopd.bootstrap); `builtin:vllm` the
embedded student built with a head size vLLM's CPU build serves (32 instead of 24; its teacher is the
default one: `bootstrap(..., for_vllm=True)`); `builtin:cross` a teacher of the default recipe over its own,
larger BPE (another tokenizer: for the cross-tokenizer losses, trainer.loss=xtok_k1); `teacher=self` the student's
own reference (routing.Router.resolve: a frozen copy of its starting weights); anything else is a local Hugging Face
folder, a `.gguf` file or a folder holding one (converted once to a bf16 folder: agentopd.gguf_import), or a hub id
(the Hugging Face cache's copy, else fetched; one line when the hub cannot be reached), loaded with
AutoModelForCausalLM / AutoTokenizer. Every `builtin` is of the size the run asks
for (`embedded.size`: tiny, the default, or gpu; `size=`, built on `device`: agentopd.bootstrap.build_device).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from agentopd.config import EmbeddedSize
from agentopd.gguf_import import find_gguf, gguf_folder
from agentopd.teacher.base import is_server

BUILTIN = "builtin"
FOR_VLLM = "vllm"  # `builtin:vllm`
CROSS = "cross"  # `builtin:cross` (a teacher)
SELF = "self"  # `teacher=self`: a frozen copy of the student's starting weights (privileged self-distillation)


def pick_device(device: str = "auto") -> tuple[torch.device, torch.dtype]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"run.device={device!r} but no CUDA device is available")
    d = torch.device(device)
    return d, (torch.bfloat16 if d.type == "cuda" else torch.float32)


def resolve_student(path: str, env_names: list[str], *, mixed: bool, progress=None, env_kwargs: dict | None = None,
                    size: EmbeddedSize = EmbeddedSize.TINY, device: torch.device | str | None = None) -> Path | str:  # fmt: skip
    """The student reference: a mixed run's `builtin` is the built-in student that has seen every env
    (agentopd.bootstrap.mixed_student), of the tiny size only."""
    if mixed and path.startswith(BUILTIN) and size != EmbeddedSize.TINY:
        raise ValueError(f"embedded.size={size} with student={path}: a mixed run's embedded student is the tiny one only; "
                         "pass student=PATH, or use embedded.size=tiny")  # fmt: skip
    if mixed and path in (BUILTIN, f"{BUILTIN}:student"):
        from agentopd.bootstrap import mixed_student

        return mixed_student(env_names, progress=progress)
    if mixed and path == f"{BUILTIN}:{FOR_VLLM}":
        raise ValueError(f"student={path}: a mixed run's embedded student has no vLLM build; pass student=PATH")
    return resolve_model(path, env_names[0], "student", progress, env_kwargs=env_kwargs, size=size, device=device)


def resolve_model(spec: str, env_name: str, role: str, progress=None, env_kwargs: dict | None = None,
                  size: EmbeddedSize = EmbeddedSize.TINY, device: torch.device | str | None = None) -> Path | str:  # fmt: skip
    """A model reference (`builtin`, `builtin:student`, `builtin:vllm`, a folder, a hub id) as something
    from_pretrained takes; `builtin` models are bootstrapped for `env_name` (with `env_kwargs`, at `size`, built on
    `device`: agentopd.bootstrap)."""
    if spec in (BUILTIN, f"{BUILTIN}:{role}") or spec.startswith(f"{BUILTIN}:"):
        from agentopd.bootstrap import bootstrap

        which = spec.split(":", 1)[1] if ":" in spec else role
        if which not in ("student", "teacher", FOR_VLLM, CROSS):
            raise ValueError(f"{role}={spec!r}: say builtin, builtin:student, builtin:teacher, builtin:vllm or builtin:cross")
        if which == CROSS and role != "teacher":
            raise ValueError(f"{role}={spec!r}: builtin:cross is a teacher (its student is the default builtin one)")
        models = bootstrap(env_name, progress=progress, env_kwargs=env_kwargs, for_vllm=which == FOR_VLLM, cross=which == CROSS,
                           size=size, device=device)  # fmt: skip
        if which == CROSS:
            return models.teacher_dir
        return models.student_dir if which in ("student", FOR_VLLM) else models.teacher_dir
    if is_server(spec):
        return spec
    path = Path(spec).expanduser()
    if path.exists():
        gguf = find_gguf(path)
        if gguf is not None:  # a .gguf file, or a folder holding one: its Hugging Face folder, converted once
            return gguf_folder(gguf)
        if not (path / "config.json").exists():
            raise ValueError(f"{role}={spec!r} is not a Hugging Face model folder (no config.json) and holds no .gguf file")
        return path
    if spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or not _HUB_ID.fullmatch(spec):
        raise ValueError(f"{role}={spec!r}: no such file or folder")
    return hub_snapshot(spec, role)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # "org/name" or a bare "name"


def hub_snapshot(repo_id: str, role: str) -> Path | str:
    """A hub id: the Hugging Face cache's copy (a folder: from_pretrained then never waits on the network), else the id
    itself for from_pretrained to fetch when the hub answers. Offline with nothing cached, one line naming the key and
    what to pass instead, in seconds (not the hub client's minute of retries and its traceback)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (OSError, HFValidationError, ValueError):
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    if offline or not _hub_reachable():
        raise ValueError(f"{role}={repo_id!r}: no such folder here, and the Hugging Face hub cannot be reached to fetch it as "
                         "a hub id; pass a model folder, a .gguf file, or `agentopd fetch-model --list` for real "
                         "checkpoints that need no hub")  # fmt: skip
    return repo_id  # from_pretrained fetches it


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Can this machine open a connection to the hub's host at all (seconds, not the client's minute of retries)?"""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False
