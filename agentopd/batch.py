"""Training samples and packed micro-batches (no padding) for the trainer.

One `TrainSample` is one episode ready for a train step: its token stream (DESIGN 3.1), the
sampler's logprobs, what the teacher said about it, and its reward. `pack` concatenates
samples into micro-batches of at most `max_tokens` tokens each — one row, no padding —
with position ids that restart at 0 for every sequence:

    samples = [TrainSample.from_stream(s, teacher_logprobs=t.logprobs, reward=r) for ...]
    for mb in pack(samples, max_tokens=4096):
        hidden_1TH = model.model(input_ids=mb.input_ids_1T, position_ids=mb.position_ids_1T,
                                 use_cache=False).last_hidden_state
        hidden_NH = hidden_1TH[0, mb.loss_index_N]   # rows that predict a student token

Attention does not cross sequences: with `attention_mask=None`, no cache and position ids
that restart, transformers (>= 4.56 / 5.x `masking_utils.find_packed_sequence_indices`)
detects the packed layout and builds a block-diagonal causal mask (sdpa/eager, CPU and GPU);
flash-attention derives `cu_seqlens` from the same position ids. `tests/test_batch.py`
checks that packed per-token logprobs equal separate forwards.

Alignment: position t predicts token t+1. Response token r of a sample (token
`prompt_len + r`) is predicted at position `prompt_len + r - 1`; the loss is taken at the
positions whose next token is a student token (response_mask 1). Per-loss-token values are
stored gathered, in position order ("N" rows), so they line up with `hidden_1TH[0, loss_index_N]`.

Legend: T = packed tokens of a micro-batch, N = loss (student) tokens in it, S = sequences
in it, H_t = teacher hidden size, K = teacher top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agentopd.types import TokenStream


@dataclass
class TrainSample:
    """One episode for training. Per-response-token lists have length len(token_ids) - prompt_len."""

    token_ids: list[int]
    prompt_len: int
    response_mask: list[int]  # 1 = sampled by the student (trained on), 0 = tool output / junction
    old_logprobs: list[float]  # sampler logprob of each response token (0.0 where mask 0)
    teacher_logprobs: list[float] | None = None  # teacher logprob of each sampled response token
    teacher_topk_ids: list[list[int]] | None = None  # per response token: the teacher's top-k ids
    teacher_topk_logprobs: list[list[float]] | None = None  # ... and their logprobs
    teacher_hidden: torch.Tensor | None = None  # (response_len, H_t): row r = teacher final hidden predicting token r
    reward: float = 0.0
    group_id: int = 0  # samples of the same task/prompt share a group (GRPO, per-group weighting)
    weight: float = 1.0  # per-episode loss weight (the trainer multiplies in reward weighting)
    advantage: float = 0.0  # per-episode task advantage (the trainer fills it for the GRPO term)
    turn_index: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.token_ids) - self.prompt_len
        if self.prompt_len < 1 or n < 0:
            raise ValueError(
                f"prompt_len={self.prompt_len} must be in [1, len(token_ids)={len(self.token_ids)}] "
                "(the first response token needs a token before it)"
            )
        per_token = {
            "response_mask": self.response_mask,
            "old_logprobs": self.old_logprobs,
            "teacher_logprobs": self.teacher_logprobs,
            "teacher_topk_ids": self.teacher_topk_ids,
            "teacher_topk_logprobs": self.teacher_topk_logprobs,
            "teacher_hidden": self.teacher_hidden,
        }
        if self.turn_index:
            per_token["turn_index"] = self.turn_index
        for name, value in per_token.items():
            if value is not None and len(value) != n:
                raise ValueError(f"{name} has length {len(value)}, expected the response length {n}")
        if (self.teacher_topk_ids is None) != (self.teacher_topk_logprobs is None):
            raise ValueError("teacher_topk_ids and teacher_topk_logprobs must be given together")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_student_tokens(self) -> int:
        return sum(self.response_mask)

    @classmethod
    def from_stream(
        cls,
        stream: TokenStream,
        *,
        teacher_logprobs: list[float] | None = None,
        teacher_topk_ids: list[list[int]] | None = None,
        teacher_topk_logprobs: list[list[float]] | None = None,
        teacher_hidden: torch.Tensor | None = None,
        reward: float = 0.0,
        group_id: int = 0,
        weight: float = 1.0,
    ) -> TrainSample:
        """A sample from a token stream plus the teacher's scores of it (teacher.TeacherScores fields)."""
        return cls(
            token_ids=list(stream.token_ids),
            prompt_len=stream.prompt_len,
            response_mask=list(stream.response_mask),
            old_logprobs=list(stream.logprobs),
            teacher_logprobs=teacher_logprobs,
            teacher_topk_ids=teacher_topk_ids,
            teacher_topk_logprobs=teacher_topk_logprobs,
            teacher_hidden=teacher_hidden,
            reward=reward,
            group_id=group_id,
            weight=weight,
            turn_index=list(stream.turn_index),
        )


@dataclass
class MicroBatch:
    """Samples packed into one row of T tokens; per-loss-token values gathered as N rows."""

    input_ids_1T: torch.Tensor  # long
    position_ids_1T: torch.Tensor  # long, restart at 0 per sequence
    cu_seqlens_S1: torch.Tensor  # int32, (S+1,): sequence boundaries in the row
    loss_mask_1T: torch.Tensor  # bool: the next token is a student token
    targets_1T: torch.Tensor  # long: the next token (0 after a sequence's last token)
    loss_index_N: torch.Tensor  # long: positions where loss_mask_1T is True, ascending
    targets_N: torch.Tensor  # long: the student token predicted at each loss position
    old_logprobs_N: torch.Tensor  # float32: sampler logprob of that token
    weights_N: torch.Tensor  # float32: the episode's weight
    advantages_N: torch.Tensor  # float32: the episode's task advantage
    sample_index_N: torch.Tensor  # long: index (into pack's input list) of the sample of each row
    teacher_logprobs_N: torch.Tensor | None = None  # float32
    teacher_topk_ids_NK: torch.Tensor | None = None  # long
    teacher_topk_logprobs_NK: torch.Tensor | None = None  # float32
    teacher_hidden_NH: torch.Tensor | None = None  # teacher dtype, (N, H_t)

    @property
    def num_tokens(self) -> int:
        return self.input_ids_1T.shape[1]

    @property
    def num_loss_tokens(self) -> int:
        return self.loss_index_N.shape[0]

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy with every tensor on `device` (non-blocking where possible)."""
        moved = {
            k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()
        }
        return MicroBatch(**moved)


def _group(samples: list[TrainSample], max_tokens: int) -> list[list[int]]:
    """Greedy in input order: fill a micro-batch until the next sample would exceed the budget."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, s in enumerate(samples):
        if current and used + s.num_tokens > max_tokens:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += s.num_tokens
    if current:
        groups.append(current)
    return groups


def _collate(samples: list[TrainSample], indices: list[int]) -> MicroBatch:
    ids, pos, lmask, tgt, seqlens = [], [], [], [], [0]
    old, tlp, w, adv, sidx, topk_ids, topk_lp, hidden_rows = [], [], [], [], [], [], [], []
    parts = [samples[i] for i in indices]
    has_tlp = all(s.teacher_logprobs is not None for s in parts)
    has_topk = all(s.teacher_topk_ids is not None for s in parts)
    has_hidden = all(s.teacher_hidden is not None for s in parts)
    for i, s in zip(indices, parts):
        L, P = s.num_tokens, s.prompt_len
        ids.extend(s.token_ids)
        pos.extend(range(L))
        tgt.extend(s.token_ids[1:] + [0])
        mask = [False] * (P - 1) + [bool(m) for m in s.response_mask] + [False]
        assert len(mask) == L, (len(mask), L)
        lmask.extend(mask)
        seqlens.append(seqlens[-1] + L)
        rows = [r for r, m in enumerate(s.response_mask) if m]
        old.extend(s.old_logprobs[r] for r in rows)
        w.extend([s.weight] * len(rows))
        adv.extend([s.advantage] * len(rows))
        sidx.extend([i] * len(rows))
        if has_tlp:
            tlp.extend(s.teacher_logprobs[r] for r in rows)
        if has_topk:
            topk_ids.extend(s.teacher_topk_ids[r] for r in rows)
            topk_lp.extend(s.teacher_topk_logprobs[r] for r in rows)
        if has_hidden:
            hidden_rows.append(s.teacher_hidden[torch.tensor(rows, dtype=torch.long)])
    loss_mask_1T = torch.tensor([lmask], dtype=torch.bool)
    targets_1T = torch.tensor([tgt], dtype=torch.long)
    loss_index_N = loss_mask_1T[0].nonzero().squeeze(-1)
    k = len(topk_ids[0]) if topk_ids else 0
    n = len(topk_ids)
    return MicroBatch(
        input_ids_1T=torch.tensor([ids], dtype=torch.long),
        position_ids_1T=torch.tensor([pos], dtype=torch.long),
        cu_seqlens_S1=torch.tensor(seqlens, dtype=torch.int32),
        loss_mask_1T=loss_mask_1T,
        targets_1T=targets_1T,
        loss_index_N=loss_index_N,
        targets_N=targets_1T[0, loss_index_N],
        old_logprobs_N=torch.tensor(old, dtype=torch.float32),
        weights_N=torch.tensor(w, dtype=torch.float32),
        advantages_N=torch.tensor(adv, dtype=torch.float32),
        sample_index_N=torch.tensor(sidx, dtype=torch.long),
        teacher_logprobs_N=torch.tensor(tlp, dtype=torch.float32) if has_tlp else None,
        teacher_topk_ids_NK=torch.tensor(topk_ids, dtype=torch.long).reshape(n, k) if has_topk else None,
        teacher_topk_logprobs_NK=torch.tensor(topk_lp, dtype=torch.float32).reshape(n, k) if has_topk else None,
        teacher_hidden_NH=torch.cat(hidden_rows) if has_hidden else None,
    )


def pack(samples: list[TrainSample], max_tokens: int) -> list[MicroBatch]:
    """Pack samples, in order, into micro-batches of at most `max_tokens` tokens (no padding).

    A sample longer than the budget gets a micro-batch of its own. Teacher fields are packed
    when every sample of a micro-batch has them (they are None otherwise).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    return [_collate(samples, g) for g in _group(samples, max_tokens)]


def dummy_micro_batch(token_id: int = 0) -> MicroBatch:
    """A one-token micro-batch with no loss tokens: lets a rank with fewer micro-batches keep
    step with the FSDP collectives of the others (its forward/backward contributes zero)."""
    return _collate([TrainSample(token_ids=[token_id], prompt_len=1, response_mask=[], old_logprobs=[])], [0])
