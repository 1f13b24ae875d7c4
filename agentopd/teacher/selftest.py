"""The teacher's self-test: is what it says about a fixed probe of token streams steady, and worth learning from?

    found = judge(probe, repeats, student, vocab_size=V, max_noise=0.1, oracle=[True, False, ...])
    found.metrics()          # teacher/selftest_* (docs/design.md 3.6)
    found.refusal()          # None, or one line naming the teacher, the replica and the token

The probe is a list of token streams (the env's oracle episodes and the student's first rollouts: agentopd.step.selftest
builds it). `repeats[r]` holds replica r's scores of it, scored twice (TOPK mode: sampled-token log-probabilities and
the top-k); `student` the student's log-probabilities of the same tokens at the same temperature. Read over the
student tokens (response mask 1):

- noise: |difference| of a replica's two scorings (repeat) and of each replica against replica 0 (replica), largest
  and mean; where the largest one sits (replica, stream, token position, token id);
- signal: mean |teacher - student| log-probability, what on-policy distillation moves the student by;
- noise share = the larger mean noise / signal; above `max_noise` the teacher is refused (its noise would be a
  meaningful share of what the student is trained toward);
- entropy share: the teacher's per-token entropy over ln(vocabulary): exact where the teacher returns it (a local or
  Ray teacher in TOPK mode), else (a server) estimated from the top-k with the rest spread evenly over the other ids
  (an upper bound, exact for a uniform teacher); above UNIFORM_SHARE the teacher is refused as uniform (weights wiped:
  every logit equal);
- oracle: the mean log-probability teacher and student give the oracle episodes' tokens; a teacher no better than
  the student there (more than ORACLE_TOLERANCE nats a token below it) is refused as broken, unless it is meant to be
  the student (`teacher=self`: `check_oracle=False`).

`recheck(probe, before, after, tolerance)` compares a scoring after a sleep, offload, reload or restart with the one
before: the largest |difference| must stay within the noise the pre-flight measured (RECHECK_FACTOR, RECHECK_FLOOR).

Legend: R = response tokens of one stream.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from agentopd.teacher.base import TeacherScores
from agentopd.types import TokenStream

# a sound real teacher may trail its student a little on an oracle written in a format neither was tuned for
# (Qwen2.5-Coder-1.5B over its 0.5B, Q4 GGUFs, sql_db's hermes-format oracle: 0.21 nats a token below it,
# benchmarks/results/selftest.md); a random or wiped teacher trails it by ~10 (tiny_home's: 10.9; zeroed weights: ln V)
ORACLE_TOLERANCE = 0.5
UNIFORM_SHARE = 0.95  # entropy / ln(V) above this: a uniform teacher (a trained model sits far below: see judge's callers)
# a re-check passes within max(RECHECK_FACTOR x the pre-flight's largest repeat or replica difference, RECHECK_FLOOR) nats a
# token: two scorings measure the noise once, later ones may land a little past it (bf16 kernels on a GPU); a wiped or
# changed teacher moves by nats (zeroed weights: > 1 on every probe measured, tests/test_selftest.py)
RECHECK_FACTOR = 4.0
RECHECK_FLOOR = 1e-2


@dataclass
class Diff:
    """Largest and mean |a - b| over the student tokens of a probe, and where the largest sits."""

    max: float = 0.0
    mean: float = 0.0
    where: str = ""  # "stream 3, token 17 (id 245)"

    @staticmethod
    def of(probe: Sequence[TokenStream], a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> Diff:
        total, count, best = 0.0, 0, Diff()
        for n, (s, x_R, y_R) in enumerate(zip(probe, a, b, strict=True)):
            for i, (m, x, y) in enumerate(zip(s.response_mask, x_R, y_R, strict=True)):
                if not m:
                    continue
                d = abs(x - y)
                total, count = total + d, count + 1
                if d > best.max or not best.where:
                    best.max, best.where = d, f"stream {n}, token {s.prompt_len + i} (id {s.response_ids[i]})"
        best.mean = total / count if count else 0.0
        return best


def entropy_share(probe: Sequence[TokenStream], scores: Sequence[TeacherScores], vocab_size: int) -> float:
    """Mean entropy per student token over ln(vocab_size) (module docstring); needs TOPK scores."""
    total, count = 0.0, 0
    for s, sc in zip(probe, scores, strict=True):
        if sc.entropy is not None:
            values = [h for m, h in zip(s.response_mask, sc.entropy) if m]
            total, count = total + sum(values), count + len(values)
            continue
        assert sc.topk_logprobs is not None, "entropy_share needs TOPK scores"
        for m, top in zip(s.response_mask, sc.topk_logprobs):
            if not m:
                continue
            probs = [math.exp(lp) for lp in top]
            tail = max(0.0, 1.0 - sum(probs))
            h = -sum(p * lp for p, lp in zip(probs, top) if p > 0)
            rest = vocab_size - len(top)
            if tail > 0 and rest > 0:
                h += tail * (math.log(rest) - math.log(tail))
            total, count = total + h, count + 1
    return total / count / math.log(vocab_size) if count else 0.0


def _mean_masked(probe: Sequence[TokenStream], logprobs: Sequence[Sequence[float]], keep: Sequence[bool]) -> float | None:
    values = [x for s, lp, k in zip(probe, logprobs, keep) if k for m, x in zip(s.response_mask, lp) if m]
    return sum(values) / len(values) if values else None


@dataclass
class SelfTest:
    """What one teacher's pre-flight found (module docstring); `refusal()` is None when it passes."""

    teacher: str
    replicas: int
    tokens: int
    repeat: Diff
    replica: Diff
    repeat_replica: int  # the replica whose two scorings differ most
    replica_index: int  # the replica that differs most from replica 0
    signal: float
    entropy_share: float
    oracle_teacher: float | None
    oracle_student: float | None
    max_noise: float
    check_oracle: bool = True
    baseline: list[list[float]] = field(default_factory=list, repr=False)  # replica 0's first scoring (re-checks)

    @property
    def noise(self) -> float:
        return max(self.repeat.mean, self.replica.mean)

    @property
    def noise_share(self) -> float:
        return self.noise / self.signal if self.signal > 0 else (0.0 if self.noise == 0 else math.inf)

    def metrics(self) -> dict[str, float]:
        out = {
            "teacher/selftest_replicas": float(self.replicas),
            "teacher/selftest_tokens": float(self.tokens),
            "teacher/selftest_repeat_max_diff": self.repeat.max,
            "teacher/selftest_repeat_mean_diff": self.repeat.mean,
            "teacher/selftest_replica_max_diff": self.replica.max,
            "teacher/selftest_replica_mean_diff": self.replica.mean,
            "teacher/selftest_signal": self.signal,
            "teacher/selftest_noise_share": min(self.noise_share, 1e6),  # noise over a zero signal: 1e6, not inf (JSON)
            "teacher/selftest_entropy_share": self.entropy_share,
        }
        if self.oracle_teacher is not None and self.oracle_student is not None:
            out["teacher/selftest_oracle_teacher_logprob"] = self.oracle_teacher
            out["teacher/selftest_oracle_student_logprob"] = self.oracle_student
        return out

    def refusal(self) -> str | None:
        """One line saying why this teacher cannot be trusted, or None."""
        who = f"teacher {self.teacher!r}"
        if self.entropy_share > UNIFORM_SHARE:
            return (f"{who} is uniform: its per-token entropy is {self.entropy_share:.1%} of ln(vocabulary) on the probe's "
                    f"{self.tokens} student tokens (weights wiped or never loaded?); the self-test refuses a teacher above "
                    f"{UNIFORM_SHARE:.0%}")  # fmt: skip
        if self.noise_share > self.max_noise:
            if self.replica.mean >= self.repeat.mean:
                what, diff = f"replica {self.replica_index} differs from replica 0", self.replica
            else:
                who_repeats = f"replica {self.repeat_replica}" if self.replicas > 1 else "its one replica"
                what, diff = f"{who_repeats} differs from itself between two scorings", self.repeat
            return (f"{who}: {what} by {diff.mean:.3g} nats a token on average, {self.noise_share:.0%} of the OPD signal "
                    f"(mean |teacher - student| {self.signal:.3g}); largest {diff.max:.3g} at {diff.where}; refused above "
                    f"teacher.selftest_max_noise={self.max_noise:g} (raise it to train anyway)")  # fmt: skip
        if self.check_oracle and self.oracle_teacher is not None and self.oracle_student is not None:
            if self.oracle_teacher < self.oracle_student - ORACLE_TOLERANCE:
                return (f"{who} is no better than the student on the env's oracle episodes: mean log-probability "
                        f"{self.oracle_teacher:.3f} vs the student's {self.oracle_student:.3f}, "
                        f"{self.oracle_student - self.oracle_teacher:.2f} nats a token worse (refused past {ORACLE_TOLERANCE}: "
                        "a broken or wrong teacher; teacher.selftest_oracle=false skips this check)")  # fmt: skip
        return None


def judge(
    teacher: str, probe: Sequence[TokenStream], repeats: Sequence[tuple[Sequence[TeacherScores], Sequence[TeacherScores]]],
    student: Sequence[Sequence[float]], *, vocab_size: int, max_noise: float, oracle: Sequence[bool],
    check_oracle: bool = True,
) -> SelfTest:  # fmt: skip
    """The pre-flight's findings (module docstring): `repeats[r]` = replica r's two scorings of `probe`; `student` the
    student's log-probabilities of the same tokens; `oracle[i]` whether probe stream i is an oracle episode."""
    if not repeats:
        raise ValueError(f"teacher {teacher!r}: no replica to self-test")
    logprobs = [([sc.logprobs for sc in a], [sc.logprobs for sc in b]) for a, b in repeats]
    repeat_diffs = [Diff.of(probe, a, b) for a, b in logprobs]
    repeat_replica = max(range(len(repeat_diffs)), key=lambda r: repeat_diffs[r].mean)
    replica_diffs = [Diff.of(probe, logprobs[0][0], a) for a, _ in logprobs[1:]]
    replica_index = 1 + max(range(len(replica_diffs)), key=lambda r: replica_diffs[r].mean) if replica_diffs else 0
    base = logprobs[0][0]
    tokens = sum(sum(s.response_mask) for s in probe)
    return SelfTest(
        teacher=teacher, replicas=len(repeats), tokens=tokens,
        repeat=repeat_diffs[repeat_replica], replica=replica_diffs[replica_index - 1] if replica_diffs else Diff(),
        repeat_replica=repeat_replica, replica_index=replica_index,
        signal=Diff.of(probe, base, student).mean,
        entropy_share=max(entropy_share(probe, a, vocab_size) for a, _ in repeats),
        oracle_teacher=_mean_masked(probe, base, oracle), oracle_student=_mean_masked(probe, student, oracle),
        max_noise=max_noise, check_oracle=check_oracle, baseline=[list(x) for x in base],
    )  # fmt: skip


def recheck(teacher: str, probe: Sequence[TokenStream], found: SelfTest, after: Sequence[TeacherScores], event: str) -> tuple[Diff, str | None]:
    """The probe scored again after `event` (a sleep, offload, reload, restart) against the pre-flight's scoring: the
    difference, and one line when it exceeds the measured noise (RECHECK_FACTOR, RECHECK_FLOOR above)."""
    diff = Diff.of(probe, found.baseline, [sc.logprobs for sc in after])
    tolerance = max(RECHECK_FACTOR * max(found.repeat.max, found.replica.max), RECHECK_FLOOR)
    if diff.max <= tolerance:
        return diff, None
    return diff, (f"teacher {teacher!r} changed after {event}: its log-probabilities of the self-test probe differ from the "
                  f"pre-flight's by up to {diff.max:.3g} (mean {diff.mean:.3g}) at {diff.where}, beyond the measured noise "
                  f"{tolerance:.3g}")  # fmt: skip
