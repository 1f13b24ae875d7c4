"""agentopd's drift checker over what TRL's DistillationTrainer trained on (benchmarks/vs_trl.py, issue 32).

    report = check_trl_streams(Path("trl_sql_db/trl_streams.json"), tokenizer_dir)

TRL keeps, per sample, the prompt ids, the completion ids (every turn's sampled ids, each tool result's tokens
between them) and `tool_mask` (0 on tool results). vs_trl_trl_side.py records them with the conversation TRL built
(prompt messages, then its parsed assistant turns and tool messages). Each becomes an agentopd stream: token_ids =
prompt + completion, response_mask = tool_mask, turn_index counted at each 0 -> 1 edge of the mask, logprobs 0.0
(TRL keeps no sampler logprobs; the checker only bounds them). The raw assistant texts are the sampled spans
decoded, so the re-render compares what was sampled, not TRL's parse of it. `check_episode` then re-renders the
conversation with the tokenizer's own chat template and compares text and non-assistant tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from agentopd.chat.drift import FindingKind, check_episode


def to_stream(rec: dict) -> tuple[dict, list[str]]:
    """One TRL sample as an agentopd stream dict, and its sampled spans (token ids) per turn."""
    mask = list(rec["tool_mask"])
    mask += [1] * (len(rec["completion_ids"]) - len(mask))  # TRL pads tool_mask with 1 (never shorter in practice)
    turns, spans, turn, prev = [], [], -1, 0
    for i, m in enumerate(mask):
        if m == 1 and prev == 0:
            turn += 1
            spans.append([])
        if m == 1:
            spans[turn].append(rec["completion_ids"][i])
        turns.append(max(turn, 0))
        prev = m
    stream = {"token_ids": rec["prompt_ids"] + rec["completion_ids"], "prompt_len": len(rec["prompt_ids"]),
              "response_mask": mask, "logprobs": [0.0] * len(mask), "turn_index": turns}  # fmt: skip
    return stream, spans


def check_one(tok: PreTrainedTokenizerBase, rec: dict, tools: list[dict]) -> tuple[bool, list[str]]:
    stream, spans = to_stream(rec)
    raw = [tok.decode(ids, skip_special_tokens=False) for ids in spans]
    messages = list(rec["prompt"]) + [m for m in rec["completions"] if m]
    report = check_episode(tok, messages, tools, stream, raw)
    return report.ok, [f"{f.kind}: {f.message}" for f in report.drift]


def check_trl_streams(path: Path, tokenizer_dir: Path, tools: list[dict]) -> dict:
    """Summary: samples checked, token-exact ones, ones with tool results, and the first findings.
    `tools`: the JSON schemas the prompts were rendered with (the env's)."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    records = json.loads(path.read_text())
    exact, multi, kinds, examples = 0, 0, {}, []
    for rec in records:
        ok, findings = check_one(tok, rec, tools)
        exact += ok
        multi += 0 in rec["tool_mask"]
        for f in findings:
            kind = f.split(":")[0]
            kinds[kind] = kinds.get(kind, 0) + 1
            if len(examples) < 5:
                examples.append(f[:300])
    assert all(k in {str(x) for x in FindingKind} for k in kinds), kinds
    return {"samples": len(records), "token_exact": exact, "with_tool_results": multi, "findings": kinds,
            "examples": examples}  # fmt: skip
