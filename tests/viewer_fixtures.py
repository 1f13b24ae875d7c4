"""Run directories for the viewer's tests and benchmark, written through the real code paths.

    fx = build_run(tmp_path / "runs" / "demo")   # RunFixture: path, ids, hostile_id, ...
    hostile_id = add_hostile_episode(run_dir)     # appends an episode full of HTML/JS to ANY run dir
    ep = long_episode(tokenizer, turns=20, tokens=8000)

`build_run` stands in for a short real run until the main job exists (swap it for a real run
directory: the tests only need `fx.path`, and `add_hostile_episode` works on a copy of any
run). It writes what a run writes (docs/design.md 3.5/3.6):
- `tokenizer/`: a byte-level BPE tokenizer (agentopd.chat.tokenizer.build_tokenizer, vocab 400);
- `trajectories.db`: episodes through `agentopd.store.Store`, their token streams assembled by
  `agentopd.chat.stream.StreamBuilder` (assistant ids verbatim, tool output delta-tokenized,
  mask 0), assistant text parsed by `agentopd.chat.parser.parse_assistant`, sampler and teacher
  logprobs drawn from a seeded RNG;
- `metrics.jsonl`: per step, `agentopd.diagnostics.step_metrics` of that step's episodes plus
  loss / grad_norm / lr, and `eval/success_rate` on eval steps.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentopd.chat.parser import parse_assistant
from agentopd.chat.stream import StreamBuilder
from agentopd.chat.template import encode
from agentopd.chat.tokenizer import EOS_TOKEN, build_tokenizer
from agentopd.diagnostics import step_metrics
from agentopd.store import Store
from agentopd.types import Episode, Message, StopReason, Turn

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "sql_query",
            "description": "Run a read-only SQL query.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    }
]
SYSTEM = "You answer questions about a shop database. Use the sql_query tool, then answer."
TABLES = ("customers", "orders", "products", "invoices")
HOSTILE = (
    "<script>window.__pwned=1</script> & </textarea><script>alert(1)</script> "
    '<img src=x onerror="window.__pwned=2"> <b>bold?</b> &amp;'
)


@dataclass
class RunFixture:
    path: Path
    ids: list[str] = field(default_factory=list)  # every episode id, in (step, id) order
    hostile_id: str = ""
    steps: int = 0


def corpus() -> list[str]:
    words = " ".join(TABLES) + " SELECT FROM WHERE COUNT name city total price answer the of is a"
    return [SYSTEM, words, HOSTILE, json.dumps(TOOLS)] * 20 + [f"{i} rows {i * 7}" for i in range(200)]


def make_tokenizer(path: Path | None = None):
    tok = build_tokenizer(corpus(), vocab_size=400)
    if path is not None:
        tok.save_pretrained(str(path))
    return tok


def _call_text(query: str, thought: str = "") -> str:
    call = json.dumps({"name": "sql_query", "arguments": {"query": query}})
    return f"<think>\n{thought or 'I should query the table.'}\n</think>\n\n<tool_call>\n{call}\n</tool_call>"


def _disagreement(rng: random.Random) -> float:
    """student - teacher logprob of one token: mostly near 0, sometimes large either way."""
    u = rng.random()
    return rng.gauss(0, 0.1) if u < 0.75 else rng.gauss(1.5, 0.6) if u < 0.9 else rng.gauss(-0.8, 0.4)


def make_episode(
    tok: Any,
    rng: random.Random,
    *,
    step: int,
    turns: list[tuple[str, list[str] | None]],
    question: str,
    reward: float,
    stop: StopReason = StopReason.ANSWER,
    max_assistant_tokens: int | None = None,
    scored: bool = True,
) -> Episode:
    """One episode from (assistant raw text, tool results or None) pairs; tool results become
    `tool` messages; token stream, sampler and teacher logprobs as the module docstring says."""
    first = [Message("system", SYSTEM), Message("user", question)]
    builder = StreamBuilder(tok, first, TOOLS, max_context=1 << 20)
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    messages, turn_records = list(first), []
    for text, results in turns:
        ids = encode(tok, text)[:max_assistant_tokens] + [eos]
        lps = [-rng.expovariate(2.0) for _ in ids]
        raw = builder.add_assistant(ids, lps, finished_by_stop=True)
        parsed = parse_assistant(raw)
        assistant = Message("assistant", parsed.content, parsed.tool_calls)
        messages.append(assistant)
        obs = [Message("tool", r, name="sql_query") for r in results or []]
        if obs:
            seg = builder.add_observation(obs)
            obs = [Message("tool", m["content"], name="sql_query") for m in seg.messages]
        messages += obs
        errors = sum(m.content.startswith("Error") for m in obs)
        turn_records.append(
            Turn(
                assistant,
                obs,
                raw_text=raw,
                parse_error=not parsed.ok,
                tool_errors=errors,
                tool_calls={"sql_query": len(parsed.tool_calls)} if parsed.tool_calls else {},
                tool_call_errors={"sql_query": errors} if errors else {},
            )
        )
    stream = builder.build()
    teacher = None
    if scored:  # the teacher mostly agrees, sometimes strongly disagrees
        teacher = [
            (lp - _disagreement(rng)) if m else 0.0
            for lp, m in zip(stream.logprobs, stream.response_mask)
        ]
    return Episode(
        env="sql_db",
        task_id=f"task-{rng.randrange(1000):03d}",
        messages=messages,
        tools=TOOLS,
        turns=turn_records,
        reward=reward,
        success=reward > 0.5,
        stop_reason=stop,
        tokens=stream,
        teacher_logprobs=teacher,
        step=step,
    )


def _ordinary(tok: Any, rng: random.Random, step: int, slot: int) -> Episode:
    table = TABLES[(step + slot) % len(TABLES)]
    n_calls = 1 + (step + slot) % 3
    turns: list[tuple[str, list[str] | None]] = []
    for k in range(n_calls):
        if (slot + k) % 4 == 3:
            turns.append((_call_text(f"SELEC name FROM {table}"), ["Error: near 'SELEC': syntax error"]))
        else:
            rows = "\n".join(f"{i} | name {i} | city {i * 3}" for i in range(3 if k else 40))  # first result is long
            turns.append((_call_text(f"SELECT name, city FROM {table} LIMIT 40", f"Look at {table}."), [rows]))
    success = rng.random() < 0.3 + 0.15 * step
    turns.append((f"The answer is {rng.randrange(100)}.", None))
    stop = StopReason.ANSWER if slot != 2 or step % 2 == 0 else StopReason.MAX_TURNS
    return make_episode(tok, rng, step=step, turns=turns, question=f"How many {table} are there?", reward=float(success), stop=stop)


def hostile_episode(tok: Any, step: int, seed: int = 7) -> Episode:
    rng = random.Random(seed)
    turns = [
        (_call_text(f"SELECT '{HOSTILE}'", f"thinking {HOSTILE}"), [f"Error: {HOSTILE}"]),
        (f"<tool_call>\nnot json {HOSTILE}\n</tool_call>", ["Error: could not parse the tool call"]),
        (f"Final answer: {HOSTILE}", None),
    ]
    ep = make_episode(tok, rng, step=step, turns=turns, question=f"question {HOSTILE}", reward=0.0)
    ep.task_id = f"task {HOSTILE}"
    return ep


def add_hostile_episode(run_dir: Path, step: int | None = None) -> str:
    """Append an episode whose every text field carries HTML/JS to the run's trajectories.db.
    Uses the run's tokenizer when it has one (else a fresh test tokenizer). Returns its id."""
    tok_dir = next((run_dir / d for d in ("tokenizer", "final") if (run_dir / d / "tokenizer.json").is_file()), None)
    if tok_dir is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tok_dir))
    else:
        tok = make_tokenizer()
    store = Store(run_dir / "trajectories.db")
    if step is None:
        step = store.db.execute("SELECT coalesce(max(step), 0) FROM episodes").fetchone()[0]
    eid = f"{step:06d}-hostile"
    store.add(hostile_episode(tok, step), eid, teacher="teacher-tiny")
    store.close()
    return eid


def build_run(path: Path, steps: int = 4, per_step: int = 3, eval_every: int = 2, seed: int = 0) -> RunFixture:
    """A short run directory (see the module docstring); ids in (step, id) order."""
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(path / "tokenizer")
    (path / "config.yaml").write_text("env: sql_db\nstudent: tiny\n", encoding="utf-8")
    rng = random.Random(seed)
    store = Store(path / "trajectories.db")
    fx = RunFixture(path, steps=steps)
    with (path / "metrics.jsonl").open("w", encoding="utf-8") as metrics:
        for step in range(steps):
            episodes = [_ordinary(tok, rng, step, slot) for slot in range(per_step)]
            for slot, ep in enumerate(episodes):
                fx.ids.append(f"{step:06d}-{slot:04d}")
                store.add(ep, fx.ids[-1], teacher="teacher-tiny")
            row: dict[str, Any] = {"step": step, "time": 1_767_225_600.0 + 60 * step}
            row.update(step_metrics(episodes, tool_names=["sql_query"]))
            row.update(loss=1.5 / (step + 1), grad_norm=0.5 + rng.random(), lr=1e-4)
            if step % eval_every == eval_every - 1:
                evals = [_ordinary(tok, rng, step, slot) for slot in range(2)]
                for slot, ep in enumerate(evals):
                    fx.ids.append(f"{step:06d}-eval-{slot}")
                    store.add(ep, fx.ids[-1], split="eval", teacher="teacher-tiny")
                row["eval/success_rate"] = sum(e.success for e in evals) / len(evals)
            metrics.write(json.dumps(row) + "\n")
    store.close()
    fx.hostile_id = add_hostile_episode(path, step=steps - 1)
    fx.ids = sorted([*fx.ids, fx.hostile_id], key=lambda i: (int(i.split("-")[0]), i))
    return fx


def long_episode(tok: Any, turns: int = 20, tokens: int = 8000, seed: int = 1) -> Episode:
    """An episode of `turns` assistant turns and about `tokens` tokens (half student, half tool)."""
    rng = random.Random(seed)
    per_turn = tokens // turns
    words = "select name city total price from customers orders where answer rows".split()
    text = " ".join(rng.choice(words) for _ in range(per_turn * 2))
    pairs: list[tuple[str, list[str] | None]] = []
    for k in range(turns):
        lines: list[str] = []
        while len(encode(tok, "\n".join(lines))) < per_turn // 2 - 12:  # ~12 template tokens around it
            lines.append(f"{len(lines)} | {rng.choice(words)} | {rng.randrange(10_000)}")
        pairs.append((text, ["\n".join(lines)] if k < turns - 1 else None))
    return make_episode(
        tok, rng, step=0, turns=pairs, question="long episode", reward=1.0, max_assistant_tokens=per_turn // 2
    )


def from_real_run(run_dir: Path) -> RunFixture:
    """A RunFixture over a directory written by a real `agentopd run`, plus one hostile episode."""
    import sqlite3

    hostile_id = add_hostile_episode(run_dir)
    conn = sqlite3.connect(run_dir / "trajectories.db")
    ids = [r[0] for r in conn.execute("SELECT id FROM episodes ORDER BY step, id")]
    steps = conn.execute("SELECT MAX(step) FROM episodes").fetchone()[0] + 1  # as build_run: steps 0..steps-1
    conn.close()
    return RunFixture(run_dir, ids, hostile_id, steps)
