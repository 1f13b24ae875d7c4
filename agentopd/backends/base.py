"""The Backend protocol: where the runner's stages run (agentopd.runner owns the loop, the plan,
the store and the metrics; a backend plays episodes, scores them, trains and syncs weights).

Both backends (local.py, ray.py) implement exactly this, in the records of the code:

- `policy_version`: the trainer step whose weights the student's engines hold after the last
  `sync_weights()` (0 before any training); an episode's `policy_version` is the trainer step whose
  weights sampled it. A step the trainer skipped (no student tokens) does not advance it.
- `submit_rollout(planned, config, who)` -> a `RolloutHandle`; `collect(handle, on_episode)` -> the episodes
  in plan order, `on_episode(planned, episode)` called as each finishes. `who` is `student` or a
  teacher name.
- `score({teacher: streams}, mode)` -> `{teacher: [TeacherScores]}` in the same order.
- `train(samples, head, loss=None, temperature=None)` -> the step's metrics (the same on every rank); `head` is
  the teacher's lm_head for the full-vocabulary losses, or a list of one per teacher indexed by the samples'
  `teacher_index`; a `loss` (at `temperature`) replaces the trainer's own for this step (the SFT warm start).
- `score_replicas(name, streams, mode)` -> one list of scores per replica of teacher `name` (a Ray pool's actors; one
  elsewhere), every replica scoring every stream: the teacher's self-test (agentopd.step.selftest).
- `teacher_events()` -> {teacher: what it went through since the last call that may change its scores} (an engine's
  sleep/wake, an offload and reload, an actor restarted): the self-test scores its probe again after each.
- `save_checkpoint(path, extra)`: every rank's part into a hidden folder, then the DONE marker and one rename to
  `path` (`rundir.write_checkpoint`), so a folder named step_N is complete and a failed or killed write leaves no
  checkpoint a resume would take.
- `connect(cfg, teachers)` (teacher name -> model reference) comes first, before any model is built: a
  backend that needs resources (Ray: a cluster, a reservation of every role; a teacher behind a server
  reserves no GPU) checks them here, so a run that cannot fit fails in seconds, not after the bootstrap.
- Any call may raise `TrainerRestarted(step)`: the trainer lost a rank and came back from the
  checkpoint of `step`; the runner forgets what came after and plays on from `step + 1`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agentopd.kinds import BackendKind  # re-exported: the backends' name for it

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from agentopd.backends.stages import OnEpisode, RunContext
    from agentopd.batch import TrainSample
    from agentopd.config import Config
    from agentopd.memory_plan import PhaseMemory
    from agentopd.plan import Planned
    from agentopd.rollout import RolloutConfig
    from agentopd.teacher import TeacherMode, TeacherScores
    from agentopd.trainer.config import LossKind
    from agentopd.types import Episode, TokenStream


_handle_ids = itertools.count()


@dataclass
class RolloutHandle:
    """Episodes submitted to a backend and not yet collected: what is played, how, by whom. A backend keeps
    its own record of the work in flight under `id` (the Ray backend: its work items)."""

    planned: list[Planned]
    config: RolloutConfig
    who: str
    id: int = field(default_factory=lambda: next(_handle_ids))

    @property
    def teacher_evals(self) -> bool:
        """A teacher playing held-out tasks (`eval.teacher`): once collected, its engine is needed only by a guide."""
        from agentopd.backends.stages import STUDENT
        from agentopd.env import Split

        return self.who != STUDENT and bool(self.planned) and self.planned[0].spec.split != Split.TRAIN

    @property
    def student_training(self) -> bool:
        """The student's training rollout: where its engine's time goes is logged (`rollout/engine_*`)."""
        from agentopd.backends.stages import STUDENT
        from agentopd.env import Split

        return self.who == STUDENT and bool(self.planned) and self.planned[0].spec.split == Split.TRAIN


class TrainerRestarted(RuntimeError):
    """The trainer group was rebuilt from the checkpoint of `step` (0: the initial weights): the runner
    drops what came after and continues at `step + 1`."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"a trainer rank died ({reason}); the trainer group restarted from step {step}")
        self.step = step


class Backend(Protocol):
    name: BackendKind

    def connect(self, cfg: Config, teachers: dict[str, str | Path]) -> None: ...

    def setup(self, ctx: RunContext, tokenizer: PreTrainedTokenizerBase) -> None: ...

    @property
    def policy_version(self) -> int: ...

    def submit_rollout(self, planned: Sequence[Planned], config: RolloutConfig, who: str = ...) -> RolloutHandle: ...

    def collect(self, handle: RolloutHandle, on_episode: OnEpisode | None = None) -> list[Episode]: ...

    def score(self, by_teacher: dict[str, list[TokenStream]], mode: TeacherMode) -> dict[str, list[TeacherScores]]: ...

    def score_replicas(self, name: str, streams: list[TokenStream], mode: TeacherMode) -> list[list[TeacherScores]]: ...

    def teacher_events(self) -> dict[str, str]: ...

    # async mode: scoring started on a submitted rollout's episodes as they are played (where the backend can);
    # after `collect`, `ahead_scores` gives them in plan order, None where the caller must score itself
    def score_ahead(self, handle: RolloutHandle, teacher_of: Sequence[str], mode: TeacherMode) -> None: ...

    def ahead_scores(self, handle: RolloutHandle) -> list[TeacherScores | None] | None: ...

    def forget(self, handles: Sequence[RolloutHandle]) -> None: ...  # submitted, never to be collected (a rewind)

    def teacher_head(self, name: str) -> torch.Tensor: ...

    def train(self, samples: list[TrainSample], head: torch.Tensor | list[torch.Tensor] | None, loss: LossKind | None = None,
              temperature: float | None = None) -> dict[str, float]: ...  # fmt: skip

    def sync_weights(self) -> None: ...

    def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None: ...

    def load_checkpoint(self, path: Path) -> dict[str, Any]: ...

    def export(self, out_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None: ...

    # GPU (the memory plan's index) -> what the actors there took since the last call (peaks, allocator retries)
    def memory_peaks(self) -> dict[int, PhaseMemory]: ...

    def stats(self) -> dict[str, float]: ...

    def close(self) -> None: ...
