"""The FSDP2 student trainer (DESIGN 4): config, loss dispatch, step, checkpoint, export.

    from agentopd.trainer import Trainer, TrainerConfig, LossKind
    trainer = Trainer(student_model_or_path, TrainerConfig(loss=LossKind.SAMPLED_K1, lr=1e-5))
    metrics = trainer.train_step(samples)          # samples: list[agentopd.batch.TrainSample]

Modules: `config` (TrainerConfig, modes, LR schedule), `logprob` (chunked selected-token
logprobs), `objective` (loss per micro-batch), `core` (Trainer), `checkpoint` (DCP save/load,
engine state dict, HF export).
"""

from agentopd.trainer.checkpoint import export_checkpoint
from agentopd.trainer.config import LossKind, PGMode, Precision, Schedule, TrainerConfig, lr_factor
from agentopd.trainer.core import Trainer
from agentopd.trainer.logprob import chunked_token_logprobs

__all__ = [
    "LossKind",
    "PGMode",
    "Precision",
    "Schedule",
    "Trainer",
    "TrainerConfig",
    "chunked_token_logprobs",
    "export_checkpoint",
    "lr_factor",
]
