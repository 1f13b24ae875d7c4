"""Checkpoint / exact resume, engine weight hand-off and Hugging Face export of a Trainer.

Layout of a checkpoint directory (every rank calls save/load; works sharded or plain):
    dcp/               torch.distributed.checkpoint of {"model", "optim"} (sharded, reshardable)
    meta.json          step, scheduler state, world size and the caller's `extra` (JSON)
    config.json        the student's model config (export_checkpoint rebuilds the model from it)
    rng_rank<r>.pt     torch / CUDA / python `random` / numpy RNG states of rank r

`export_checkpoint(ckpt_dir, out_dir, tokenizer)` turns such a directory into a Hugging Face folder
in one process, whatever world size wrote it (`agentopd export`).

Resuming with the same world size restores everything bit for bit; with another world size the
model and optimizer are resharded by DCP and the RNG files of missing ranks are skipped.
"""

from __future__ import annotations

import copy
import json
import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

if TYPE_CHECKING:
    from agentopd.trainer.core import Trainer


def _barrier(trainer: Trainer) -> None:
    if trainer.distributed:
        dist.barrier()


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _app_state(trainer: Trainer) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(trainer.hf),
        "optim": get_optimizer_state_dict(trainer.hf, trainer.optimizer),
    }


def save(trainer: Trainer, directory: Path, extra: dict[str, Any]) -> None:
    try:
        extra_json = json.dumps(extra)
    except TypeError as e:
        raise ValueError(f"checkpoint extra must be JSON-serialisable: {e}") from None
    directory.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save(_app_state(trainer), checkpoint_id=str(directory / "dcp"))
    torch.save(_rng_state(), directory / f"rng_rank{trainer.rank}.pt")
    if trainer.rank == 0:
        trainer.model_config().to_json_file(directory / "config.json")  # self-describing: export_checkpoint needs it
        meta = {
            "step": trainer.step,
            "scheduler": trainer.scheduler.state_dict(),
            "world_size": trainer.world_size,
            "extra": json.loads(extra_json),
        }
        (directory / "meta.json").write_text(json.dumps(meta, indent=1))
    _barrier(trainer)


def load(trainer: Trainer, directory: Path) -> dict[str, Any]:
    if not (directory / "meta.json").is_file():
        raise ValueError(f"{directory} is not a trainer checkpoint (no meta.json)")
    meta = json.loads((directory / "meta.json").read_text())
    state = _app_state(trainer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=str(directory / "dcp"))
    set_model_state_dict(trainer.hf, state["model"])
    set_optimizer_state_dict(trainer.hf, trainer.optimizer, state["optim"])
    trainer.scheduler.load_state_dict(meta["scheduler"])
    trainer.step = meta["step"]
    rng_file = directory / f"rng_rank{trainer.rank}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))  # our own file: numpy state is not a tensor
    _barrier(trainer)
    return meta["extra"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def full_state_dict(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Unsharded HF-named weights on CPU on rank 0 ({} elsewhere); a collective under FSDP."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(trainer.hf, options=options)
    if trainer.rank != 0:
        return {}
    # unsharded CPU tensors may BE the live parameters (plain CPU, or world size 1): hand out copies
    live = {_local(p).data_ptr() for p in trainer.hf.parameters()}
    sd = {k: v.detach().clone() if v.data_ptr() in live else v for k, v in sd.items()}
    names = trainer.hf.state_dict().keys()  # tied weights appear under both names, as in HF
    if set(sd) != set(names):
        shared = dict(trainer.hf.named_parameters(remove_duplicate=False))
        for name in names - sd.keys():  # a tied alias dropped by the dedup
            src = next(n for n in sd if shared.get(n) is shared.get(name))
            sd[name] = sd[src]
    return sd


def unique_state(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, str]]:
    """`module.state_dict(keep_vars=True)` in order, each name with its tensor and the first name that tensor
    appeared under: the name itself, or for a tied alias (lm_head.weight of tied embeddings) the one it shares."""
    first: dict[int, str] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        yield name, t, first.setdefault(id(t), name)


def full_tensors(trainer: Trainer) -> Iterator[tuple[str, torch.Tensor]]:
    """The state dict's tensors unsharded on the trainer's device, one at a time, in state-dict order and
    tied names once (the weight-sync stream: agentopd.backends.weight_sync). A collective under FSDP:
    every rank iterates it to the end; only rank 0's copies are meant to be used."""
    with torch.no_grad():
        for name, t, first in unique_state(trainer.hf):
            if name == first:
                full = t.full_tensor() if hasattr(t, "full_tensor") else t
                yield name, full.detach()


def export(trainer: Trainer, out_dir: Path, tokenizer=None) -> None:
    """save_pretrained of the unsharded student (+ tokenizer with its chat template) on rank 0."""
    from transformers import AutoModelForCausalLM

    sd = full_state_dict(trainer)
    if trainer.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(trainer.model_config(), dtype=torch.float32)
        model.load_state_dict(sd, assign=True, strict=True)
        model.tie_weights()
        model.generation_config = copy.deepcopy(trainer.hf.generation_config)
        model.save_pretrained(out_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    _barrier(trainer)


def export_checkpoint(ckpt_dir: str | Path, out_dir: str | Path, tokenizer=None) -> None:
    """A trainer checkpoint (any world size) as a Hugging Face folder, in this one process."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    if not (ckpt_dir / "meta.json").is_file() or not (ckpt_dir / "config.json").is_file():
        raise ValueError(f"{ckpt_dir} is not a trainer checkpoint (needs meta.json and config.json)")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt_dir), dtype=torch.float32)
    state = {"model": get_model_state_dict(model)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=str(ckpt_dir / "dcp"))  # only the model's keys; the optimizer stays on disk
    set_model_state_dict(model, state["model"])
    model.tie_weights()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
