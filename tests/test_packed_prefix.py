"""A family's shared prompt computed once in a packed row (agentopd.prefix.pack_row, attention.varlen_kwargs).

The packed path runs torch's flash varlen kernel, CUDA only. On CPU the teacher's scoring and the trainer's step
run here with a reference kernel (tests/_tiny.py: each segment's attention over its keys, causal aligned to the keys'
end as flash attention aligns a segment with more keys than queries): a stand-in for a kernel that cannot run on
these machines. The GPU test at the end checks the real kernel gives what the unshared packing gives."""

from __future__ import annotations

import pytest
import torch

from agentopd import attention
from agentopd.prefix import MIN_SHARED_PREFIX, pack_row, packed_items
from agentopd.teacher.hf import HFTeacher, plan_shared_rows
from agentopd.types import TokenStream
from _tiny import VOCAB, make_samples, tiny_model


def _stream(prompt: list[int], rest: list[int]) -> TokenStream:
    ids = prompt + rest
    n = len(rest)
    return TokenStream(token_ids=ids, prompt_len=len(prompt), response_mask=[1] * n, logprobs=[0.0] * n, turn_index=[0] * n)


def _streams(seed: int = 0, tasks: int = 3, samples: int = 4, prompt_len: int = 24) -> list[TokenStream]:
    """`samples` episodes of each of `tasks` prompts (the prompts share a system prefix of 10 tokens), interleaved
    the way a step's episodes arrive, plus one stream with a prompt of its own."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 90, (10,), generator=g).tolist()
    prompts = [system + torch.randint(3, 90, (prompt_len - 10,), generator=g).tolist() for _ in range(tasks)]
    out = []
    for k in range(samples):
        for p in prompts:
            out.append(_stream(p, torch.randint(3, 90, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()))
    out.append(_stream(torch.randint(3, 90, (20,), generator=g).tolist(), [5, 6, 7]))
    return out


def test_pack_row_puts_a_familys_prompt_once_and_each_member_after_it():
    streams = _streams()
    order = [i for f in packed_items(streams, 10_000) for i in f[1]]
    family = [streams[i] for i in order]
    row = pack_row(family)
    p = family[0].prompt_len - 1
    assert p >= MIN_SHARED_PREFIX
    assert len(row.ids) == 3 * p + sum(len(s.token_ids) - p for s in family[:-1]) + len(family[-1].token_ids)
    assert row.seq_lens[0] == p and row.continues[:5] == [-1, 0, 0, 0, 0]
    assert row.continues[-1] == -1  # the stream alone continues nothing
    for j, s in enumerate(family):  # every token of every stream is where `rows` says, at its own position
        start = p if j < len(family) - 1 else 0
        at = list(row.rows(j, start, len(s.token_ids)))
        assert [row.ids[r] for r in at] == s.token_ids[start:]
        assert [row.positions[r] for r in at] == list(range(start, len(s.token_ids)))
    assert pack_row(family, share=False).ids == [t for s in family for t in s.token_ids]


def test_packed_items_cost_the_prefix_once_and_split_a_family_at_the_budget():
    streams = _streams()
    items = packed_items(streams, 10_000)
    assert sorted(len(m) for _, m in items) == [1, 4, 4, 4]
    for cost, members in items:
        if len(members) > 1:
            p = streams[members[0]].prompt_len - 1
            assert cost == p + sum(len(streams[i].token_ids) - p for i in members)
    budget = max(c for c, m in items if len(m) > 1) - 1  # one token short of a whole family
    small = packed_items(streams, budget)
    assert all(c <= budget for c, m in small if len(m) > 1)
    assert sorted(i for _, m in small for i in m) == list(range(len(streams)))
    rows = plan_shared_rows(streams, 200)
    assert sorted(i for r in rows for i in r) == list(range(len(streams)))
    for r in rows:  # each row computes no more than its budget (a family's prompt once)
        row = pack_row([streams[i] for i in r])
        assert len(row.ids) <= 200 or len(r) == 1


def test_varlen_kwargs_gather_each_segments_prefix_before_its_keys():
    kw = attention.varlen_kwargs([3, 2, 4, 1], "cpu", [-1, 0, 0, -1])
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 5, 9, 10]
    assert kw["cu_seq_lens_k"].tolist() == [0, 3, 8, 15, 16]
    assert kw[attention.KEY_INDEX].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, 9]
    assert kw["max_length_k"] == 7 and kw["max_length_q"] == 4
    assert attention.KEY_INDEX not in attention.varlen_kwargs([3, 2], "cpu", [-1, -1])
    with pytest.raises(ValueError, match="continues segment 1"):
        attention.varlen_kwargs([3, 2, 4], "cpu", [-1, 0, 1])


def test_a_packed_teacher_scores_a_shared_prompt_once_as_it_scores_it_per_stream(cpu_varlen):
    streams = _streams(seed=3)
    model = tiny_model().to(torch.bfloat16)
    shared = HFTeacher(model, device="cpu", pack=True, max_tokens_per_batch=120)
    alone = HFTeacher(model, device="cpu", pack=True, max_tokens_per_batch=120, share_prefix=False)
    padded = HFTeacher(tiny_model(), device="cpu", pack=False, share_prefix=False)  # fp32, the same weights
    a, b = shared.score(streams, mode="hidden"), alone.score(streams, mode="hidden")
    c = padded.score(streams)
    for x, y, z in zip(a, b, c):
        assert torch.allclose(x.hidden.float(), y.hidden.float(), atol=2e-2, rtol=2e-2)
        assert x.logprobs == pytest.approx(z.logprobs, abs=0.05)
    # it computed fewer tokens: the packed rows of the shared plan
    rows = plan_shared_rows(streams, 120)
    assert sum(len(pack_row([streams[i] for i in r]).ids) for r in rows) < sum(len(s.token_ids) for s in streams)


@pytest.mark.gpu
def test_flash_varlen_scores_a_shared_prompt_once_as_it_scores_it_per_stream():
    if not attention.available("cuda"):
        pytest.skip("needs CUDA and torch.nn.attention.varlen")
    streams = _streams(seed=4, tasks=4, samples=8, prompt_len=64)
    model = tiny_model().to(torch.bfloat16)
    shared = HFTeacher(model, device="cuda", max_tokens_per_batch=1024).score(streams, mode="hidden")
    alone = HFTeacher(model, device="cuda", max_tokens_per_batch=1024, share_prefix=False).score(streams, mode="hidden")
    for x, y in zip(shared, alone):
        assert torch.allclose(x.hidden.float(), y.hidden.float(), atol=2e-2, rtol=2e-2)
        assert x.logprobs == pytest.approx(y.logprobs, abs=0.03)


def _as_tasks(samples, tasks: int, length: int = 24):
    """The samples as `tasks` tasks' episodes: sample i's prompt replaced by task i % tasks' (`length` tokens)."""
    import dataclasses

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 90, (length,), generator=g).tolist() for _ in range(tasks)]
    return [dataclasses.replace(s, token_ids=prompts[i % tasks] + s.token_ids[s.prompt_len :], prompt_len=length)
            for i, s in enumerate(samples)]  # fmt: skip


@pytest.mark.parametrize("kind", ["forward_kl", "sampled_k1"])
def test_a_packed_trainer_step_with_each_tasks_prompt_once_trains_like_whole_rows(cpu_varlen, kind):
    """trainer.share_prefix on the packed (varlen) path: the step's loss and the updated weights equal those of whole
    streams, and the decoder computed fewer tokens."""
    from agentopd.trainer import Trainer, TrainerConfig

    samples = _as_tasks(make_samples(8, seed=2, teacher_hidden=16), tasks=3)
    head_VH = torch.randn(VOCAB, 16, generator=torch.Generator().manual_seed(3))

    def step(share: bool, budget: int = 160):
        cfg = TrainerConfig(lr=1e-2, eps=1.0, warmup_steps=1, total_steps=4, loss=kind, micro_batch_tokens=budget,
                            share_prefix=share, mixed_precision="bf16")  # fmt: skip
        trainer = Trainer(tiny_model(), cfg)
        assert trainer.varlen
        seen = []
        trainer.hf.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
        metrics = trainer.train_step(samples, teacher_head_VH=head_VH)
        return metrics, {k: v.detach().float().clone() for k, v in trainer.hf.named_parameters()}, seen

    whole, whole_params, whole_seen = step(False)
    shared, shared_params, shared_seen = step(True)
    assert shared["loss"] == pytest.approx(whole["loss"], abs=1e-5)
    assert shared["train/tokens"] == whole["train/tokens"] and shared["train/padding_ratio"] == 0.0
    for k, v in whole_params.items():
        torch.testing.assert_close(shared_params[k], v, atol=1e-5, rtol=0, msg=k)
    assert sum(shared_seen) < sum(whole_seen) and len(shared_seen) < len(whole_seen)
    # where sharing would not save a micro-batch (everything fits one either way), the step runs whole streams
    assert sum(step(True, budget=10_000)[2]) == sum(step(False, budget=10_000)[2])


@pytest.mark.gpu
def test_flash_varlen_trains_a_shared_prompt_once_as_whole_rows():
    """The trainer's packed step on the real kernel (its backward too): share_prefix on and off, the same step."""
    if not attention.available("cuda"):
        pytest.skip("needs CUDA and torch.nn.attention.varlen")
    from agentopd.trainer import Trainer, TrainerConfig

    samples = _as_tasks(make_samples(16, seed=2, teacher_hidden=16), tasks=3, length=64)
    head_VH = torch.randn(VOCAB, 16, generator=torch.Generator().manual_seed(3))
    out = {}
    for share in (False, True):
        cfg = TrainerConfig(lr=1e-2, eps=1.0, warmup_steps=1, total_steps=4, loss="forward_kl", micro_batch_tokens=400,
                            share_prefix=share, mixed_precision="bf16")  # fmt: skip
        trainer = Trainer(tiny_model(), cfg, device="cuda")
        assert trainer.varlen
        loss = trainer.train_step(samples, teacher_head_VH=head_VH)["loss"]
        out[share] = loss, {k: v.detach().float().cpu() for k, v in trainer.hf.named_parameters()}
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-3, abs=1e-3)
    for k, v in out[False][1].items():
        torch.testing.assert_close(out[True][1][k], v, atol=1e-3, rtol=1e-2, msg=k)
