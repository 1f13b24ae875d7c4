"""Per-step diagnostics of a batch of episodes, under the metric names of docs/design.md 3.6.

    metrics = step_metrics(episodes, tool_names=["sql_query"])
    metrics["kl/turn_0"], metrics["tool/sql_query/error_rate"], metrics["tool_mask/tool_ratio"]

What each number is:
    tool_mask/llm_tokens      response tokens sampled by the student (mask 1), summed over the batch
    tool_mask/tool_tokens     response tokens with mask 0 (tool output, junction tokens). Token
                              streams carry no padding, so padding is never a tool token; for
                              padded tensors use `tool_mask_counts`, which counts only attended
                              positions
    tool_mask/tool_ratio      tool_tokens / (llm_tokens + tool_tokens)
    num_turns/min|max|mean    assistant turns per episode
    kl/mean                   mean over every student token of the batch of the per-token reverse-KL
                              estimate logp_student - logp_teacher (the k1 estimator), from the
                              stream's sampler logprobs and `episode.teacher_logprobs`; only scored
                              episodes count; absent when none is scored
    kl/turn_<k>               the same mean over the student tokens of assistant turn k (turn_index)
    kl/mean/<teacher>         the same per teacher, when `teacher_keys` routes episodes to teachers
    tool/<name>/calls         tool calls by name over the batch (the env's per-step counts)
    tool/<name>/error_rate    failed calls / calls for that tool (0.0 when never called)
    tool/parse_error_rate     assistant turns whose tool call did not parse / assistant turns
    reward/mean, success_rate over episodes

Tool counts come from `Turn.tool_calls` / `Turn.tool_call_errors` (the env's step info
"tool_calls" / "tool_call_errors", copied by the agent loop). A turn whose `tool_calls` is empty
but whose assistant message has calls (a loop that did not copy them) falls back to the
message: one call per `ToolCall.name`, and one error per `tool` observation message named after
the tool whose content begins with "Error:" (the env contract for failed calls).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

import torch

from agentopd.types import INTERVENED_TOKENS, PLAYED_BY, Episode, PlayedBy, Turn


def turn_tool_counts(turn: Turn) -> tuple[Counter[str], Counter[str]]:
    """(calls, errors) per tool name for one assistant turn (see the module docstring)."""
    if turn.tool_calls or not turn.assistant.tool_calls:
        return Counter(turn.tool_calls), Counter(turn.tool_call_errors)
    calls = Counter(c.name for c in turn.assistant.tool_calls)
    errors = Counter(
        m.name for m in turn.observation if m.role == "tool" and m.name in calls and m.content.startswith("Error:")
    )
    return calls, errors


def tool_mask_counts(response_mask_BR: torch.Tensor, attention_mask_BR: torch.Tensor) -> tuple[int, int]:
    """(llm tokens, tool tokens) of a padded batch: only attended positions count, so padding is
    neither. Both tensors B x R over the response positions, 1/0 valued."""
    if response_mask_BR.shape != attention_mask_BR.shape:
        raise ValueError(f"response_mask {tuple(response_mask_BR.shape)} vs attention_mask {tuple(attention_mask_BR.shape)}")
    attended_BR = attention_mask_BR.bool()
    student_BR = response_mask_BR.bool()
    return int((attended_BR & student_BR).sum()), int((attended_BR & ~student_BR).sum())


def _kl_sums(episode: Episode, n: int) -> list[tuple[int, float]]:
    """(turn, logp_student - logp_teacher) for every student token of a scored episode."""
    stream, teacher = episode.tokens, episode.teacher_logprobs
    assert stream is not None and teacher is not None
    try:
        return stream.kl_k1(teacher)
    except ValueError as e:
        raise ValueError(f"episode {n} ({episode.task_id!r}): {e}") from None


def step_metrics(
    episodes: Sequence[Episode],
    *,
    tool_names: Iterable[str] | None = None,
    teacher_keys: Sequence[str] | None = None,
) -> dict[str, float]:
    """The docs/design.md 3.6 diagnostics of one step's episodes. `tool_names` are always reported
    (zero calls included); `teacher_keys` (one per episode) adds kl/mean/<teacher>."""
    if not episodes:
        raise ValueError("step_metrics needs at least one episode")
    if teacher_keys is not None and len(teacher_keys) != len(episodes):
        raise ValueError(f"teacher_keys has {len(teacher_keys)} entries for {len(episodes)} episodes")
    out: dict[str, float] = {}

    llm = sum(e.tokens.num_llm_tokens for e in episodes if e.tokens is not None)
    tool = sum(e.tokens.num_tool_tokens for e in episodes if e.tokens is not None)
    out["tool_mask/llm_tokens"] = float(llm)
    out["tool_mask/tool_tokens"] = float(tool)
    out["tool_mask/tool_ratio"] = tool / (llm + tool) if llm + tool else 0.0

    turns = [e.num_turns for e in episodes]
    out["num_turns/min"] = float(min(turns))
    out["num_turns/max"] = float(max(turns))
    out["num_turns/mean"] = sum(turns) / len(turns)

    kl_sum: dict[int, float] = defaultdict(float)
    kl_count: Counter[int] = Counter()
    by_teacher_sum: dict[str, float] = defaultdict(float)
    by_teacher_count: Counter[str] = Counter()
    for n, e in enumerate(episodes):
        if e.tokens is None or e.teacher_logprobs is None:
            continue
        for turn, kl in _kl_sums(e, n):
            kl_sum[turn] += kl
            kl_count[turn] += 1
            if teacher_keys is not None:
                by_teacher_sum[teacher_keys[n]] += kl
                by_teacher_count[teacher_keys[n]] += 1
    if kl_count:
        out["kl/mean"] = sum(kl_sum.values()) / sum(kl_count.values())
        for turn in sorted(kl_count):
            out[f"kl/turn_{turn}"] = kl_sum[turn] / kl_count[turn]
        for key in sorted(by_teacher_count):
            out[f"kl/mean/{key}"] = by_teacher_sum[key] / by_teacher_count[key]

    calls: Counter[str] = Counter({name: 0 for name in tool_names or ()})
    errors: Counter[str] = Counter()
    all_turns = [t for e in episodes for t in e.turns]
    for t in all_turns:
        c, err = turn_tool_counts(t)
        calls.update(c)
        errors.update(err)
    for name in sorted(set(calls) | set(errors)):
        out[f"tool/{name}/calls"] = float(calls[name])
        out[f"tool/{name}/error_rate"] = errors[name] / calls[name] if calls[name] else 0.0
    out["tool/parse_error_rate"] = sum(t.parse_error for t in all_turns) / len(all_turns) if all_turns else 0.0

    out["reward/mean"] = sum(e.reward for e in episodes) / len(episodes)
    out["success_rate"] = sum(bool(e.success) for e in episodes) / len(episodes)
    return out


def teacher_work(episodes: Sequence[Episode], *, scored: bool, teacher_plays: bool) -> dict[str, float]:
    """`teacher/scored_tokens` (every token of the sequences the teacher scored: one forward pass over each, the
    episodes' and their branches') and `teacher/generated_tokens` (its assistant tokens: the episodes it played,
    all of them when `teacher_plays`, and the turns it took over)."""
    done = [ep for ep in episodes if ep.tokens is not None]
    tokens = sum(len(e.tokens.token_ids) + sum(len(b.token_ids) for b in e.branches) for e in done) if scored else 0
    generated = 0
    for ep in done:
        if teacher_plays or ep.info.get(PLAYED_BY) == PlayedBy.TEACHER:
            generated += ep.tokens.num_llm_tokens
        generated += sum(ep.info.get(INTERVENED_TOKENS, ()))
    return {"teacher/scored_tokens": float(tokens), "teacher/generated_tokens": float(generated)}


def phase_metrics(episodes: Sequence[Episode], *, rollout_s: float, teacher_s: float, sync_s: float) -> dict[str, float]:
    """Seconds of a step's phases and their throughput: `perf/rollout_tokens_per_s` counts the tokens the players
    sampled, `perf/teacher_tokens_per_s` every token of the scored streams."""
    sampled = sum(e.tokens.num_llm_tokens for e in episodes if e.tokens)
    streamed = sum(len(e.tokens.token_ids) for e in episodes if e.tokens)
    return {
        "perf/rollout_s": rollout_s,
        "perf/teacher_s": teacher_s,
        "perf/weight_sync_s": sync_s,
        "perf/rollout_tokens_per_s": sampled / rollout_s if rollout_s else 0.0,
        "perf/teacher_tokens_per_s": streamed / teacher_s if teacher_s else 0.0,
        "episodes": len(episodes),
    }

