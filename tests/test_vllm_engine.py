"""VLLMEngine pieces that run without vLLM (the main venv has none): option mapping (the run's
`engine.vllm` keys, the CPU KV cache's size, the variables a user's environment keeps), sampling
translation, weight packing, and the embedded pair built for vLLM (`student=builtin:vllm`). The
translation of outputs is checked against small stand-ins shaped like vLLM's `CompletionOutput`; the
engine itself runs against a real vLLM in tests/test_vllm_real.py.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field, replace

import pytest
import torch

from agentopd.backends.stages import vllm_options
from agentopd.engines import FinishReason, SamplingParams, make_engine
from agentopd.engines.vllm import (
    INSTALL_HINT,
    VLLMEngine,
    cpu_kv_cache_bytes,
    environ_defaults,
    pack_weights,
    result_from_output,
    to_vllm_sampling_kwargs,
    top_k_off,
    unpack_weights,
    vllm_engine_kwargs,
    weight_chunks,
)

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@dataclass
class FakeLogprob:  # shaped like vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FakeCompletionOutput:  # shaped like vllm.outputs.CompletionOutput
    token_ids: list[int]
    logprobs: list[dict[int, FakeLogprob]] | None
    finish_reason: str | None
    index: int = 0
    text: str = ""
    stop_reason: int | str | None = None
    extra: dict = field(default_factory=dict)


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_missing_vllm_gives_one_line_install_hint():
    for build in (lambda: VLLMEngine("some/model"), lambda: make_engine("vllm", "some/model")):
        with pytest.raises(ImportError) as info:
            build()
        assert str(info.value) == INSTALL_HINT
        assert INSTALL_HINT == "vLLM is not installed: pip install 'agentopd[vllm]' (on CPU: the README's vLLM-on-CPU lines)"
        assert "\n" not in str(info.value)


def test_sampling_kwargs_translate_every_field():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=33, stop_token_ids=(5, 9), seed=11)
    kw = to_vllm_sampling_kwargs(p, "0.30.1")
    assert kw == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_tokens": 33, "stop_token_ids": [5, 9],
        "seed": 11, "logprobs": 0, "detokenize": False, "ignore_eos": True,
    }
    assert to_vllm_sampling_kwargs(SamplingParams(), "0.30.1")["top_k"] == 0
    assert to_vllm_sampling_kwargs(SamplingParams(), "0.8.5")["top_k"] == -1
    assert to_vllm_sampling_kwargs(SamplingParams(temperature=0), "0.30.1")["temperature"] == 0


@pytest.mark.parametrize("t", [0.005, 2.5])
def test_temperatures_vllm_would_clamp_are_refused(t):
    with pytest.raises(ValueError, match=f"temperature={t}"):
        to_vllm_sampling_kwargs(SamplingParams(temperature=t), "0.30.1")


def test_top_k_off_follows_the_version():
    assert top_k_off("0.8.5") == -1
    assert top_k_off("0.9.0") == 0
    assert top_k_off("0.33.0") == 0
    assert top_k_off("0.10.1.dev12+g1234") == 0


def test_our_engine_options_map_to_vllm_names():
    kw = vllm_engine_kwargs("m", platform="cpu", device="cpu", dtype=torch.float32, max_batch_size=8, seed=None)
    assert kw["max_num_seqs"] == 8 and kw["dtype"] == "float32" and kw["seed"] == 0
    assert kw["distributed_executor_backend"] == "uni" and "gpu_memory_utilization" not in kw
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["skip_tokenizer_init"] is True
    assert "max_batch_size" not in kw and "device" not in kw
    # CPU: whole prefills only (a split seeded prefill kills vLLM's CPU engine), in a budget that fits the context
    assert kw["enable_chunked_prefill"] is False and kw["max_num_batched_tokens"] == 8192
    assert vllm_engine_kwargs("m", platform="cpu", model_max_len=40960)["max_num_batched_tokens"] == 40960
    gpu = vllm_engine_kwargs("m", platform="cuda", dtype="bfloat16", gpu_memory_utilization=0.4, tensor_parallel_size=2)
    assert gpu["dtype"] == "bfloat16" and gpu["gpu_memory_utilization"] == 0.4 and "distributed_executor_backend" not in gpu
    assert "enable_chunked_prefill" not in gpu and "max_num_batched_tokens" not in gpu
    assert vllm_engine_kwargs("m", platform="cuda")["dtype"] == "auto"
    # torch.compile: off on CPU unless asked for (the engine starts in seconds), vLLM's default on GPU unless refused
    assert kw["enforce_eager"] is True and "enforce_eager" not in vllm_engine_kwargs("m", platform="cpu", compile=True)
    assert "enforce_eager" not in gpu and vllm_engine_kwargs("m", platform="cuda", compile=False)["enforce_eager"] is True
    assert "kv_cache_memory_bytes" not in kw
    assert vllm_engine_kwargs("m", platform="cpu", kv_cache_memory_bytes=1 << 20)["kv_cache_memory_bytes"] == 1 << 20
    assert kw["kv_cache_dtype"] == "auto" and vllm_engine_kwargs("m", platform="cuda", kv_cache_dtype="fp8")["kv_cache_dtype"] == "fp8"
    with pytest.raises(ValueError, match="runs on 'cpu'"):
        vllm_engine_kwargs("m", platform="cpu", device="cuda")
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        vllm_engine_kwargs("m", platform="cuda", device="cuda:1")
    with pytest.raises(ValueError, match="model path"):
        vllm_engine_kwargs(torch.nn.Linear(1, 1), platform="cpu")


def test_the_cpu_kv_cache_is_sized_from_the_run():
    from transformers import Qwen3Config

    # 2 layers, 2 KV heads of 32, fp32: 2 * 2 * 2 * 32 * 4 = 1 KiB a token (K and V)
    cfg = Qwen3Config(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=2)
    assert cpu_kv_cache_bytes(cfg, torch.float32, 64, 2048) == 64 * 2048 * 1024  # max_batch_size whole contexts
    assert cpu_kv_cache_bytes(cfg, torch.bfloat16, 64, 2048) == 64 * 2048 * 512
    assert cpu_kv_cache_bytes(cfg, torch.float32, 4, 40960) == 40960 * 1024  # at least one whole context ...
    assert cpu_kv_cache_bytes(cfg, torch.float32, 64, 40960) == 64 * 2048 * 1024  # ... else 2,048 tokens each
    assert cpu_kv_cache_bytes(cfg, torch.float32, 3, 1000) == 3 * 1024 * 1024  # whole blocks of 128 tokens


def test_engine_options_come_from_the_runs_engine_vllm_keys():
    from agentopd.config import load_config

    assert vllm_options(load_config("sql_db")) == {
        "kv_cache_gib": None, "compile": None, "worker_process": False, "gpu_memory_utilization": 0.5}
    cfg = load_config("sql_db", overrides=["engine.vllm.kv_cache_gib=2", "engine.vllm.compile=true",
                                           "engine.vllm.worker_process=true", "engine.vllm.gpu_memory_utilization=0.3"])
    assert vllm_options(cfg) == {
        "kv_cache_gib": 2, "compile": True, "worker_process": True, "gpu_memory_utilization": 0.3}
    # a Ray rollout worker's share of its GPU, not the half a local trainer leaves
    ray = load_config("sql_db", overrides=["backend=ray", "ray.gpus_per_rollout_worker=0.5"])
    assert vllm_options(ray)["gpu_memory_utilization"] == pytest.approx(0.45)
    with pytest.raises(ValueError, match="engine.vllm.kv_cache_gib"):
        load_config("sql_db", overrides=["engine.vllm.kv_cache_gib=0"])


def test_a_users_own_variable_wins_and_ours_are_taken_back(monkeypatch):
    monkeypatch.setenv("AGENTOPD_TEST_MINE", "user")
    monkeypatch.delenv("AGENTOPD_TEST_OURS", raising=False)
    with environ_defaults({"AGENTOPD_TEST_MINE": "ours", "AGENTOPD_TEST_OURS": "0"}):
        assert os.environ["AGENTOPD_TEST_MINE"] == "user" and os.environ["AGENTOPD_TEST_OURS"] == "0"
    assert os.environ["AGENTOPD_TEST_MINE"] == "user" and "AGENTOPD_TEST_OURS" not in os.environ


def test_the_embedded_pair_for_vllm_has_head_size_32_and_keeps_the_default_teacher(tmp_path):
    """`student=builtin:vllm`: vLLM's CPU build serves head sizes 32 and up; the embedded student's is 24. The pair
    for vLLM is cached apart, keeps the default pair's teacher (copied) and trains its own student."""
    import json

    from agentopd.bootstrap import TINY_SPEC, ModelSize, bootstrap, vllm_spec

    # a toy teacher of head size 32 (1 head of 32) and student of 16 (2 heads of 16), as the real ones are 32 and 24
    spec = replace(TINY_SPEC, teacher=replace(TINY_SPEC.teacher, size=ModelSize(hidden=32, layers=1, heads=1, kv_heads=1)))
    assert vllm_spec(spec).teacher == spec.teacher and vllm_spec(spec).student.size.head_dim == 32
    served = bootstrap("calculator", spec=spec, home=tmp_path, for_vllm=True)
    base = bootstrap("calculator", spec=spec, home=tmp_path)  # built on the way, now cached
    assert served.student_dir == tmp_path / "models" / "vllm" / "calculator" / "student"
    assert base.student_dir == tmp_path / "models" / "calculator" / "student"

    def config(folder):
        return json.loads((folder / "config.json").read_text())

    assert config(served.student_dir)["head_dim"] == 32 and config(base.student_dir)["head_dim"] == 16
    assert config(served.student_dir)["hidden_size"] == config(base.student_dir)["hidden_size"] == 32
    assert (served.teacher_dir / "model.safetensors").read_bytes() == (base.teacher_dir / "model.safetensors").read_bytes()
    assert served.report["teacher"] == base.report["teacher"]
    stamp = (served.student_dir / "model.safetensors").stat().st_mtime_ns
    assert bootstrap("calculator", spec=spec, home=tmp_path, for_vllm=True).student_dir == served.student_dir
    assert (served.student_dir / "model.safetensors").stat().st_mtime_ns == stamp  # cached
    assert vllm_spec(vllm_spec(spec)) == vllm_spec(spec)  # a pair vLLM serves (sql_db_explore's) is its own pair for vLLM


def test_builtin_vllm_names_the_student_built_for_vllm(monkeypatch, tmp_path):
    import agentopd.bootstrap as b
    from agentopd.bootstrap import BuiltinModels
    from agentopd.models import resolve_model, resolve_student

    asked = []

    def fake(env, **kwargs):
        asked.append(kwargs["for_vllm"])
        return BuiltinModels(env, tmp_path / "teacher", tmp_path / ("student-vllm" if kwargs["for_vllm"] else "student"))

    monkeypatch.setattr(b, "bootstrap", fake)
    assert resolve_model("builtin:vllm", "sql_db", "student") == tmp_path / "student-vllm"
    assert resolve_model("builtin", "sql_db", "student") == tmp_path / "student" and asked == [True, False]
    with pytest.raises(ValueError, match="builtin:vllm"):
        resolve_model("builtin:gpu", "sql_db", "student")
    with pytest.raises(ValueError, match="mixed run"):
        resolve_student("builtin:vllm", ["sql_db", "calculator"], mixed=True)


def test_unknown_engine_options_are_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['max_num_seqs', 'typo'\]"):
        VLLMEngine("some/model", max_num_seqs=4, typo=1)


def test_result_from_output_reads_sampled_token_logprobs():
    # logprobs=0 in vLLM: each step holds the sampled token, sometimes plus the top-1 token.
    out = FakeCompletionOutput(
        token_ids=[7, 3, 2],
        logprobs=[{7: FakeLogprob(-0.5, 1)}, {3: FakeLogprob(-2.25, 4), 8: FakeLogprob(-0.1, 1)},
                  {2: FakeLogprob(-0.75, 1)}],
        finish_reason="stop", stop_reason=2,
    )
    r = result_from_output(out)
    assert r.token_ids == [7, 3, 2] and r.logprobs == [-0.5, -2.25, -0.75]
    assert r.finish_reason == FinishReason.STOP
    for vllm_reason, ours in [("length", FinishReason.LENGTH), ("abort", FinishReason.ABORT)]:
        out.finish_reason = vllm_reason
        assert result_from_output(out).finish_reason == ours


def test_result_from_output_rejects_missing_logprobs_and_unknown_finish():
    with pytest.raises(ValueError, match="logprobs=0"):
        result_from_output(FakeCompletionOutput([1], None, "length"))
    with pytest.raises(RuntimeError, match="'error'"):
        result_from_output(FakeCompletionOutput([1], [{1: FakeLogprob(-1.0)}], "error"))


def test_weight_chunks_respect_the_byte_budget_and_keep_every_tensor():
    sd = {f"w{i}": torch.ones(n, dtype=torch.float32) for i, n in enumerate([10, 10, 30, 5, 100])}
    chunks = list(weight_chunks(sd, max_bytes=100))  # 100 bytes = 25 floats
    names = [[n for n, _ in c] for c in chunks]
    assert names == [["w0", "w1"], ["w2"], ["w3"], ["w4"]]
    assert [n for c in chunks for n, _ in c] == list(sd)
    assert all(t.device.type == "cpu" for c in chunks for _, t in c)


def test_packed_weights_round_trip_through_bytes():
    # vLLM's RPC carries bytes, not tensors: a chunk goes as torch.save bytes, tied (shared) tensors and bf16 included.
    emb = torch.randn(5, 3)
    chunk = [("embed.weight", emb), ("lm_head.weight", emb), ("norm.weight", torch.ones(3, dtype=torch.bfloat16)),
             ("proj.weight", torch.randn(4, 6).t())]  # non-contiguous
    blob = pack_weights(chunk)
    assert isinstance(blob, bytes)
    back = unpack_weights(blob)
    assert [n for n, _ in back] == [n for n, _ in chunk]
    for (_, a), (_, b) in zip(chunk, back):
        assert a.dtype == b.dtype and torch.equal(a, b)
