"""Drift over many stored multi-turn episodes per real vocabulary, chat template and tool-call format (issue 29).

    python benchmarks/drift_formats.py --episodes 1000 llama3_1 qwen3_5_think qwen3_5_think:nothinking qwen3 gptoss

Per template (trl's `trl/chat_templates/<name>.jinja`; `:nothinking` renders with enable_thinking=False): the
HostileEnv episodes of tests/test_tool_formats.py — 0-3 scripted tool calls in the template's format (some cut
mid-call: malformed), hostile tool outputs, then a tiny random-weight model with the family's real embedding rows
samples at T=1 — played by the agent loop, stored, and checked by check-tokens (agentopd.drift_run.check_run).
Qwen3.5 templates run on Qwen3.5's 248,077-token BPE, the others on Qwen3's 151,669 (Llama 3.x's template with
Llama's 7 template tokens added: Meta's BPE is not installable here; gpt-oss's harmony template with harmony's 7 tokens
added, 151,676 ids: its o200k_harmony BPE is not installable either, so gpt-oss runs on Qwen's BPE here). Harmony's
scripted calls come with an analysis message before them half the time, the call header in the model's form
(`<|channel|>commentary to=functions.fetch <|constrain|>json`) or the template's. Prints one line per template: episodes,
drifted, history rewrites by kind, stop reasons, parse errors and executed calls. Needs the dev extras; CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the env and the player are the tests' own

from agentopd.chat import chat_template_of  # noqa: E402
from agentopd.chat.formats import detect_format  # noqa: E402
from agentopd.drift_run import check_run  # noqa: E402
from agentopd.rollout import PARSE_ERROR_TOOL  # noqa: E402
from agentopd.rundir import RunDir  # noqa: E402
from agentopd.store import Store  # noqa: E402
from test_tool_formats import family_tok, play  # noqa: E402


def measure(spec: str, episodes: int, batch: int) -> str:
    template, _, mode = spec.partition(":")
    kw = {"enable_thinking": False} if mode == "nothinking" else {}
    tok = family_tok(None, template)
    t0, seen = time.time(), Counter()
    with tempfile.TemporaryDirectory() as tmp:
        rd = RunDir(Path(tmp) / "run")
        rd.root.mkdir()
        tok.save_pretrained(rd.tokenizer)
        store = Store(rd.db)
        for b in range(0, episodes, batch):
            seed = 1000 + b
            specs, eps = play(tok, min(batch, episodes - b), seed, 4096 if (b // batch) % 3 else 700, malformed=True, kw=kw)
            for s, ep in zip(specs, eps):
                store.add(ep, f"{s.episode_id}-{seed}")
                seen[f"stop:{ep.stop_reason.value}"] += 1
                seen["errors"] += "error" in ep.info
                for turn in ep.turns:
                    seen["parse_errors"] += any(m.name == PARSE_ERROR_TOOL for m in turn.observation)
                    seen["calls"] += sum(turn.tool_calls.values())
                    seen["turns"] += 1
        store.close()
        report = check_run(rd.root)
    stops = ", ".join(f"{k[5:]} {v}" for k, v in sorted(seen.items()) if k.startswith("stop:"))
    rewrites = ", ".join(f"{k} in {v}" for k, v in sorted(report.rewrites.items()))
    return (f"{spec} ({detect_format(chat_template_of(tok))}, {len(tok):,} ids): {report.checked} episodes checked, "
            f"{report.drifted} drifted; {seen['turns']} turns, {seen['calls']} calls executed, {seen['parse_errors']} parse-error "
            f"turns, {seen['errors']} loop errors; stops: {stops}; rewrites: {rewrites or 'none'}; {time.time() - t0:.0f} s")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("templates", nargs="+")
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=50, help="episodes per loop call (HostileEnv has 64 tasks)")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for spec in args.templates:
        print(measure(spec, args.episodes, args.batch), flush=True)


if __name__ == "__main__":
    main()
