"""VLLMEngine pieces that run without vLLM (it cannot be installed on our CPU machines).

The translation functions are checked against small stand-in objects shaped like vLLM's
`CompletionOutput` (token_ids, logprobs as a list of {token_id: Logprob(logprob=...)} dicts,
finish_reason) and a stand-in worker whose `model_runner.model.load_weights(weights=...)`
loads into a real tiny torch module. The engine itself (AsyncLLM, collective_rpc, sleep) is
not exercised here.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from agentopd.engines import FinishReason, SamplingParams, make_engine
from agentopd.engines.vllm import (
    INSTALL_HINT,
    VLLMEngine,
    WeightSyncExtension,
    logprobs_kind,
    result_from_output,
    to_vllm_sampling_kwargs,
    top_k_off,
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
        assert str(info.value) == INSTALL_HINT == "vLLM is not installed: pip install 'agentopd[vllm]'"
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


def test_logprobs_kind_marks_truncated_sampling():
    assert logprobs_kind(SamplingParams(temperature=1.0)) == "full"
    assert logprobs_kind(SamplingParams(temperature=0, top_p=0.5)) == "full"  # greedy ignores truncation
    assert logprobs_kind(SamplingParams(temperature=1.0, top_p=0.9)) == "renormalized"
    assert logprobs_kind(SamplingParams(temperature=1.0, top_k=5)) == "renormalized"


def test_result_from_output_reads_sampled_token_logprobs():
    # logprobs=0 in vLLM: each step holds the sampled token, sometimes plus the top-1 token.
    out = FakeCompletionOutput(
        token_ids=[7, 3, 2],
        logprobs=[{7: FakeLogprob(-0.5, 1)}, {3: FakeLogprob(-2.25, 4), 8: FakeLogprob(-0.1, 1)},
                  {2: FakeLogprob(-0.75, 1)}],
        finish_reason="stop", stop_reason=2,
    )
    r = result_from_output(out, SamplingParams(stop_token_ids=(2,)))
    assert r.token_ids == [7, 3, 2] and r.logprobs == [-0.5, -2.25, -0.75]
    assert r.finish_reason == FinishReason.STOP and r.info["logprobs"] == "full"
    for vllm_reason, ours in [("length", FinishReason.LENGTH), ("abort", FinishReason.ABORT)]:
        out.finish_reason = vllm_reason
        assert result_from_output(out, SamplingParams()).finish_reason == ours


def test_result_from_output_rejects_missing_logprobs_and_unknown_finish():
    with pytest.raises(ValueError, match="logprobs=0"):
        result_from_output(FakeCompletionOutput([1], None, "length"), SamplingParams())
    with pytest.raises(RuntimeError, match="'error'"):
        result_from_output(FakeCompletionOutput([1], [{1: FakeLogprob(-1.0)}], "error"), SamplingParams())


def test_weight_chunks_respect_the_byte_budget_and_keep_every_tensor():
    sd = {f"w{i}": torch.ones(n, dtype=torch.float32) for i, n in enumerate([10, 10, 30, 5, 100])}
    chunks = list(weight_chunks(sd, max_bytes=100))  # 100 bytes = 25 floats
    names = [[n for n, _ in c] for c in chunks]
    assert names == [["w0", "w1"], ["w2"], ["w3"], ["w4"]]
    assert [n for c in chunks for n, _ in c] == list(sd)
    assert all(t.device.type == "cpu" for c in chunks for _, t in c)


def test_worker_extension_loads_named_weights_into_the_model():
    net = torch.nn.Linear(3, 2)

    def load_weights(weights):  # what vLLM models do: copy each named tensor into its parameter
        params = dict(net.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)

    worker = type("Worker", (WeightSyncExtension,), {})()
    worker.model_runner = SimpleNamespace(model=SimpleNamespace(load_weights=load_weights))
    new = {"weight": torch.full((2, 3), 0.5), "bias": torch.tensor([1.0, -1.0])}
    loaded = sum(worker.agentopd_load_weights(c) for c in weight_chunks(new, max_bytes=16))
    assert loaded == 2
    assert torch.equal(net.weight, new["weight"]) and torch.equal(net.bias, new["bias"])
