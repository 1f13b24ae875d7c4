"""The teacher's self-test in a run: a pre-flight before step 1's training, and a re-check after every event that may
change a teacher's scores (agentopd.teacher.selftest judges; this module builds the probe and asks the backend).

    selftest = TeacherSelfTest.for_run(cfg, tokenizer, student_ref, device, dtype, ...)   # None: the run has none
    recipes = run_recipes(cfg, ..., selftest=selftest)   # a recipe of the play stage (agentopd.step.recipes)
    metrics = selftest.played(played, parts)   # its hook, after each step's play stage: the pre-flight at the first step
                                               # this process plays, a re-check at the others ({} when nothing happened)

The probe of a teacher: the oracle episodes (ORACLE_TASKS training tasks of each source it scores, played through the
agent loop as check-pair plays them, agentopd.pair_stream) and the first PROBE_ROLLOUTS of the step's episodes routed
to it. Each replica (`Backend.score_replicas`: a Ray pool's actors, else the one teacher) scores it twice in TOPK mode;
the student's starting weights score it once (a scorer loaded for the pre-flight and dropped after it). A refusal is
`TeacherRefused` (a ValueError: one line, exit 2, before any optimizer step). Later, after an event the backend reports
(`Backend.teacher_events`: the engine's sleep/wake, a teacher's offload and reload, a restarted replica), each replica
scores the probe again, and every `teacher.selftest_every` steps with no event (by default a server teacher's, every
SERVER_EVERY steps); a difference beyond the pre-flight's noise is `TeacherChanged` (the runner checkpoints the last
trained step and stops with that line: a `StopRun`).

Off with teacher.selftest=false; not run for a cross-tokenizer loss (the teacher reads other token ids) or an
objective whose teacher scores nothing (sft, grpo).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentopd.recipes.base import Recipe, Stage
from agentopd.step.values import StopRun
from agentopd.teacher.base import TeacherMode
from agentopd.teacher.selftest import SelfTest, judge, recheck

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from agentopd.config import Config
    from agentopd.step.values import Played, StepParts
    from agentopd.types import TokenStream

ORACLE_TASKS = 2  # oracle episodes per source in the probe
PROBE_ROLLOUTS = 8  # the step's first episodes per teacher in the probe
# a server teacher's probe is scored again every SERVER_EVERY steps (teacher.selftest_every null): a server restarted
# between two scorings with other weights behind the same address answers with no failed request for the client to see
# (ServerTeacher.take_reconnects sees only a restart that fails a request); the probe is ~20 streams, seconds a step
SERVER_EVERY = 10


class TeacherRefused(ValueError):
    """The pre-flight refused a teacher (one line)."""


class TeacherChanged(StopRun):
    """A teacher's scores of the probe changed after a sleep, offload, reload or restart (one line)."""


def oracle_streams(parts: StepParts, tokenizer: PreTrainedTokenizerBase, source: str) -> list[TokenStream]:
    """The token streams of the oracle solving the first ORACLE_TASKS training tasks of `source`, as the agent loop
    plays them ([] for an env without an oracle or tasks)."""
    from agentopd.corpus import oracle_conversation
    from agentopd.pair_stream import play_conversation

    thinking = parts.cfg.rollout.enable_thinking
    kwargs = None if thinking is None else {"enable_thinking": thinking}
    env = parts.mixture.sources[source].factory("train")()
    try:
        tasks = list(getattr(env.unwrapped, "tasks", []) or [])[:ORACLE_TASKS]
        out = []
        for task in tasks:
            try:
                messages, tools = oracle_conversation(env, task.id)
            except NotImplementedError:  # an env without an oracle: the probe holds its rollouts only
                return []
            episode = play_conversation(tokenizer, [dict(m) for m in messages], tools, kwargs, reasoning=False)
            if "error" not in episode.info and sum(episode.tokens.response_mask):
                out.append(episode.tokens)
        return out
    finally:
        env.close()


@dataclass
class TeacherSelfTest(Recipe):
    """The self-test as a recipe of the play stage: `played` runs after each step's play stage, before its score stage."""

    name = "selftest"
    stages = frozenset({Stage.PLAY})

    tokenizer: PreTrainedTokenizerBase
    student_ref: Any
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    score_temperature: float
    loss_temperature: float
    check_oracle: bool
    max_noise: float
    every: int | None = None  # teacher.selftest_every: a re-check every N steps (None: SERVER_EVERY for a server teacher)
    found: dict[str, SelfTest] = field(default_factory=dict)
    probes: dict[str, list[TokenStream]] = field(default_factory=dict)

    @staticmethod
    def for_run(cfg: Config, tokenizer: PreTrainedTokenizerBase, student_ref: Any, device: torch.device, dtype: torch.dtype,
                score_temperature: float, loss_temperature: float) -> TeacherSelfTest | None:  # fmt: skip
        from agentopd.models import SELF
        from agentopd.objectives import runs_selftest

        if not runs_selftest(cfg):
            return None

        # teacher=self or a privileged teacher is the student by design: on the probe (no privileged prompt) its signal
        # is ~0, so neither its noise share nor its oracle margin over the student means anything there
        is_student = cfg.teacher.path == SELF or cfg.teacher.privileged is not None
        return TeacherSelfTest(tokenizer, student_ref, device, dtype, len(tokenizer), score_temperature, loss_temperature,
                               check_oracle=cfg.teacher.selftest_oracle and not is_student,
                               max_noise=math.inf if is_student else cfg.teacher.selftest_max_noise,
                               every=cfg.teacher.selftest_every)  # fmt: skip

    def played(self, played: Played, parts: StepParts) -> dict[str, float]:
        """The pre-flight until it has judged a teacher (the first step this process plays that has episodes to probe),
        then a re-check."""
        return self.recheck(parts, played.step) if self.found else self.preflight(played, parts)

    def _probes(self, played: Played, parts: StepParts) -> dict[str, tuple[list[TokenStream], list[bool]]]:
        """Per teacher: its probe streams and which of them are oracle episodes."""
        sources: dict[str, list[str]] = {}
        rollouts: dict[str, list[TokenStream]] = {}
        for p, e, name in zip(played.planned, played.episodes, played.teacher_of):
            if p.source not in sources.setdefault(name, []):
                sources[name].append(p.source)
            if len(rollouts.setdefault(name, [])) < PROBE_ROLLOUTS and sum(e.tokens.response_mask):
                rollouts[name].append(e.tokens)
        out = {}
        for name in sources:
            oracle = [s for source in sources[name] for s in oracle_streams(parts, self.tokenizer, source)]
            out[name] = (oracle + rollouts[name], [True] * len(oracle) + [False] * len(rollouts[name]))
        return out

    def preflight(self, played: Played, parts: StepParts) -> dict[str, float]:
        """Score each teacher's probe twice on every replica, beside the student; TeacherRefused on the first teacher
        that fails; else the teacher/selftest_* metrics."""
        from agentopd.teacher import HFTeacher

        t0 = time.perf_counter()
        backend = parts.backend
        probes = self._probes(played, parts)
        backend.teacher_events()  # what happened before the pre-flight is what it measures
        with parts.phases("teacher"):
            # the teachers first: the backend puts the student's engine to sleep (engine.sleep) before they score, so the
            # student's scorer then loads beside the teacher's phase, not beside the engine's KV pool
            scored = {name: (backend.score_replicas(name, probe, TeacherMode.TOPK), backend.score_replicas(name, probe, TeacherMode.TOPK))
                      for name, (probe, _) in probes.items()}  # fmt: skip
            student = HFTeacher(self.student_ref, device=self._student_device(), dtype=self.dtype, offload_after_score=False,
                                temperature=self.score_temperature, vocab_size=self.vocab_size)  # fmt: skip
            try:
                student_lp = {name: [sc.logprobs for sc in student.score(probe)] for name, (probe, _) in probes.items()}
            finally:
                on_gpu = student.device.type == "cuda"
                del student
                if on_gpu:
                    import torch

                    torch.cuda.empty_cache()
            for name, (probe, oracle) in probes.items():
                first, second = scored[name]
                found = judge(name, probe, list(zip(first, second)), student_lp[name], vocab_size=self.vocab_size,
                              max_noise=self.max_noise, oracle=oracle,
                              check_oracle=self.check_oracle)  # fmt: skip
                line = found.refusal()
                if line is not None:  # with what the check cost (its scorings, the student's included) before it stopped the run
                    seconds = time.perf_counter() - t0
                    raise TeacherRefused(f"teacher self-test: {line} (refused after {seconds:.1f} s of self-test)")
                self.found[name], self.probes[name] = found, probe
        return self._metrics(time.perf_counter() - t0)

    def _student_device(self) -> torch.device:
        """The run's device for the student's scorer where it has room for a second copy of the student (twice its
        weights free: the memory plan counts its weights and work in the teacher phase, agentopd.memory_plan, but an
        estimate can be short), else the CPU (slower, never out of memory)."""
        import torch

        if self.device.type != "cuda":
            return self.device
        from agentopd.shape import ModelShape

        free, _ = torch.cuda.mem_get_info(self.device)
        need = 2 * ModelShape.from_ref(self.student_ref).params * torch.finfo(self.dtype).bits // 8
        return self.device if free > need else torch.device("cpu")

    def _metrics(self, seconds: float) -> dict[str, float]:
        if not self.found:  # a step with no episode to probe: the next step's play stage tries again
            return {}
        worst = max(self.found.values(), key=lambda f: f.noise_share)
        out = worst.metrics() | {"teacher/selftest_s": seconds, "teacher/selftest_score_temperature": self.score_temperature,
                                 "teacher/selftest_loss_temperature": self.loss_temperature}  # fmt: skip
        if len(self.found) > 1:
            for name, found in self.found.items():
                out |= {f"{key}/{name}": value for key, value in found.metrics().items()}
        return out

    def interval(self, name: str, parts: StepParts) -> int:
        """Steps between two re-checks of `name` that nothing called for (0: never): teacher.selftest_every, else
        SERVER_EVERY for a teacher served over HTTP (parts.shapes: None) and never for one loaded here."""
        if self.every is not None:
            return self.every
        return SERVER_EVERY if name in parts.shapes and parts.shapes[name] is None else 0

    def recheck(self, parts: StepParts, step: int) -> dict[str, float]:
        """After each event the backend reports, the teachers it names score their probe again on every replica, and
        every `interval` steps each teacher does with no event (a server restarted between two scorings, never seen
        down); TeacherChanged when one moved beyond the pre-flight's noise; else teacher/selftest_recheck_* metrics ({}
        when nothing was re-checked)."""
        events = {name: e for name, e in parts.backend.teacher_events().items() if name in self.found}
        for name in self.found:
            every = self.interval(name, parts)
            if every and step % every == 0 and name not in events:
                events[name] = f"{every} steps (teacher.selftest_every)"
        if not events:
            return {}
        t0 = time.perf_counter()
        largest = 0.0
        with parts.phases("teacher"):
            for name, event in events.items():
                for r, scores in enumerate(parts.backend.score_replicas(name, self.probes[name], TeacherMode.LOGPROBS)):
                    diff, line = recheck(name, self.probes[name], self.found[name], scores, event)
                    if line is not None:
                        where = f" (replica {r})" if self.found[name].replicas > 1 else ""
                        raise TeacherChanged(f"teacher self-test: {line}{where}")
                    largest = max(largest, diff.max)
        return {"teacher/selftest_recheck_max_diff": largest, "teacher/selftest_recheck_s": time.perf_counter() - t0}
