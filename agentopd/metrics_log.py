"""Where step metrics go: `metrics.jsonl` (one JSON object per step), TensorBoard (`tb/`), and
optionally Weights & Biases / MLflow when installed and asked for (never by default).

    log = MetricsLog(RunDir(path), tensorboard=True, resume_after=None)   # resume_after=N: drop steps > N
    log.write(step, {"loss": 0.3, "kl/mean": 0.1})
    log.truncate_after(step)      # forget steps > step in metrics.jsonl
    log.close()
"""

from __future__ import annotations

import json
import math
from typing import Any

from agentopd.rundir import RunDir


class MetricsLog:
    """`resume_after=N`: a resumed run continues after step N, so records of later steps (written
    before the interruption, replayed now) are dropped from metrics.jsonl and TensorBoard alike."""

    def __init__(self, run_dir: RunDir, *, tensorboard: bool = True, wandb: bool = False, mlflow: bool = False,
                 resume_after: int | None = None):  # fmt: skip
        self.path = run_dir.metrics
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_after is not None:
            self.truncate_after(resume_after)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides events of steps >= it written before this writer (the replayed steps)
            purge = resume_after + 1 if resume_after is not None else None
            self._tb = SummaryWriter(str(run_dir.tb), purge_step=purge)
        run_name = run_dir.name
        self._wandb = self._mlflow = None
        if wandb:
            try:
                import wandb as _wandb
            except ImportError:
                raise ValueError("log.wandb=true but wandb is not installed: pip install wandb") from None
            self._wandb = _wandb.init(project="agentopd", name=run_name, dir=str(run_dir.root), mode=None)
        if mlflow:
            try:
                import mlflow as _mlflow
            except ImportError:
                raise ValueError("log.mlflow=true but mlflow is not installed: pip install mlflow") from None
            _mlflow.start_run(run_name=run_name)
            self._mlflow = _mlflow

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        clean = {k: _num(v) for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        for k, v in clean.items():
            if isinstance(v, (int, float)) and v is not None and math.isfinite(v):
                if self._tb is not None:
                    self._tb.add_scalar(k, v, step)
        if self._tb is not None:
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._mlflow is not None:
            self._mlflow.log_metrics({k.replace("/", "."): v for k, v in clean.items() if isinstance(v, (int, float))}, step=step)

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """Keep only records of steps <= `step` (a resumed run rewrites the rest)."""
        kept = [r for r in self.read() if r["step"] <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.end_run()


def _num(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
