"""losses/head_matmul: the vocabulary head's rows widened to an aligned count from the storage that holds them
(the CUDA loss and teacher GEMMs; measured by benchmarks/head_gemm_align.py). CPU only here: the device check is
widened to the CPU for the tests that need it."""

import pytest
import torch

from agentopd.losses import head_matmul as hm


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(hm, "DEVICES", frozenset({"cpu", "cuda"}))


def test_padded_cols():
    assert [hm.padded_cols(v) for v in (1, 64, 65, 151_669, 151_936)] == [64, 64, 128, 151_680, 151_936]


def test_widened_rows_reads_the_rows_that_follow_in_storage(on_cpu):
    w = torch.arange(200 * 4, dtype=torch.float32).view(200, 4)
    wide = hm.widened_rows(w[:65])
    assert wide.shape == (128, 4) and torch.equal(wide, w[:128]) and wide.data_ptr() == w.data_ptr()
    assert hm.widened_rows(w[:64]).shape == (64, 4)  # already aligned: itself
    assert hm.widened_rows(w[:150]).shape == (192, 4)  # 192 <= 200 rows in storage
    assert hm.widened_rows(w[10:75]).shape == (128, 4)  # from its offset: rows 10..137
    assert hm.widened_rows(w[100:165]) is None  # rows 100..227 would pass the storage's end


def test_widened_rows_refuses_what_it_cannot_widen(on_cpu):
    assert hm.widened_rows(torch.zeros(65, 4)) is None  # the storage ends at row 65
    assert hm.widened_rows(torch.zeros(4, 200).T[:65]) is None  # not row-contiguous
    assert hm.widened_rows(torch.zeros(65)) is None


def test_widening_is_off_where_it_does_not_pay():
    w = torch.zeros(200, 4)
    assert hm.widened_rows(w[:65]) is None  # the default: CUDA only


def test_finite_rows():
    w = torch.zeros(128, 4)
    assert hm.finite_rows(w, 65)
    w[100, 2] = float("nan")
    assert not hm.finite_rows(w, 65) and hm.finite_rows(w[:65], 65)


def test_upload_widened_keeps_the_padding_rows_in_the_new_storage():
    w = torch.randn(200, 4)
    head = w[:65]
    assert hm.upload_widened(head, "cpu") is head  # already there
    copied = hm.upload_widened(head, "meta")  # another device (the trainer's GPU in a run)
    assert copied.shape == (65, 4) and copied.untyped_storage().nbytes() == 128 * 4 * 4
    assert hm.upload_widened(torch.randn(65, 4), "meta").untyped_storage().nbytes() == 65 * 4 * 4  # nothing to keep


def test_a_teacher_head_on_the_host_keeps_its_padding_rows():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from agentopd.teacher.hf import HFTeacher

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    head = HFTeacher(model, device="cpu", vocab_size=101).head_weight()
    assert head.shape == (101, 16) and hm._widen(head).shape == (128, 16)
