"""HFTeacher against a direct forward of the same tiny random-init Qwen3 model, and the
tokenizer compatibility check on two small hand-built tokenizers."""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from agentopd.teacher import HFTeacher, Teacher, TeacherMode, check_compatible, plan_micro_batches
from agentopd.types import TokenStream

VOCAB = 128


def tiny_model(seed: int = 0, **overrides) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
    )
    cfg.update(overrides)
    model = Qwen3ForCausalLM(Qwen3Config(**cfg))
    with torch.no_grad():  # larger logits than the default init, so differences would show
        model.lm_head.weight.mul_(20.0)
    return model.eval()


def make_streams(n: int, seed: int = 0) -> list[TokenStream]:
    rng = random.Random(seed)
    streams = []
    for _ in range(n):
        prompt_len = rng.randint(1, 6)
        mask: list[int] = []
        turn_index: list[int] = []
        for turn in range(rng.randint(1, 3)):
            a, t = rng.randint(1, 6), rng.randint(0, 5)
            mask += [1] * a + [0] * t
            turn_index += [turn] * (a + t)
        ids = [rng.randrange(VOCAB) for _ in range(prompt_len + len(mask))]
        logprobs = [-rng.random() if m else 0.0 for m in mask]
        streams.append(TokenStream(ids, prompt_len, mask, logprobs, turn_index))
    return streams


@torch.no_grad()
def direct_logprobs_RV(model, stream: TokenStream, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax of a plain forward, rows = the positions predicting each response token."""
    logits_TV = model(torch.tensor([stream.token_ids])).logits[0].float()
    rows = [stream.prompt_len + i - 1 for i in range(len(stream.response_mask))]
    return torch.log_softmax(logits_TV[rows] / temperature, dim=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_a_direct_forward(temperature):
    model = tiny_model()
    streams = make_streams(7)
    teacher = HFTeacher(model, device="cpu", max_tokens_per_batch=40, temperature=temperature, head_chunk=5)
    scores = teacher.score(streams, mode=TeacherMode.LOGPROBS)
    assert isinstance(teacher, Teacher)
    for stream, sc in zip(streams, scores):
        ref_RV = direct_logprobs_RV(model, stream, temperature)
        want = ref_RV.gather(1, torch.tensor(stream.response_ids)[:, None])[:, 0]
        assert len(sc.logprobs) == len(stream.response_mask)
        for i, m in enumerate(stream.response_mask):
            if m:
                assert sc.logprobs[i] == pytest.approx(want[i].item(), abs=1e-4)
            else:
                assert sc.logprobs[i] == 0.0
        assert sc.topk_ids is None and sc.hidden is None
    # response token i is predicted by position prompt_len + i - 1, not prompt_len + i
    s = streams[0]
    shifted = torch.log_softmax(model(torch.tensor([s.token_ids])).logits[0, s.prompt_len], -1)[s.response_ids[0]]
    assert s.response_mask[0] == 1 and abs(scores[0].logprobs[0] - shifted.item()) > 1e-3


def test_padding_and_micro_batching_change_nothing():
    model = tiny_model()
    streams = make_streams(9, seed=1)
    together = HFTeacher(model, device="cpu", max_tokens_per_batch=10_000).score(streams, mode="topk")
    alone = HFTeacher(model, device="cpu", max_tokens_per_batch=1).score(streams, mode="topk")
    for a, b in zip(together, alone):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert a.topk_logprobs is not None and b.topk_logprobs is not None
        for x, y in zip(a.topk_logprobs, b.topk_logprobs):
            assert x == pytest.approx(y, abs=1e-5)


def test_topk_matches_torch_topk():
    model = tiny_model()
    streams = make_streams(4, seed=2)
    scores = HFTeacher(model, device="cpu", top_k=5).score(streams, mode=TeacherMode.TOPK)
    for stream, sc in zip(streams, scores):
        ref = direct_logprobs_RV(model, stream).topk(5, dim=-1)
        assert sc.topk_ids is not None and sc.topk_logprobs is not None
        assert len(sc.topk_ids) == len(stream.response_mask) and all(len(r) == 5 for r in sc.topk_ids)
        assert sc.topk_ids == ref.indices.tolist()
        assert torch.allclose(torch.tensor(sc.topk_logprobs), ref.values, atol=1e-4)
        for i, m in enumerate(stream.response_mask):
            if m:
                assert sc.topk_logprobs[i][0] >= sc.logprobs[i] - 1e-6


def test_hidden_rows_with_head_weight_give_the_teacher_logits():
    model = tiny_model()
    streams = make_streams(5, seed=3)
    teacher = HFTeacher(model, device="cpu", max_tokens_per_batch=30)
    scores = teacher.score(streams, mode="hidden")
    head_VH = teacher.head_weight()
    assert head_VH.device.type == "cpu" and head_VH.shape == (VOCAB, 32) and not head_VH.requires_grad
    assert teacher.head_weight(num_rows=100).shape == (100, 32)
    for stream, sc in zip(streams, scores):
        assert sc.hidden is not None and sc.hidden.shape == (len(stream.response_mask), 32)
        assert sc.hidden.device.type == "cpu"
        recomputed_RV = torch.log_softmax(sc.hidden.float() @ head_VH.float().T, dim=-1)
        assert torch.allclose(recomputed_RV, direct_logprobs_RV(model, stream), atol=1e-4)


def test_bf16_teacher_keeps_hidden_in_its_dtype():
    model = tiny_model()
    teacher = HFTeacher(model, device="cpu", dtype=torch.bfloat16)
    (sc,) = teacher.score(make_streams(1, seed=4), mode="hidden")
    assert sc.hidden is not None and sc.hidden.dtype == torch.bfloat16


def test_a_model_handed_over_scores_as_the_same_checkpoint_loaded_from_its_folder(tmp_path):
    """HFTeacher given a loaded model and a dtype casts its weights only: `Module.to(dtype)` also cast the rotary
    embedding's fp32 inv_freq to bf16 (RoPE angles off by ~0.1%, growing with the position), so a teacher built on a
    model its engine shares (backends.teacher_weights) scored a self-pair 0.0027 nats a token of KL apart where the
    folder-loaded one scored 0.0003."""
    model = tiny_model(max_position_embeddings=512)
    model.save_pretrained(tmp_path / "m")
    rng = random.Random(3)
    ids = [rng.randrange(VOCAB) for _ in range(400)]
    stream = TokenStream(ids, 8, [1] * 392, [0.0] * 392, [0] * 392)
    from_folder = HFTeacher(tmp_path / "m", device="cpu", dtype=torch.bfloat16).score([stream])[0].logprobs
    handed = HFTeacher(model, device="cpu", dtype=torch.bfloat16)
    assert handed.model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert next(handed.model.parameters()).dtype == torch.bfloat16
    assert handed.score([stream])[0].logprobs == from_folder


def test_refuses_bad_input():
    model = tiny_model()
    teacher = HFTeacher(model, device="cpu")
    with pytest.raises(ValueError, match="prompt_len"):
        teacher.score([TokenStream([1, 2], 0, [1, 1], [0.0, 0.0], [0, 0])])
    with pytest.raises(ValueError, match="token id 500"):
        teacher.score([TokenStream([1, 500], 1, [1], [0.0], [0])])
    with pytest.raises(ValueError, match="mode"):
        teacher.score(make_streams(1), mode="logits")
    with pytest.raises(ValueError, match="temperature"):
        HFTeacher(model, temperature=0.0)
    capped = tiny_model()
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        HFTeacher(capped)


def test_plan_micro_batches_respects_the_budget():
    lengths = [5, 30, 7, 7, 12, 3, 50]
    groups = plan_micro_batches(lengths, 30)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 30
    assert [6] in groups  # longer than the budget: alone


@pytest.mark.gpu
def test_two_phase_frees_the_gpu():
    shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64)
    streams = make_streams(8)
    (torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")).sum().item()  # cuBLAS workspace
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model = tiny_model(**shape)
    teacher = HFTeacher(model, device="cuda")
    first = teacher.score(streams, mode="hidden")
    assert all(t.device.type == "cpu" for t in model.state_dict().values())
    assert torch.cuda.memory_allocated() == before
    assert all(s.hidden is not None and s.hidden.device.type == "cpu" for s in first)
    second = teacher.score(streams, mode="hidden")  # weights survive the round trip
    assert [s.logprobs for s in first] == [s.logprobs for s in second]
    assert torch.cuda.memory_allocated() == before
    on_cpu = HFTeacher(tiny_model(**shape), device="cpu").score(streams, mode="hidden")
    for a, b in zip(first, on_cpu):
        assert a.logprobs == pytest.approx(b.logprobs, abs=2e-3)
    cuda_model = tiny_model(**shape).cuda()  # a teacher handed over on the GPU is offloaded too
    HFTeacher(cuda_model, device="cuda").score(streams)
    assert all(t.device.type == "cpu" for t in cuda_model.state_dict().values())
    assert torch.cuda.memory_allocated() == before


@pytest.mark.gpu
def test_a_resident_teacher_stays_on_the_gpu_and_gives_its_head_from_pinned_memory():
    """offload_after_score=False (teacher.offload resolved to off): the weights stay on the GPU between scorings, and
    head_weight() is the pinned host copy (no device-to-host copy of the head a step), equal to the GPU's."""
    shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64)
    model = tiny_model(**shape)
    teacher = HFTeacher(model, device="cuda", offload_after_score=False)
    first = teacher.score(make_streams(8), mode="hidden")
    assert all(t.device.type == "cuda" for t in model.state_dict().values())
    head = teacher.head_weight()
    assert head.device.type == "cpu" and head.is_pinned()
    assert torch.equal(head, model.get_output_embeddings().weight.detach()[: head.shape[0]].cpu())
    assert [s.logprobs for s in teacher.score(make_streams(8), mode="hidden")] == [s.logprobs for s in first]


@pytest.mark.gpu
def test_a_compiled_teacher_scores_as_the_eager_one_and_its_hidden_rows_stay_its_own():
    """teacher.compile (each layer's forward compiled) gives the eager scores; the hidden rows come through the pinned
    staging buffer (HFTeacher._to_host), each stream's its own copy, unchanged by the next scoring."""
    shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64)
    streams = make_streams(8)
    eager = HFTeacher(tiny_model(**shape).to(torch.bfloat16), device="cuda").score(streams, mode="hidden")
    teacher = HFTeacher(tiny_model(**shape).to(torch.bfloat16), device="cuda", compile=True)
    first = teacher.score(streams, mode="hidden")
    kept = [s.hidden.clone() for s in first]
    again = teacher.score(list(reversed(streams)), mode="hidden")  # the staging buffer is written again
    for a, b, k in zip(eager, first, kept):  # bf16: compiled kernels round differently, ~2 ulps (2^-7) of a log-probability's size
        assert a.logprobs == pytest.approx(b.logprobs, rel=8e-3, abs=3e-2)
        assert (a.hidden.float() - b.hidden.float()).norm() <= 3e-2 * a.hidden.float().norm()
        assert torch.equal(b.hidden, k)
    for a, b in zip(again, reversed(first)):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-2)


# --- tokenizer / vocabulary compatibility ---------------------------------------------------
def word_tokenizer(words: list[str]) -> Tokenizer:
    return Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))


WORDS = ["[UNK]", "<eos>", "select", "from", "where", "count", "name", "age", "users", "orders"]


def test_identical_tokenizers_pass_and_padding_rows_are_fine():
    student, teacher = word_tokenizer(WORDS), word_tokenizer(WORDS)
    assert check_compatible(student, teacher) == len(WORDS)
    # larger embedding matrix on the teacher side (padding rows, as Qwen 151,936 vs 152,064)
    assert check_compatible(student, teacher, Qwen3Config(vocab_size=10), Qwen3Config(vocab_size=16)) == 10
    assert check_compatible(student, teacher, 10, 64) == 10


def test_one_different_token_is_refused_with_sizes_and_the_token():
    other = list(WORDS)
    other[6] = "title"
    with pytest.raises(ValueError) as err:
        check_compatible(word_tokenizer(WORDS), word_tokenizer(other + ["extra"]))
    msg = str(err.value)
    assert "student has 10 tokens" in msg and "teacher 11" in msg
    assert "id 6" in msg and "'name'" in msg and "'title'" in msg


def test_transformers_tokenizers_and_added_special_tokens():
    student = PreTrainedTokenizerFast(tokenizer_object=word_tokenizer(WORDS), unk_token="[UNK]")
    teacher = PreTrainedTokenizerFast(tokenizer_object=word_tokenizer(WORDS), unk_token="[UNK]")
    assert check_compatible(student, teacher) == 10
    teacher.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    with pytest.raises(ValueError, match=r"id 10: student '<none>' vs teacher '<tool>'"):
        check_compatible(student, teacher)
    student.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    assert check_compatible(student, teacher) == 11


def test_a_matrix_smaller_than_the_tokenizer_is_refused():
    with pytest.raises(ValueError, match="teacher model has 8 vocabulary rows"):
        check_compatible(word_tokenizer(WORDS), word_tokenizer(WORDS), 10, Qwen3Config(vocab_size=8))


def test_plan_packed_rows_respects_the_budget():
    from agentopd.teacher.hf import plan_packed_rows

    lengths = [5, 30, 7, 7, 12, 3, 50, 18]
    rows = plan_packed_rows(lengths, 30)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    for r in rows:
        assert len(r) == 1 or sum(lengths[i] for i in r) <= 30
    assert [6] in rows and [1] in rows  # at or over the budget: alone
    assert len(rows) == 4  # 50 | 30 | 18+12 | 7+7+5+3: first-fit decreasing leaves no row that could merge
    assert not HFTeacher(tiny_model(), device="cpu").pack  # packing needs CUDA's flash varlen kernel


def test_a_shared_prefix_is_run_once_and_changes_nothing():
    """Streams that start alike (a system prompt): the common prefix goes through the decoder once and every stream
    attends to its K/V. Scores equal a direct forward of each stream and the path without sharing; the decoder
    sees the prefix once plus every stream's rest; a prefix that would swallow a stream's first predicting
    position is cut short of it."""
    from agentopd.prefix import MIN_SHARED_PREFIX, shared_prefix_len

    rng = random.Random(7)
    prefix = [rng.randrange(VOCAB) for _ in range(24)]
    streams = []
    for n in range(5):
        own = [rng.randrange(VOCAB) for _ in range(3 + n)]
        mask = [1] * 4 + [0] * 3 + [1] * (2 + n)
        ids = prefix + own + [rng.randrange(VOCAB) for _ in mask]
        streams.append(TokenStream(ids, len(prefix) + len(own), mask, [0.0] * len(mask), [0] * len(mask)))
    assert shared_prefix_len(streams) == 24 >= MIN_SHARED_PREFIX
    model = tiny_model()
    seen = []
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    shared = HFTeacher(model, device="cpu").score(streams, mode="hidden")
    assert seen[0] == (1, 24) and seen[1] == (5, max(len(s.token_ids) for s in streams) - 24)
    seen.clear()
    plain = HFTeacher(model, device="cpu", share_prefix=False).score(streams, mode="hidden")
    assert seen == [(5, max(len(s.token_ids) for s in streams))]
    head_VH = model.lm_head.weight.detach()
    for stream, a, b in zip(streams, shared, plain):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        torch.testing.assert_close(a.hidden, b.hidden, atol=1e-5, rtol=1e-5)
        assert torch.allclose(torch.log_softmax(a.hidden @ head_VH.T, -1), direct_logprobs_RV(model, stream), atol=1e-4)
    # one stream whose prompt is the prefix itself: its position 23 predicts its first response token
    short = TokenStream(prefix + [5, 6], 24, [1, 1], [0.0, 0.0], [0, 0])
    assert shared_prefix_len([*streams, short]) == 23


def test_head_logits_of_a_half_head_without_its_fp32_copy():
    """Issue 30: the teacher's fp32 head was a full fp32 copy (2.3 GiB for Qwen3-8B); now logits of a bf16 head
    come from fp32 casts of row blocks (or a half GEMM with fp32 output on CUDA): the same fp32 sums."""
    from agentopd.teacher.hf import head_logits

    torch.manual_seed(0)
    h_nH, w_VH = torch.randn(5, 64).bfloat16(), torch.randn(300, 64).bfloat16()
    ref_nV = h_nH.double() @ w_VH.double().T
    out_nV = head_logits(h_nH, w_VH, block=128)  # three blocks, the last one short
    assert out_nV.dtype == torch.float32 and out_nV.shape == (5, 300)
    torch.testing.assert_close(out_nV.double(), ref_nV, atol=1e-4, rtol=1e-5)
    assert head_logits(h_nH, w_VH, fp32=False).dtype == torch.float32  # bf16 logits, returned as fp32


def test_head_gemm_over_widened_rows_scores_the_same(monkeypatch):
    """On CUDA the teacher's head GEMM runs over the rows up to an aligned count where the head has them
    (losses/head_matmul); forced on here, a tokenizer of 101 ids in a 128-row head: the same scores, and the
    rows past the tokenizer (never sampled) are not normalised over."""
    from agentopd.losses import head_matmul

    model = tiny_model()
    streams = [TokenStream([t % 101 for t in s.token_ids], s.prompt_len, s.response_mask, s.logprobs,
                           s.turn_index) for s in make_streams(5)]
    out = []
    for devices in ({"cuda"}, {"cuda", "cpu"}):
        monkeypatch.setattr(head_matmul, "DEVICES", frozenset(devices))
        out.append(HFTeacher(model, device="cpu", vocab_size=101, head_chunk=4, top_k=3).score(streams, mode="topk"))
    for a, b in zip(*out):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
        assert a.topk_ids == b.topk_ids and max(max(r) for r in a.topk_ids) < 101
