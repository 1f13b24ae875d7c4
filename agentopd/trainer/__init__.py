"""The FSDP2 student trainer (docs/design.md 4): config, loss dispatch, step, checkpoint, export.

    from agentopd.trainer import Trainer, TrainerConfig, LossKind
    trainer = Trainer(student_model_or_path, TrainerConfig(loss=LossKind.SAMPLED_K1, lr=1e-5))
    metrics = trainer.train_step(samples)          # samples: list[agentopd.batch.TrainSample]

Modules: `config` (TrainerConfig, modes, LR schedule), `logprob` (chunked selected-token
logprobs), `loss` (the loss of a micro-batch, by cfg.loss), `core` (Trainer), `checkpoint` (DCP save/load,
engine state dict, HF export).
"""

from agentopd.trainer.config import LossKind, PGMode, Precision, Schedule, TrainerConfig, lr_factor

_LAZY = {  # torch-heavy parts load on first use, so configs and the CLI stay quick to import
    "Trainer": "agentopd.trainer.core",
    "StudentLoss": "agentopd.trainer.core",
    "export_checkpoint": "agentopd.trainer.checkpoint",
    "chunked_token_logprobs": "agentopd.trainer.logprob",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agentopd.trainer' has no attribute {name!r}")


__all__ = [
    "LossKind",
    "PGMode",
    "Precision",
    "Schedule",
    "StudentLoss",
    "Trainer",
    "TrainerConfig",
    "chunked_token_logprobs",
    "export_checkpoint",
    "lr_factor",
]
