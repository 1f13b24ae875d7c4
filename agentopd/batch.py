"""Training samples and packed micro-batches for the trainer.

One `TrainSample` is one episode ready for a train step: its token stream (docs/design.md 3.1), the
sampler's logprobs, what the teacher said about it, and its reward. `pack` puts samples back
to back into micro-batches of at most `max_tokens` computed tokens, with position ids that
restart at 0 for every sequence:

    samples = [TrainSample.from_stream(s, teacher_logprobs=t.logprobs, reward=r) for ...]
    for mb in pack(samples, max_tokens=8192, row_tokens=longest):
        hidden_BTH = model.model(input_ids=mb.input_ids_BT, position_ids=mb.position_ids_BT,
                                 use_cache=False).last_hidden_state
        hidden_NH = hidden_BTH[mb.loss_mask_BT]       # rows that predict a student token

Attention does not cross sequences: with `attention_mask=None`, no cache and position ids
that restart, transformers (5.x `masking_utils.find_packed_sequence_indices`) detects the
packed layout per row and builds a block-diagonal causal mask (sdpa/eager, CPU and GPU);
flash-attention derives `cu_seqlens` from the same position ids. `tests/test_batch.py`
checks that packed per-token logprobs equal separate forwards.

Two layouts (the trainer picks by attention kernel):
  - one row per micro-batch (`row_tokens=None`): no padding at all; right for flash-attention
    varlen, whose cost follows the sequences;
  - several rows of ~`row_tokens` (`row_tokens=R`): sequences first-fit into rows, each row
    padded to the micro-batch's longest; right for sdpa/eager, whose dense block-diagonal mask
    costs B x T^2 (one 4096-token row is ~30x slower on CPU than 32 rows of 128).

Alignment: position t predicts token t+1. Response token r of a sample (token
`prompt_len + r`) is predicted at position `prompt_len + r - 1`; the loss is taken at the
positions whose next token is a student token (response_mask 1). Per-loss-token values are
stored gathered in row-major position order ("N" rows), so they line up with
`hidden_BTH[mb.loss_mask_BT]`.

Legend: B = rows of a micro-batch, T = row length, N = loss (student) tokens in it,
H_t = teacher hidden size, K = teacher top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agentopd.prefix import MIN_SHARED_PREFIX, pack_row, packed_items, packed_len, shared_prefix_len
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
    token_weights: list[float] | None = None  # per response token, times `weight` (recipe.turn_support_below)
    teacher_index: int = 0  # which of the step's teacher lm_heads applies to teacher_hidden (several teachers)

    def __post_init__(self) -> None:
        if self.teacher_index < 0:
            raise ValueError(f"teacher_index must be >= 0, got {self.teacher_index}")
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
            "token_weights": self.token_weights,
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
        token_weights: list[float] | None = None,
        teacher_index: int = 0,
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
            token_weights=token_weights,
            teacher_index=teacher_index,
        )


@dataclass
class MicroBatch:
    """Samples packed into B rows of T tokens; per-loss-token values gathered as N rows.

    A row holds whole sequences back to back; a row shorter than T ends in padding that forms a
    sequence of its own (positions 0, 1, ...), so it never attends to or is attended by real
    tokens and carries no loss. Loss rows (N) are in row-major position order.
    """

    input_ids_BT: torch.Tensor  # long
    position_ids_BT: torch.Tensor  # long, restart at 0 per sequence
    loss_mask_BT: torch.Tensor  # bool: the next token is a student token
    targets_BT: torch.Tensor  # long: the next token (0 after a sequence's last token and on padding)
    seq_lens: list[list[int]]  # per row: the lengths of its sequences (padding not included)
    targets_N: torch.Tensor  # long: the student token predicted at each loss position
    old_logprobs_N: torch.Tensor  # float32: sampler logprob of that token
    weights_N: torch.Tensor  # float32: the episode's weight (times the token's, where given)
    advantages_N: torch.Tensor  # float32: the episode's task advantage
    sample_index_N: torch.Tensor  # long: index (into pack's input list) of the sample of each row
    teacher_logprobs_N: torch.Tensor | None = None  # float32
    teacher_topk_ids_NK: torch.Tensor | None = None  # long
    teacher_topk_logprobs_NK: torch.Tensor | None = None  # float32
    teacher_hidden_NH: torch.Tensor | None = None  # teacher dtype, (N, H_t)
    loss_index_N: torch.Tensor | None = None  # long: flat (row-major) index of each loss position in B x T
    # the tokens every row's sample starts with (collate's share_prefix): run once before the rows, whose
    # tokens, positions and lengths then start after it
    prefix_ids_1P: torch.Tensor | None = None
    # one packed row whose samples of one task share their prompt (collate's varlen_prefix, agentopd.prefix.pack_row):
    # per segment of seq_lens[0], the segment whose keys it attends to before its own (-1: none)
    seq_continues: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens computed: the shared prefix once, then the rows."""
        prefix = 0 if self.prefix_ids_1P is None else self.prefix_ids_1P.shape[1]
        return prefix + sum(sum(lens) for lens in self.seq_lens)

    @property
    def num_slots(self) -> int:
        """B * T: tokens the forward pass computes, padding included."""
        return self.input_ids_BT.numel()

    @property
    def num_loss_tokens(self) -> int:
        return self.targets_N.shape[0]

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy with every tensor on `device` (non-blocking where possible)."""
        moved = {
            k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()
        }
        return MicroBatch(**moved)


def _rows(samples: list[TrainSample], row_tokens: int | None, max_tokens: int) -> list[list[int]]:
    """Sample indices per row. row_tokens None: greedy in input order up to max_tokens per row;
    else first-fit decreasing into rows of row_tokens (a longer sample gets a row of its own)."""
    rows: list[list[int]] = []
    used: list[int] = []
    if row_tokens is None:
        for i, s in enumerate(samples):
            if rows and used[-1] + s.num_tokens <= max_tokens:
                rows[-1].append(i)
                used[-1] += s.num_tokens
            else:
                rows.append([i])
                used.append(s.num_tokens)
        return rows
    for i in sorted(range(len(samples)), key=lambda i: -samples[i].num_tokens):
        n = samples[i].num_tokens
        slot = next((r for r, u in enumerate(used) if u + n <= row_tokens), None)
        if slot is None:
            rows.append([i])
            used.append(n)
        else:
            rows[slot].append(i)
            used[slot] += n
    return rows


def _group_rows(samples: list[TrainSample], rows: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    """Consecutive rows per micro-batch while rows x (longest row) stays within max_tokens."""
    groups: list[list[list[int]]] = []
    width = 0
    for row in rows:
        n = sum(samples[i].num_tokens for i in row)
        if groups and (len(groups[-1]) + 1) * max(width, n) <= max_tokens:
            groups[-1].append(row)
            width = max(width, n)
        else:
            groups.append([row])
            width = n
    return groups


def _row_layout(samples: list[TrainSample], row: list[int], shared: int) -> tuple[list[int], ...]:
    """ids, positions, loss mask, targets and sequence lengths of one row, every sample from token `shared` on."""
    ids, pos, lmask, tgt, lens = [], [], [], [], []
    for i in row:
        s = samples[i]
        L, P = s.num_tokens, s.prompt_len
        ids.extend(s.token_ids[shared:])
        pos.extend(range(shared, L))
        tgt.extend((s.token_ids[1:] + [0])[shared:])
        lmask.extend(([False] * (P - 1) + [bool(m) for m in s.response_mask] + [False])[shared:])
        lens.append(L - shared)
    return ids, pos, lmask, tgt, lens


def _shared_row_layout(samples: list[TrainSample], row: list[int]) -> tuple[list[int], ...]:
    """`_row_layout` of a packed row whose samples of one task have their prompt in it once (pack_row); also the
    segments' `continues`."""
    layout = pack_row([samples[i] for i in row])
    lmask, tgt = [False] * len(layout.ids), [0] * len(layout.ids)
    for j, i in enumerate(row):
        s = samples[i]
        full_mask = [False] * (s.prompt_len - 1) + [bool(m) for m in s.response_mask] + [False]
        full_tgt = s.token_ids[1:] + [0]
        start = layout.shared[j]
        at = layout.rows(j, start, s.num_tokens)
        lmask[at.start : at.stop] = full_mask[start:]
        tgt[at.start : at.stop] = full_tgt[start:]
    return layout.ids, layout.positions, lmask, tgt, layout.seq_lens, layout.continues


def collate(samples: list[TrainSample], rows: list[list[int]], *, pin_memory: bool = False,
            share_prefix: bool = False, varlen_prefix: bool = False) -> MicroBatch:
    """One micro-batch of `micro_batch_rows`' layout: `rows` of sample indices (`pin_memory`: its teacher hidden states
    page-locked). `share_prefix`, where every row holds one sample: the tokens all of them start with (at least
    MIN_SHARED_PREFIX, agentopd.prefix) become `prefix_ids_1P`, run once; the rows hold what follows it.
    `varlen_prefix`, for one packed row (flash varlen only: its segments do not restart at position 0): the samples
    of one task have their shared prompt in the row once (`agentopd.prefix.pack_row`, `seq_continues`)."""
    parts = [samples[i] for row in rows for i in row]
    has_tlp = all(s.teacher_logprobs is not None for s in parts)
    has_topk = all(s.teacher_topk_ids is not None for s in parts)
    has_hidden = all(s.teacher_hidden is not None for s in parts)
    shared = 0
    if share_prefix and len(rows) > 1 and all(len(row) == 1 for row in rows):
        shared = shared_prefix_len(parts)
        shared = shared if shared >= MIN_SHARED_PREFIX else 0
    width = max(sum(samples[i].num_tokens for i in row) for row in rows) - shared
    ids_rows, pos_rows, mask_rows, tgt_rows, seq_lens = [], [], [], [], []
    old, tlp, w, adv, sidx, topk_ids, topk_lp, hidden_rows = [], [], [], [], [], [], [], []  # hidden: (sample, picked)
    continues = None
    if varlen_prefix and len(rows) == 1:
        *layout, continues = _shared_row_layout(samples, rows[0])
        width = len(layout[0])
    for row in rows:
        ids, pos, lmask, tgt, lens = layout if continues is not None else _row_layout(samples, row, shared)
        for i in row:  # loss rows in row order: each sample's follow its own tokens, in the order of `row`
            s = samples[i]
            picked = [r for r, m in enumerate(s.response_mask) if m]
            old.extend(s.old_logprobs[r] for r in picked)
            w.extend([s.weight] * len(picked) if s.token_weights is None else [s.weight * s.token_weights[r] for r in picked])
            adv.extend([s.advantage] * len(picked))
            sidx.extend([i] * len(picked))
            if has_tlp:
                tlp.extend(s.teacher_logprobs[r] for r in picked)
            if has_topk:
                topk_ids.extend(s.teacher_topk_ids[r] for r in picked)
                topk_lp.extend(s.teacher_topk_logprobs[r] for r in picked)
            if has_hidden:
                hidden_rows.append((s.teacher_hidden, picked))
        pad = width - len(ids)
        ids_rows.append(ids + [0] * pad)
        # padding after several sequences: a sequence of its own. After a row's only sequence it continues that
        # sequence's positions: causal attention keeps every real token from seeing it, and a micro-batch whose
        # rows all hold one sequence has no restarting positions, so transformers needs no block mask (SDPA's
        # causal kernel: ~10% faster a train step on CPU)
        pos_rows.append(pos + list(range(shared + len(pos), shared + width) if len(row) == 1 else range(pad)))
        mask_rows.append(lmask + [False] * pad)
        tgt_rows.append(tgt + [0] * pad)
        seq_lens.append(lens)
    loss_mask_BT = torch.tensor(mask_rows, dtype=torch.bool)
    targets_BT = torch.tensor(tgt_rows, dtype=torch.long)
    n, k = len(topk_ids), (len(topk_ids[0]) if topk_ids else 0)
    return MicroBatch(
        input_ids_BT=torch.tensor(ids_rows, dtype=torch.long),
        position_ids_BT=torch.tensor(pos_rows, dtype=torch.long),
        loss_mask_BT=loss_mask_BT,
        targets_BT=targets_BT,
        seq_lens=seq_lens,
        targets_N=targets_BT[loss_mask_BT],
        old_logprobs_N=torch.tensor(old, dtype=torch.float32),
        weights_N=torch.tensor(w, dtype=torch.float32),
        advantages_N=torch.tensor(adv, dtype=torch.float32),
        sample_index_N=torch.tensor(sidx, dtype=torch.long),
        teacher_logprobs_N=torch.tensor(tlp, dtype=torch.float32) if has_tlp else None,
        teacher_topk_ids_NK=torch.tensor(topk_ids, dtype=torch.long).reshape(n, k) if has_topk else None,
        teacher_topk_logprobs_NK=torch.tensor(topk_lp, dtype=torch.float32).reshape(n, k) if has_topk else None,
        teacher_hidden_NH=_gather_hidden(hidden_rows, pin_memory) if has_hidden else None,
        loss_index_N=loss_mask_BT.flatten().nonzero()[:, 0],
        prefix_ids_1P=torch.tensor([parts[0].token_ids[:shared]], dtype=torch.long) if shared else None,
        seq_continues=continues,
    )


def _gather_hidden(parts: list[tuple[torch.Tensor, list[int]]], pin_memory: bool) -> torch.Tensor:
    """The picked rows of each sample's teacher hidden states in one buffer, page-locked when the trainer is on a
    GPU (so its upload does not hold the host). torch.cat writes it with all threads: a plain copy_ per sample
    into fresh memory ran at ~1 GB/s on a GPU host (147 MB of 4B-teacher rows: 128 ms a step)."""
    rows = [h if len(p) == h.shape[0] else h.index_select(0, torch.tensor(p, dtype=torch.long)) for h, p in parts]
    out = torch.empty((sum(r.shape[0] for r in rows), rows[0].shape[1]), dtype=rows[0].dtype, pin_memory=pin_memory)
    return torch.cat(rows, out=out)


def pack(samples: list[TrainSample], max_tokens: int, *, row_tokens: int | None = None) -> list[MicroBatch]:
    """Pack samples into micro-batches of at most `max_tokens` computed tokens (B x T).

    row_tokens=None: one row per micro-batch, samples in input order, no padding at all — for
    attention kernels whose cost follows the sequences (flash-attention varlen from position ids).
    row_tokens=R: rows of up to R tokens filled first-fit decreasing, padded to the micro-batch's
    longest row — for sdpa/eager, whose block-diagonal mask costs B x T^2: use R ~ the longest sample
    (when every row holds one sample there is no mask at all: right padding under a causal mask).
    A sample longer than the budget gets a micro-batch of its own. Teacher fields are packed when
    every sample of a micro-batch has them (they are None otherwise).
    """
    return [collate(samples, g) for g in micro_batch_rows(samples, max_tokens, row_tokens=row_tokens)]


def _shared_rows(samples: list[TrainSample], max_tokens: int) -> list[list[int]]:
    """One packed row per micro-batch, the samples of one task together (agentopd.prefix.packed_items), rows filled
    in order up to `max_tokens` computed tokens (each task's prompt counted once)."""
    rows: list[list[int]] = []
    used = 0
    for cost, members in packed_items(samples, max_tokens):
        if rows and used + cost <= max_tokens:
            rows[-1] += members
            used += cost
        else:
            rows.append(list(members))
            used = cost
    return rows


def micro_batch_rows(samples: list[TrainSample], max_tokens: int, *, row_tokens: int | None = None,
                     varlen_prefix: bool = False) -> list[list[list[int]]]:  # fmt: skip
    """`pack`'s layout without building the tensors: per micro-batch, its rows of sample indices. The trainer
    collates each (`collate`) while the GPU still runs the one before. Samples of different `teacher_index`
    never share a micro-batch. `varlen_prefix` (with row_tokens=None): the samples of one task in one row, their
    shared prompt counted once against `max_tokens` (collate's varlen_prefix computes it once)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if row_tokens is not None and row_tokens < 1:
        raise ValueError(f"row_tokens must be >= 1 or None, got {row_tokens}")
    if not samples:
        return []
    teachers = sorted({s.teacher_index for s in samples})
    if len(teachers) > 1:  # one teacher per micro-batch: the loss applies one teacher lm_head to it
        groups = []
        for t in teachers:
            index = [i for i, s in enumerate(samples) if s.teacher_index == t]
            mine = micro_batch_rows([samples[i] for i in index], max_tokens, row_tokens=row_tokens, varlen_prefix=varlen_prefix)
            groups += [[[index[i] for i in row] for row in g] for g in mine]
        return groups
    if row_tokens is None and varlen_prefix:
        return [[row] for row in _shared_rows(samples, max_tokens)]
    rows = _rows(samples, row_tokens, max_tokens)
    return [[row] for row in rows] if row_tokens is None else _group_rows(samples, rows, max_tokens)


def micro_batch_slots(samples: list[TrainSample], group: list[list[int]], *, varlen_prefix: bool = False) -> int:
    """B x T of the micro-batch `collate` builds for `group` (padding included; with `varlen_prefix` and one row,
    each task's prompt once)."""
    if varlen_prefix and len(group) == 1:
        return packed_len([samples[i] for i in group[0]])
    return len(group) * max(sum(samples[i].num_tokens for i in row) for row in group)


def dummy_micro_batch(token_id: int = 0) -> MicroBatch:
    """A one-token micro-batch with no loss tokens: lets a rank with fewer micro-batches keep
    step with the FSDP collectives of the others (its forward/backward contributes zero)."""
    return collate([TrainSample(token_ids=[token_id], prompt_len=1, response_mask=[], old_logprobs=[])], [[0]])
