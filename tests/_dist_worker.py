"""Worker for tests/test_trainer_dist.py: one rank of a gloo process group runs the shared
trainer scenario (FSDP2) and rank 0 saves what it saw. Spawned with torch.multiprocessing."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _tiny import make_samples, tiny_model

from agentopd.trainer import Trainer, TrainerConfig

STEPS = 6


def batch(step: int, rank: int = 0, world: int = 1) -> list:
    """This rank's share of the global batch of a step, deliberately uneven: with 2 ranks, rank 1
    gets nothing at step 0 (it runs only empty micro-batches) and 4 of 12 episodes afterwards."""
    samples = make_samples(12, seed=100 + step)
    if world == 1:
        return samples
    assert world == 2, world
    cut = 12 if step == 0 else 8
    return samples[:cut] if rank == 0 else samples[cut:]


def scenario(cfg: TrainerConfig, ckpt_dir: str, rank: int = 0, world: int = 1) -> dict:
    """6 steps straight (params after step 1 and 6), then 3 steps + save + a fresh Trainer
    (other init) + load + 3 steps. Each rank trains on its share of the global batch."""
    out: dict = {"losses": [], "resumed_losses": [], "grad_norms": []}
    trainer = Trainer(tiny_model(0), cfg)
    for step in range(STEPS):
        m = trainer.train_step(batch(step, rank, world))
        out["losses"].append(m["loss"])
        out["grad_norms"].append(m["grad_norm"])
        if step == 0:
            out["params_1"] = trainer.state_dict_for_engine()
    out["params_6"] = trainer.state_dict_for_engine()
    trainer = Trainer(tiny_model(0), cfg)
    for step in range(3):
        out["resumed_losses"].append(trainer.train_step(batch(step, rank, world))["loss"])
    trainer.save_checkpoint(ckpt_dir, extra={"next_step": 3})
    out["params_3"] = trainer.state_dict_for_engine()
    del trainer
    trainer = Trainer(tiny_model(seed=99), cfg)  # different weights: the load must replace them
    extra = trainer.load_checkpoint(ckpt_dir)
    for step in range(extra["next_step"], STEPS):
        out["resumed_losses"].append(trainer.train_step(batch(step, rank, world))["loss"])
    out["resumed_params_6"] = trainer.state_dict_for_engine()
    out["step"] = trainer.step
    return out


def resume_and_finish(cfg_kwargs: dict, ckpt_dir: str, out_path: str) -> None:
    """A fresh process: new Trainer (other init), load the checkpoint, train the remaining steps."""
    torch.set_num_threads(1)
    trainer = Trainer(tiny_model(seed=99), TrainerConfig(**cfg_kwargs))
    extra = trainer.load_checkpoint(ckpt_dir)
    losses = [trainer.train_step(batch(step))["loss"] for step in range(extra["next_step"], STEPS)]
    torch.save({"losses": losses, "params_6": trainer.state_dict_for_engine()}, out_path)


def run(rank: int, world: int, port: int, cfg_kwargs: dict, ckpt_dir: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out = scenario(TrainerConfig(**cfg_kwargs), ckpt_dir, rank, world)
        if rank == 0:
            torch.save(out, out_path)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import json
    import sys

    resume_and_finish(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3])
