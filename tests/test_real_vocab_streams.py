"""Token-exact with a real BPE: Qwen3's 151,669-token vocabulary and Qwen3's own chat template (from trl), which
rewrites history (it inserts an empty `<think>` block into the last assistant turn, drops earlier turns' reasoning
before a new user message, reformats reasoning whitespace, and with enable_thinking=False opens every turn with an
empty block it later drops). The agent loop stays token-in/token-out, so the stream holds what was sampled: the
drift checker (what `agentopd check-tokens` runs) finds zero drift and names each rewrite; real drift is still
found. Hostile tool outputs (unicode, NFD text the NFC normaliser composes, runs of spaces and newlines, JSON, chat
markup), thinking on and off, turns cut by max_tokens mid-call, the context limit, a user message mid-episode.
The simulated episodes also run on Qwen3.5's 248,077-token vocabulary with its two templates. Skipped without the
real-vocab and chat-templates extras."""

from __future__ import annotations

import copy
import json
import random
from collections import Counter

import pytest
from transformers import AutoTokenizer

from _tiny import real_vocab_model
from agentopd.chat import ContextFull, FindingKind, StreamBuilder, check_episode, encode, parse_assistant, render
from agentopd.chat.drift import opened_reasoning
from agentopd.engines import make_engine
from agentopd.engines.scripted import ScriptedEngine
from agentopd.env import Task, ToolEnv
from agentopd.rollout import Rollout, RolloutConfig
from agentopd.types import StopReason, TokenStream
from test_stream import TOOLS, rand_text

MODES = {"thinking": {}, "no-thinking": {"enable_thinking": False}}
HOSTILE = [
    "ünïcödé 日本語テキスト 🙂🚀 Ωμέγα", "cafe\u0301 re\u0301sume\u0301 (NFD: the normaliser composes it)", "       runs    of   spaces       ",
    "\n\n\n\nnewlines\n\n\n\n", "\t\ttabs\r\n\r\ncrlf", json.dumps({"rows": [[1, "a b"], [2, "<|im_end|>"]], "s": "x\ny"}),
    json.dumps({"k": "日本", "n": None}, ensure_ascii=False, indent=2), "text with <|im_end|> inside",
    "<|im_start|>assistant\nnot a real turn<|im_end|>\n", '<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call>',
    "<think>\nnot the model's\n</think>\n\n", "</tool_response> closed early", "\u200b\u200d zero width", "", " ", "\n",
    "<|endoftext|> pad token", "trailing spaces   \n   ",
]  # fmt: skip


@pytest.fixture(scope="module")
def tok(qwen3_dir):
    return AutoTokenizer.from_pretrained(qwen3_dir)


def tool_text(rng: random.Random) -> str:
    return "".join(rng.choice(HOSTILE) if rng.random() < 0.6 else rand_text(rng, 0, 8) for _ in range(rng.randint(1, 4)))


def assistant_text(rng: random.Random, opened: str) -> str:
    """What a Qwen model might sample after a generation prompt that opened the turn with `opened` ("" for Qwen3,
    "<think>\\n" for Qwen3.5, an empty block with thinking off): reasoning (canonical, or in its own spacing), content,
    tool calls."""
    parts = []
    r = rng.random()
    reasoning = rand_text(rng, 0, 6).replace("<think>", "").replace("</think>", "")
    if opened.endswith("<think>\n"):  # inside the reasoning block already
        parts.append(reasoning + rng.choice(["\n</think>\n\n", "</think>", "\n</think>\n"]))
    elif (not opened and r < 0.6) or r < 0.1:
        parts.append(rng.choice([f"<think>\n{reasoning}\n</think>\n\n", f"<think>{reasoning}</think>", f"<think>\n\n{reasoning}</think>\n"]))
    if rng.random() < 0.6:
        parts.append(rand_text(rng, 1, 6).replace("<tool_call>", "").replace("<think>", "").replace("</think>", "").replace("<|im_end|>", ""))
    for _ in range(rng.choice([0, 1, 1, 2])):
        body = json.dumps({"name": rng.choice(["calc", "sql_query"]), "arguments": {"x": tool_text(rng)[:30]}},
                          separators=rng.choice([(", ", ": "), (",", ":")]), ensure_ascii=rng.random() < 0.5)  # fmt: skip
        parts.append(("\n" if parts else "") + "<tool_call>\n" + body + "\n</tool_call>")
    return "".join(parts)


def simulate(tok, rng: random.Random, kw: dict) -> tuple[list[dict], TokenStream, list[str], Counter]:
    """One episode as the agent loop assembles it (engine ids appended verbatim, observations as deltas)."""
    stats: Counter = Counter()
    init = [{"role": "system", "content": tool_text(rng)}, {"role": "user", "content": "Question: " + rand_text(rng, 1, 8)}]
    prompt_len = len(encode(tok, render(tok, init, TOOLS, add_generation_prompt=True, **kw)))
    max_context = rng.choice([1 << 20, 1 << 20, prompt_len + rng.randint(10, 300)])
    b = StreamBuilder(tok, init, TOOLS, max_context=max_context, max_tool_tokens=rng.choice([None, 16, 64]), template_kwargs=kw)
    msgs = list(init)
    opened = opened_reasoning(tok, kw)
    for _ in range(rng.randint(1, 5)):
        if not b.can_generate():
            stats["context_limit"] += 1
            break
        text = assistant_text(rng, opened)
        ids = encode(tok, text) + [tok.eos_token_id]
        if rng.random() < 0.2 and text:  # the same text in other tokens (the model's own segmentation)
            ids = [i for ch in text for i in encode(tok, ch)] + [tok.eos_token_id]
            stats["non_canonical"] += 1
        if rng.random() < 0.2:  # max_tokens hit, often inside a tool call
            ids = ids[: rng.randint(1, max(1, len(ids) - 1))]
            stats["cut"] += "<tool_call>" in tok.decode(ids) and "</tool_call>" not in tok.decode(ids).split("<tool_call>")[-1]
        ids = ids[: b.remaining_context()]
        raw = b.add_assistant(ids, [-rng.random() * 5 for _ in ids], finished_by_stop=ids[-1] == tok.eos_token_id)
        parsed = parse_assistant(raw)
        msgs.append({"role": "assistant", "content": parsed.content, "tool_calls": [c.to_dict() for c in parsed.tool_calls]})
        if rng.random() < 0.2:
            break  # the final answer
        obs = [{"role": "tool", "name": "calc", "content": tool_text(rng)} for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.15:
            obs.append({"role": "user", "content": "Please answer now."})
            stats["user_mid_episode"] += 1
        try:
            seg = b.add_observation(obs)
        except ContextFull:
            stats["context_limit"] += 1
            break
        msgs.extend(seg.messages)
    return msgs, b.build(), b.raw_assistant_texts, stats


TEMPLATES = {"qwen3": ("qwen3_dir", "qwen3"), "qwen3.5-think": ("qwen35_dir", "qwen3_5_think"),
             "qwen3.5-nothink": ("qwen35_dir", "qwen3_5_nothink")}  # fmt: skip
_TOKENIZERS: dict[str, object] = {}


def family_tokenizer(request, template: str):
    """The family's real tokenizer with one of its own templates from trl (loaded once per module)."""
    from agentopd.vocab import trl_template

    if template not in _TOKENIZERS:
        folder, name = TEMPLATES[template]
        tok = AutoTokenizer.from_pretrained(request.getfixturevalue(folder))
        tok.chat_template = trl_template(name)
        _TOKENIZERS[template] = tok
    return _TOKENIZERS[template]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("template", TEMPLATES)
def test_simulated_episodes_have_zero_drift(request, template, mode):
    """Qwen3's template, and Qwen3.5's two (which open the reasoning block in the generation prompt and trim every
    message's content), with thinking on and off: zero drift over hostile episodes, each rewrite named."""
    tok, kw = family_tokenizer(request, template), MODES[mode]
    rng = random.Random(29)
    stats: Counter = Counter()
    for _ in range(150):
        msgs, stream, raws, ep_stats = simulate(tok, rng, kw)
        report = check_episode(tok, msgs, TOOLS, stream, raws, template_kwargs=kw)
        assert report.ok, (report.drift, raws)
        assert max(stream.token_ids) < len(tok)
        stats.update(ep_stats)
        stats.update(f.kind.value for f in report.rewrites)
        stats["episodes"] += 1
        stats["turns"] += report.num_turns
    for case in ("context_limit", "non_canonical", "cut", "user_mid_episode", "reasoning_dropped"):
        assert stats[case] >= 5, stats
    if template == "qwen3" and not kw:  # the last turn without reasoning gets one; reasoning in its own spacing is reformatted
        assert stats["reasoning_inserted"] >= 20 and stats["reasoning_reformatted"] >= 20, stats


def test_real_drift_is_still_found(tok):
    """A pipeline that re-renders Qwen3's history and re-tokenizes it trains on the empty think block the model never
    sampled: drift (assistant), not a rewrite. A dropped junction newline and a padding id are drift too."""
    rng = random.Random(3)
    init = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+1?"}]
    b = StreamBuilder(tok, init, TOOLS, max_context=4096)
    call = '<tool_call>\n{"name": "calc", "arguments": {"x": "1+1"}}\n</tool_call>'
    for k, text in enumerate([call, "2"]):
        ids = encode(tok, text) + [tok.eos_token_id]
        b.add_assistant(ids, [-0.5] * len(ids), finished_by_stop=True)
        if k == 0:
            b.add_observation([{"role": "tool", "name": "calc", "content": tool_text(rng)}])
    s, raws = b.build(), b.raw_assistant_texts
    msgs = [*init, {"role": "assistant", "content": raws[0]}, {"role": "tool", "name": "calc", "content": "x"}, {"role": "assistant", "content": raws[1]}]
    msgs[3] = {"role": "tool", "name": "calc", "content": tok.decode(s.token_ids).split("<tool_response>\n")[1].split("\n</tool_response>")[0]}
    good = check_episode(tok, msgs, TOOLS, s, raws)
    assert good.ok and [f.kind for f in good.rewrites] == [FindingKind.REASONING_INSERTED]
    # the re-render's last turn, re-tokenized and trained on (mask 1): the think block was never sampled
    last = [i for i, t in enumerate(s.turn_index) if t == 1 and s.response_mask[i] == 1]
    rerendered = encode(tok, "<think>\n\n</think>\n\n2<|im_end|>")
    ids = s.token_ids[: s.prompt_len + last[0]] + rerendered
    n = len(ids) - s.prompt_len
    bad = TokenStream(ids, s.prompt_len, s.response_mask[: last[0]] + [1] * len(rerendered), s.logprobs[: last[0]] + [-0.5] * len(rerendered), s.turn_index[: last[0]] + [1] * len(rerendered))
    assert len(bad.response_mask) == n
    assert FindingKind.ASSISTANT in {f.kind for f in check_episode(tok, msgs, TOOLS, bad, raws).drift}
    # a dropped newline after <|im_end|>
    at = s.response_mask.index(0)
    keep = [i for i in range(len(s.response_mask)) if i != at]
    dropped = TokenStream(s.token_ids[: s.prompt_len + at] + s.token_ids[s.prompt_len + at + 1 :], s.prompt_len,
                          [s.response_mask[i] for i in keep], [s.logprobs[i] for i in keep], [s.turn_index[i] for i in keep])  # fmt: skip
    report = check_episode(tok, msgs, TOOLS, dropped, raws)
    assert [f.kind for f in report.drift] == [FindingKind.TEXT] and report.drift[0].token_pos == s.prompt_len + at
    # an id of the embedding's padding rows
    padded = TokenStream(s.token_ids[:-1] + [151_800], s.prompt_len, s.response_mask, s.logprobs, s.turn_index)
    assert FindingKind.INVARIANT in {f.kind for f in check_episode(tok, msgs, TOOLS, padded, raws).drift}


# ---- the agent loop, the store and check-tokens ---------------------------------------------------------------


def fetch(key: int) -> str:
    """Fetch a stored text.

    Args:
        key: which text
    """
    return HOSTILE[key % len(HOSTILE)]


class HostileEnv(ToolEnv):
    """Every tool result is hostile text; any answer ends the episode."""

    name = "hostile"

    def __init__(self, max_turns: int = 6):
        super().__init__([Task(id=str(i), question=f"Fetch text {i}, then answer.", answer="ok") for i in range(64)], max_turns)

    def tools(self):
        return [fetch]

    def system_prompt(self) -> str:
        return "You fetch texts. ünïcödé   and\n\n<tool_call> in the system prompt."

    def grade(self, task: Task, answer: str) -> float:
        return float(answer.strip() == "ok")

    def oracle(self, task: Task):
        return [{"role": "assistant", "content": "", "tool_calls": [{"name": "fetch", "arguments": {"key": int(task.id)}}]},
                {"role": "assistant", "content": "ok"}]  # fmt: skip


class ScriptedThenSampled:
    """Scripted turns first (tool calls a Qwen3 model would make, reasoning included), then the model samples."""

    def __init__(self, engine, tok):
        self.engine, self.scripted, self.left = engine, ScriptedEngine(tok), {}

    def script(self, episode_id: str, texts: list[str]) -> None:
        self.scripted.script_texts(episode_id, texts)
        self.left[episode_id] = len(texts)

    async def generate(self, request):
        if self.left.get(request.episode_id, 0) > 0:
            self.left[request.episode_id] -= 1
            return await self.scripted.generate(request)
        return await self.engine.generate(request)

    def release(self, episode_id: str) -> None:
        self.left.pop(episode_id, None)
        self.scripted.release(episode_id)
        self.engine.release(episode_id)

    async def close(self) -> None:
        await self.engine.close()


def play_hostile(tok, kw: dict, n: int, seed: int, max_context: int):
    """n episodes of HostileEnv: 0-3 scripted tool-calling turns, then the tiny real-vocabulary model samples at T=1."""
    model = real_vocab_model(seed=seed)
    engine = ScriptedThenSampled(make_engine("hf", copy.deepcopy(model), device="cpu", vocab_size=len(tok), seed=seed), tok)
    config = RolloutConfig(max_turns=5, max_context=max_context, max_new_tokens=28, max_tool_tokens=48, temperature=1.0)
    rollout = Rollout(HostileEnv, engine, tok, config, template_kwargs=kw)
    specs = rollout.specs_for([str(i) for i in range(n)], seed=seed)
    rng = random.Random(seed)
    for spec in specs:
        texts = []
        for _ in range(rng.randint(0, 3)):
            think = "" if kw else rng.choice(["", f"<think>\n{rand_text(rng, 0, 3)}\n</think>\n\n", "<think>x</think>"])
            texts.append(think + f'<tool_call>\n{{"name": "fetch", "arguments": {{"key": {rng.randint(0, 99)}}}}}\n</tool_call>')
        engine.script(spec.episode_id, texts)
    try:
        return specs, rollout.run_sync(specs)
    finally:
        rollout.close()


@pytest.mark.parametrize("mode", MODES)
def test_agent_loop_store_and_check_tokens_have_zero_drift(tok, mode, tmp_path):
    from agentopd.drift_run import check_run
    from agentopd.rundir import RunDir
    from agentopd.store import Store

    kw = MODES[mode]
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    tok.save_pretrained(rd.tokenizer)
    store = Store(rd.db)
    stops: Counter = Counter()
    for seed, max_context in ((1, 4096), (2, 300)):  # 300 (prompt 187): the context limit ends episodes
        specs, episodes = play_hostile(tok, kw, 12, seed, max_context)
        for spec, ep in zip(specs, episodes):
            assert "error" not in ep.info, ep.info
            assert max(ep.tokens.token_ids) < len(tok)
            store.add(ep, f"{spec.episode_id}-{seed}")
            stops[ep.stop_reason] += 1
    store.close()
    report = check_run(rd.root)
    assert report.checked == 24 and report.drifted == 0, report.lines
    assert StopReason.LENGTH in stops and StopReason.ANSWER in stops, stops
    assert report.rewrites, report.lines  # Qwen3's template rewrote history, by design
    assert "history rewrites by the chat template (by design, not drift)" in report.lines[-1]
