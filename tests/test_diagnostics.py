"""step_metrics on hand-built episodes whose every metric is computed by hand below."""

from __future__ import annotations

import pytest
import torch

from agentopd.diagnostics import step_metrics, tool_mask_counts, turn_tool_counts
from agentopd.types import Episode, Message, StopReason, TokenStream, ToolCall, Turn


def turn(calls=None, errors=None, parse_error=False, assistant_calls=(), observation=()) -> Turn:
    return Turn(
        assistant=Message("assistant", "", tool_calls=list(assistant_calls)),
        observation=list(observation),
        parse_error=parse_error,
        tool_calls=dict(calls or {}),
        tool_call_errors=dict(errors or {}),
    )


def episode(stream, teacher, turns, reward, success) -> Episode:
    return Episode(env="sql_db", task_id="t", messages=[], tools=[], turns=turns, reward=reward, success=success,
                   stop_reason=StopReason.ANSWER, tokens=stream, teacher_logprobs=teacher)


def batch() -> list[Episode]:
    # A: turn 0 = 3 student tokens + 2 tool tokens, turn 1 = 2 student tokens
    a = episode(
        TokenStream([1, 2, 3] + [10, 11, 12, 50, 51, 13, 14], 3, [1, 1, 1, 0, 0, 1, 1], [-0.5, -1.0, -0.2, 0, 0, -0.3, -0.4],
                    [0, 0, 0, 0, 0, 1, 1]),
        [-0.7, -0.5, -0.2, 0, 0, -1.3, -0.1],  # kl: turn 0 = 0.2 - 0.5 + 0 ; turn 1 = 1.0 - 0.3
        [turn({"sql_query": 2}, {"sql_query": 1}), turn()],
        1.0, True,
    )
    # B: three turns; turn 1 has a parse error
    b = episode(
        TokenStream([1, 2] + [20, 21, 60, 61, 62, 22, 63, 23, 24], 2, [1, 1, 0, 0, 0, 1, 0, 1, 1],
                    [-1.0, -2.0, 0, 0, 0, -0.5, 0, -0.1, -0.2], [0, 0, 0, 0, 0, 1, 1, 2, 2]),
        [-1.5, -1.0, 0, 0, 0, -0.5, 0, -0.6, -0.2],  # kl: turn 0 = 0.5 - 1.0 ; turn 1 = 0 ; turn 2 = 0.5 + 0
        [turn({"sql_query": 1, "calculate": 1}, {"calculate": 1}), turn(parse_error=True), turn()],
        0.0, False,
    )
    # C: not scored by the teacher; its turn lacks the env's counts -> fallback to the message
    c = episode(
        TokenStream([7, 30, 31, 70], 1, [1, 1, 0], [-0.1, -0.1, 0.0], [0, 0, 0]),
        None,
        [turn(assistant_calls=[ToolCall("sql_query", {"query": "SELECT * FROM nope"})],
              observation=[Message("tool", "Error: no such table: nope", name="sql_query")])],
        0.5, False,
    )
    return [a, b, c]


def test_every_metric_by_hand():
    m = step_metrics(batch(), tool_names=["sql_query", "calculate", "python"])
    want = {
        "tool_mask/llm_tokens": 12.0,  # 5 + 5 + 2
        "tool_mask/tool_tokens": 7.0,  # 2 + 4 + 1
        "tool_mask/tool_ratio": 7 / 19,
        "num_turns/min": 1.0, "num_turns/max": 3.0, "num_turns/mean": 2.0,
        "kl/mean": (-0.3 + 0.7 - 0.5 + 0.0 + 0.5) / 10,
        "kl/turn_0": (-0.3 - 0.5) / 5,
        "kl/turn_1": (0.7 + 0.0) / 3,
        "kl/turn_2": 0.5 / 2,
        "tool/sql_query/calls": 4.0, "tool/sql_query/error_rate": 2 / 4,
        "tool/calculate/calls": 1.0, "tool/calculate/error_rate": 1.0,
        "tool/python/calls": 0.0, "tool/python/error_rate": 0.0,
        "tool/parse_error_rate": 1 / 6,
        "reward/mean": 0.5,
        "success_rate": 1 / 3,
    }
    assert set(m) == set(want)
    for k, v in want.items():
        assert m[k] == pytest.approx(v, abs=1e-12), k


def test_per_teacher_kl():
    m = step_metrics(batch(), teacher_keys=["big", "small", "big"])
    assert m["kl/mean/big"] == pytest.approx((-0.3 + 0.7) / 5)  # C is not scored
    assert m["kl/mean/small"] == pytest.approx(0.0)
    assert "kl/mean/other" not in m


def test_no_teacher_scores_no_kl_and_zero_safe_rates():
    e = episode(TokenStream([1, 2], 1, [1], [-0.2], [0]), None, [], 0.0, False)
    m = step_metrics([e])
    assert not any(k.startswith("kl/") for k in m)
    assert m["tool/parse_error_rate"] == 0.0 and m["num_turns/max"] == 0.0
    assert m["tool_mask/tool_ratio"] == 0.0 and m["tool_mask/llm_tokens"] == 1.0


def test_padding_is_never_a_tool_token():
    episodes = batch()
    masks = [e.tokens.response_mask for e in episodes]
    width = max(map(len, masks)) + 3
    for pad_value in (0, 1):  # whatever a padded position holds in the mask, it is not counted
        mask_BR = torch.tensor([r + [pad_value] * (width - len(r)) for r in masks])
        attention_BR = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in masks])
        assert tool_mask_counts(mask_BR, attention_BR) == (12, 7)
    m = step_metrics(episodes)
    assert (m["tool_mask/llm_tokens"], m["tool_mask/tool_tokens"]) == (12.0, 7.0)


def test_env_counts_win_over_the_fallback():
    t = turn({"sql_query": 1}, {}, assistant_calls=[ToolCall("sql_query", {})],
             observation=[Message("tool", "Error: x", name="sql_query")])
    assert turn_tool_counts(t) == ({"sql_query": 1}, {})


def test_refusals():
    with pytest.raises(ValueError, match="at least one"):
        step_metrics([])
    bad = episode(TokenStream([1, 2, 3], 1, [1, 1], [0.0, 0.0], [0, 0]), [0.0], [], 0.0, False)
    with pytest.raises(ValueError, match="teacher_logprobs has 1 entries"):
        step_metrics([bad])
    with pytest.raises(ValueError, match="teacher_keys"):
        step_metrics(batch(), teacher_keys=["a"])


def test_teacher_equal_to_the_sampler_gives_zero_kl():
    """End to end with HFTeacher: the sampler's own logprobs scored by the same model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from agentopd.teacher import HFTeacher

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)).eval()
    ids = torch.randint(0, 64, (14,)).tolist()
    prompt_len, mask, turns = 3, [1, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    with torch.no_grad():
        lp_TV = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
    sampler = [lp_TV[prompt_len + i - 1, ids[prompt_len + i]].item() if m else 0.0 for i, m in enumerate(mask)]
    stream = TokenStream(ids, prompt_len, mask, sampler, turns)
    (scores,) = HFTeacher(model, device="cpu").score([stream])
    m = step_metrics([episode(stream, scores.logprobs, [turn(), turn(), turn()], 1.0, True)])
    for k in ("kl/mean", "kl/turn_0", "kl/turn_1", "kl/turn_2"):
        assert abs(m[k]) < 1e-5, k
