"""One copy of a teacher's weights for its engine and its scorer, on a CPU (the local backend).

A teacher that both plays (its share of the training episodes, `recipe.teacher_fraction`; the SFT steps before OPD,
`recipe.sft_steps`; the guide's turns, `recipe.intervene_below`; its evals, `eval.teacher`) and scores held its
weights twice: its rollout engine loaded them, and its scorer (HFTeacher) loaded them again — a 1.5B teacher's
3.3 GiB twice on a 24 GiB laptop, where the mixed recipe with a 0.5B student then did not fit. Here the teacher's
transformers model is loaded once: the scorer runs on it and the fast engine takes its weights over
(FastEngine `share_weights`: its fused buffers become the model's parameters; the transformers engine, where the fast
one does not support the architecture, runs the model itself). The engine closes and comes back as before; the
weights stay while the scorer needs them.

Only on a CPU: on a GPU the scorer leaves the device after each scoring (`teacher_offload`) and the engine's weights
must stay, and the GPU memory plan counts two copies. A teacher served over HTTP, one that never scores (pure SFT)
and one on vLLM are not shared. The host plan (agentopd.memory_host) counts a shared teacher's engine as its KV pool
only; `shares_teacher_weights` is the one rule both read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentopd.backends.stages import RunContext
    from agentopd.config import Config


def shares_teacher_weights(cfg: Config, device: Any) -> bool:
    """Whether the run's local teachers hold one copy of their weights for their engines and scorers on `device`."""
    from agentopd.engines import EngineKind, resolve_kind
    from agentopd.objectives import loads_scorer

    on_cpu = getattr(device, "type", str(device)) == "cpu"
    return on_cpu and resolve_kind(cfg.engine.kind, device) in (EngineKind.FAST, EngineKind.HF) and loads_scorer(cfg)


class TeacherModels:
    """The teachers' transformers models, each loaded once for its engine and its scorer (`get`: None for a teacher
    whose weights are not shared, which loads its own as before)."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self._models: dict[str, Any] = {}

    def shares(self, name: str) -> bool:
        from agentopd.teacher.base import is_server

        ref = self.ctx.teacher_refs.get(name)
        return ref is not None and not is_server(ref) and shares_teacher_weights(self.ctx.cfg, self.ctx.device)

    def get(self, name: str) -> Any | None:
        if not self.shares(name):
            return None
        if name not in self._models:
            from transformers import AutoModelForCausalLM

            ref = self.ctx.teacher_refs[name]
            model = AutoModelForCausalLM.from_pretrained(ref, dtype=self.ctx.inference_dtype(ref))
            self._models[name] = model.to(self.ctx.device).eval().requires_grad_(False)
        return self._models[name]
