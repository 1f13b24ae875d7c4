"""Pair preflight: can this teacher distill into this student? Checked before any training.

    report = check_pair("path/to/student", "path/to/teacher", env="sql_db")
    report.ok, report.checks                 # [Check(name, status, detail)], failures first named
    shared = require_pair(student, teacher, max_context=2048)  # before a run: RUN_CHECKS, ValueError naming each failure
    CLI: agentopd check-pair --student S --teacher T [--env E]     (a table; exit 1 on a mismatch)

Distillation compares the two models token id by token id over the same token stream, so (in order):
- vocabulary: both tokenizers map every id to the same token string (the first differing id is
  named; different vocabularies need a cross-tokenizer loss, trainer.loss=xtok_k1 | xtok_full: agentopd.crosstok); each model's embedding rows cover its tokenizer; rows past it are padding no id reaches,
  allowed and named ("teacher rows 600-663: padding") — full-vocabulary losses compare the shared rows;
- special_tokens: the same special tokens at the same ids (added tokens marked special, and the
  eos / pad / bos / unk roles);
- stop_ids: the ids that end a turn (the tokenizer's eos, the generation config's eos ids, the
  chat template's `<|im_end|>` when it has one, a harmony template's `<|call|>` and `<|return|>`) are the same tokens;
- chat_template: one conversation — with the env given, the oracle's solution of its first training
  task (system prompt, tool schemas, tool calls, tool results, answer); else a fixed one with a tool
  call — and its generation prompt render to the same text byte for byte and the same token ids (the first
  difference shown); templates that differ only in the reasoning block are named as such (agentopd.pair_template);
- token_stream: that conversation played through the agent loop (agentopd.rollout, token-in/token-out, as a run
  plays episodes) with the student's tokenizer, each assistant turn the tokens a model speaking the template
  samples — with and without a reasoning block when the template has `<think>`, and with thinking off when it
  offers `enable_thinking` — and, unless `self_score=False`, once more with the last turn sampled by the
  student itself (transformers engine, T=1); each stored episode checked as `agentopd check-tokens` checks a
  run's (agentopd.chat.drift): real drift fails; history rewrites the template performs by design (Qwen3's own
  template re-renders reasoning) are named and pass — so check-pair and check-tokens agree;
- max_context: both models' `max_position_embeddings` hold the run's episodes (the env preset's
  `rollout.max_context`, or `max_context=`), else the smaller of the two is reported;
- self_score (not cheap: loads the teacher once, in fp32): the teacher scores that conversation as the
  teacher (agentopd.teacher.HFTeacher, hidden states) and the same model takes the student's side of the
  full-vocabulary forward KL (agentopd.trainer.StudentLoss, no optimizer step) — the loss and the difference between
  the scored log-probs and the model's own must be ~0 (< 1e-3): the scoring and loss path agree with the
  model itself. Both normalise over the shared token ids, as a run does (the engines never sample the
  padding rows past them); the probability the teacher would put on its padding rows is named.
- selftest (with self_score): the run's pre-flight teacher self-test on that conversation (agentopd.teacher.selftest):
  the teacher scores it twice, the student once; the largest and mean |difference| between the repeats, the OPD signal
  (mean |teacher - student|), the entropy share of ln(vocabulary), and teacher against student on the conversation's
  tokens (an oracle's when the env is given). Fails on a noisy or uniform teacher, and on one no better than the
  student on the env's oracle unless `selftest_oracle=False` (`--no-selftest-oracle`).
A check that cannot run because an earlier one failed is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from agentopd.chat import chat_template_of, encode, render
from agentopd.checker import Check, Status  # the env checker's records: one shape of check report
from agentopd.teacher.compat import id_to_token

SELF_SCORE_TOL = 1e-3

_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a value up.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string", "description": "what to look up"}}, "required": ["key"]},
    },
}
FIXED_CONVERSATION: tuple[list[dict[str, Any]], list[dict[str, Any]]] = (
    [
        {"role": "system", "content": "You answer with the tools."},
        {"role": "user", "content": "What is the price of the Camping Tent?"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "lookup", "arguments": {"key": "Camping Tent"}}]},
        {"role": "tool", "name": "lookup", "content": "price\n249.99"},
        {"role": "assistant", "content": "249.99"},
    ],
    [_TOOL],
)


@dataclass
class PairReport:
    student: str
    teacher: str
    checks: list[Check] = field(default_factory=list)
    shared_vocab: int | None = None  # the tokenizer size both share (rows a full-vocabulary loss compares)

    @property
    def ok(self) -> bool:
        return all(c.status is not Status.FAIL for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status is Status.FAIL]


class _Fail(Exception):
    pass


def _rows(config: Any) -> int:
    return int(config.get_text_config().vocab_size if hasattr(config, "get_text_config") else config.vocab_size)


def _vocabulary(student_tok, teacher_tok, student_cfg, teacher_cfg) -> tuple[str, int]:
    student, teacher = id_to_token(student_tok), id_to_token(teacher_tok)
    if student != teacher:
        i = next(i for i in range(max(max(student), max(teacher)) + 1) if student.get(i) != teacher.get(i))
        raise _Fail(
            f"tokenizers differ: student {len(student):,} tokens, teacher {len(teacher):,}; first differing id {i}: "
            f"student {student.get(i, '<none>')!r} vs teacher {teacher.get(i, '<none>')!r}. On-policy distillation compares the "
            "two models id by id; a pair with different vocabularies needs cross-tokenizer distillation (aligning the two "
            "tokenizations of the same text): trainer.loss=xtok_k1 or xtok_full (check it with check-pair --loss xtok_k1)"
        )
    size = max(student) + 1
    parts = [f"{size:,} tokens, identical"]
    for who, config in (("student", student_cfg), ("teacher", teacher_cfg)):
        rows = _rows(config)
        if rows < size:
            raise _Fail(f"{who} model has {rows:,} embedding rows for {size:,} token ids")
        if rows > size:
            parts.append(f"{who} rows {size}-{rows - 1}: padding ({rows - size:,} rows no id reaches)")
    return "; ".join(parts), size


def _special(tok: PreTrainedTokenizerBase) -> dict[str, Any]:
    roles = {r: getattr(tok, f"{r}_token_id", None) for r in ("eos", "pad", "bos", "unk")}
    added = {t.content: i for i, t in tok.added_tokens_decoder.items() if t.special}
    return {"roles": roles, "special": dict(sorted(added.items(), key=lambda kv: kv[1]))}


def _special_tokens(student_tok, teacher_tok) -> str:
    s, t = _special(student_tok), _special(teacher_tok)
    for token in sorted(set(s["special"]) | set(t["special"])):
        if s["special"].get(token) != t["special"].get(token):
            raise _Fail(f"special token {token!r}: student id {s['special'].get(token)}, teacher id {t['special'].get(token)}")
    for role in s["roles"]:
        if s["roles"][role] != t["roles"][role]:
            raise _Fail(f"{role} token: student id {s['roles'][role]}, teacher id {t['roles'][role]}")
    roles = ", ".join(f"{r} {i}" for r, i in s["roles"].items() if i is not None)
    return f"{len(s['special'])} special tokens at the same ids; {roles}"


def _stop_ids(tok: PreTrainedTokenizerBase, path: str) -> set[int]:
    from transformers import GenerationConfig

    from agentopd.rollout import stop_token_ids

    ids = set(stop_token_ids(tok))  # what the agent loop stops on (harmony: <|call|>, <|return|>)
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:  # no generation_config.json
        pass
    return ids


def _stops(student_tok, teacher_tok, student: str, teacher: str) -> str:
    s, t = _stop_ids(student_tok, student), _stop_ids(teacher_tok, teacher)
    if s != t:
        raise _Fail(f"stop ids differ: student {sorted(s)} {student_tok.convert_ids_to_tokens(sorted(s))}, "
                    f"teacher {sorted(t)} {teacher_tok.convert_ids_to_tokens(sorted(t))}")  # fmt: skip
    return f"{sorted(s)} = {student_tok.convert_ids_to_tokens(sorted(s))}"


def conversation(env: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """(messages, tool schemas, where they come from): the env's oracle on its first training task, or a fixed one."""
    if env is None:
        messages, tools = FIXED_CONVERSATION
        return [dict(m) for m in messages], list(tools), "a fixed conversation with one tool call"
    from agentopd.config import load_config
    from agentopd.corpus import oracle_conversation
    from agentopd.splits import make_env_for_split, without_split

    cfg = load_config(env)
    kwargs = without_split(cfg.env.kwargs)
    made = make_env_for_split(cfg.env.name, "train", **kwargs)
    try:
        task = made.unwrapped.tasks[0]
        messages, tools = oracle_conversation(made, task.id)
    finally:
        made.close()
    return [m if isinstance(m, dict) else dict(m) for m in messages], tools, f"the {env} oracle on task {task.id!r}"


def _template(student_tok, teacher_tok, messages, tools, source: str, template_kwargs: dict[str, Any] | None = None) -> str:
    from agentopd.pair_template import TemplateDiffers, compare_templates

    try:
        return compare_templates(student_tok, teacher_tok, messages, tools, source, template_kwargs)
    except TemplateDiffers as e:
        raise _Fail(f"{e} (where the two differ only in how the template is written, teacher.chat_template=student "
                    "renders the teacher with the student's template; or a .jinja file)") from None


def _token_stream(tok: PreTrainedTokenizerBase, messages, tools, source: str, student: str | None = None) -> str:
    from agentopd.chat import check_stored_episode
    from agentopd.pair_stream import play_conversation

    template = chat_template_of(tok)
    plays: list[tuple[str, dict[str, Any], bool]] = [("reasoning sampled", {}, True)] if "<think>" in template else []
    plays.append(("no reasoning sampled" if plays else "template defaults", {}, False))
    if "enable_thinking" in template:
        plays.append(("thinking off", {"enable_thinking": False}, False))
    engine = None
    if student is not None:  # the student samples the last turn itself: its own tokens through the same check
        import asyncio

        import torch

        from agentopd.engines.hf import HFEngine

        engine = HFEngine(student, device="cpu", dtype=torch.float32, max_batch_size=1, seed=0, vocab_size=len(tok))
        plays.append(("last turn sampled by the student", {}, True))
    parts = []
    try:
        for label, kw, reasoning in plays:
            sampled = engine if label.startswith("last turn sampled") else None
            episode = play_conversation(tok, messages, tools, kw, reasoning=reasoning, engine=sampled)
            if "error" in episode.info:
                raise _Fail(f"{label}: the agent loop could not play {source}: {episode.info['error']}")
            report = check_stored_episode(tok, episode)
            if report.drift:
                f = report.drift[0]
                where = f" at token {f.token_pos}" if f.token_pos is not None else ""
                raise _Fail(f"{label}: {len(report.drift)} drift finding(s) in {source} played by the agent loop; "
                            f"first [{f.kind}]{where}: {f.message} (stream there: {f.context})")  # fmt: skip
            rewrites = ", ".join(f"{f.kind} ({f.message.split(':')[0]})" for f in report.rewrites)
            parts.append(f"{label}: {report.num_turns} turns, {report.num_tokens:,} tokens, no drift"
                         + (f", history rewrites by the template (by design, not drift): {rewrites}" if rewrites else ""))  # fmt: skip
    finally:
        if engine is not None:
            asyncio.run(engine.close())
    return f"{source} played by the agent loop and checked as check-tokens does — " + "; ".join(parts)


def _context(student_cfg, teacher_cfg, max_context: int | None) -> str:
    s = getattr(student_cfg, "max_position_embeddings", None)
    t = getattr(teacher_cfg, "max_position_embeddings", None)
    known = [x for x in (s, t) if x is not None]
    if max_context is not None and known and max_context > min(known):
        raise _Fail(f"episodes of up to {max_context:,} tokens, but student holds {s}, teacher {t} positions")
    run = f"; episodes up to {max_context:,}" if max_context is not None else ""
    return f"student {s}, teacher {t} positions{run}"


def _self_score(teacher: str, tok: PreTrainedTokenizerBase, messages, tools, shared: int) -> str:
    import torch

    from agentopd.batch import TrainSample, collate
    from agentopd.teacher import HFTeacher, TeacherMode
    from agentopd.trainer import StudentLoss, TrainerConfig
    from agentopd.types import TokenStream

    prompt = encode(tok, render(tok, messages[:2], tools or None, add_generation_prompt=True))
    ids = encode(tok, render(tok, messages, tools or None))
    if ids[: len(prompt)] != prompt or len(ids) <= len(prompt):
        raise _Fail("the conversation's prompt is not a prefix of its full render")
    n = len(ids) - len(prompt)
    stream = TokenStream(ids, len(prompt), [1] * n, [0.0] * n, [0] * n)
    # one fp32 copy of the teacher serves both sides: its scores, and the loss path's own forward (no optimizer: a
    # Trainer's AdamW state is 16 bytes a parameter, what put a 1.5B teacher's check past 24 GB of host memory)
    scorer = HFTeacher(teacher, device="cpu", dtype=torch.float32, offload_after_score=False, vocab_size=shared)
    (scores,) = scorer.score([stream], mode=TeacherMode.HIDDEN)
    model = scorer.model
    with torch.no_grad():  # the model's own distribution over the shared ids (as the teacher scores and engines sample)
        logits_RV = model(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1].float()
        own = torch.log_softmax(logits_RV[:, :shared], -1).gather(-1, torch.tensor(ids[len(prompt) :])[:, None])[:, 0]
        padding_mass = float(torch.softmax(logits_RV, -1)[:, shared:].sum(-1).max()) if logits_RV.shape[1] > shared else None
        del logits_RV
        diff = float((own - torch.tensor(scores.logprobs)).abs().max())
        cfg = TrainerConfig(loss="forward_kl", total_steps=1)  # the loss kind; nothing here steps
        sample = TrainSample.from_stream(stream, teacher_logprobs=scores.logprobs, teacher_hidden=scores.hidden)
        loss_sum, _ = StudentLoss(model, shared)(collate([sample], [[0]]), cfg, scorer.head_weight(shared))
        loss = float(loss_sum) / n
    detail = f"{n} tokens scored: forward KL {loss:.1e}, max |log-prob difference| {diff:.1e}"
    if padding_mass is not None:  # named, not refused: full-vocabulary losses compare the shared rows only
        detail += (f"; the teacher's padding rows would hold up to {padding_mass:.1e} of its probability (engines never "
                   f"sample them; scores and losses normalise over the {shared:,} shared ids)")  # fmt: skip
    if not (abs(loss) < SELF_SCORE_TOL and diff < SELF_SCORE_TOL):
        raise _Fail(f"{detail} (should be ~0: the scoring or loss path disagrees with the model)")
    return detail


def _selftest(student: str, teacher: str, tok: PreTrainedTokenizerBase, messages, tools, shared: int, oracle: bool,
              check_oracle: bool) -> str:  # fmt: skip
    import time

    import torch

    from agentopd.pair_stream import play_conversation
    from agentopd.teacher import HFTeacher, TeacherMode
    from agentopd.teacher.selftest import judge

    t0 = time.perf_counter()
    probe = [play_conversation(tok, messages, tools, reasoning=False).tokens]
    scorer = HFTeacher(teacher, device="cpu", dtype=torch.float32, offload_after_score=False, vocab_size=shared)
    repeats = [(scorer.score(probe, mode=TeacherMode.TOPK), scorer.score(probe, mode=TeacherMode.TOPK))]
    del scorer
    own = HFTeacher(student, device="cpu", dtype=torch.float32, offload_after_score=False, vocab_size=shared)
    from agentopd.config.schema import TeacherConfig

    max_noise = TeacherConfig.model_fields["selftest_max_noise"].default  # a run's default
    found = judge("teacher", probe, repeats, [s.logprobs for s in own.score(probe)], vocab_size=shared, max_noise=max_noise,
                  oracle=[True], check_oracle=check_oracle and oracle)  # fmt: skip  # an oracle's only with the env
    detail = (f"{found.tokens} tokens, {time.perf_counter() - t0:.1f} s: repeat |difference| max {found.repeat.max:.1e} mean "
              f"{found.repeat.mean:.1e}; OPD signal (mean |teacher - student|) {found.signal:.3f}; noise share "
              f"{found.noise_share:.1%}; entropy {found.entropy_share:.1%} of ln(vocabulary); log-probability of the "
              f"{'oracle' if oracle else 'conversation'}'s tokens: teacher {found.oracle_teacher:.3f}, student {found.oracle_student:.3f}")  # fmt: skip
    line = found.refusal()
    if line is not None:
        raise _Fail(f"{line} ({detail})")
    return detail


def check_pair(student: str | Path, teacher: str | Path, env: str | None = None, *, max_context: int | None = None,
               self_score: bool = True, only: Sequence[str] | None = None, selftest_oracle: bool = True,
               template_kwargs: dict[str, Any] | None = None, teacher_template: str | None = None) -> PairReport:  # fmt: skip
    """Every pair check (module docstring), or `only` those named; `self_score=False` runs the cheap ones only;
    `template_kwargs` (the run's `rollout.enable_thinking`) go to the chat_template check's renders; `teacher_template`
    (`teacher.chat_template`: `student` or a .jinja file) replaces the teacher's own template."""
    student, teacher = str(student), str(teacher)
    report = PairReport(student, teacher)
    p = load_pair(student, teacher, env, max_context, teacher_template)
    student_tok, teacher_tok, student_cfg, teacher_cfg = p.student_tok, p.teacher_tok, p.student_cfg, p.teacher_cfg
    messages, tools, source, max_context = p.messages, p.tools, p.source, p.max_context
    shared: list[int] = []

    def vocabulary() -> str:
        detail, size = _vocabulary(student_tok, teacher_tok, student_cfg, teacher_cfg)
        shared.append(size)
        return detail

    steps = [
        ("vocabulary", vocabulary),
        ("special_tokens", lambda: _special_tokens(student_tok, teacher_tok)),
        ("stop_ids", lambda: _stops(student_tok, teacher_tok, student, teacher)),
        ("chat_template", lambda: _template(student_tok, teacher_tok, messages, tools, source, template_kwargs)),
        ("token_stream", lambda: _token_stream(student_tok, messages, tools, source, student if self_score else None)),
        ("max_context", lambda: _context(student_cfg, teacher_cfg, max_context)),
    ]
    if self_score:
        steps.append(("self_score", lambda: _self_score(teacher, teacher_tok, messages, tools, shared[0])))
        steps.append(("selftest", lambda: _selftest(student, teacher, teacher_tok, messages, tools, shared[0], env is not None,
                                                    selftest_oracle)))  # fmt: skip
    if only is not None:
        unknown = sorted(set(only) - {name for name, _ in steps})
        if unknown:
            raise ValueError(f"unknown pair checks {unknown}; choose from {[name for name, _ in steps]}")
        # self_score needs the shared size: vocabulary runs with it
        steps = [step for step in steps if step[0] in only or (step[0] == "vocabulary" and {"self_score", "selftest"} & set(only))]
    run_checks(report, steps, after_a_pass=("self_score", "selftest"))
    report.shared_vocab = shared[0] if shared else None
    return report


@dataclass
class PairInputs:
    """What every pair check reads: both tokenizers and configs, the context to check against, the conversation."""

    student_tok: PreTrainedTokenizerBase
    teacher_tok: PreTrainedTokenizerBase
    student_cfg: Any
    teacher_cfg: Any
    max_context: int | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    source: str


def load_pair(student: str, teacher: str, env: str | None, max_context: int | None,
              teacher_template: str | None = None) -> PairInputs:  # fmt: skip
    """The pair's tokenizers and configs (no weights), `max_context` (the env's rollout.max_context when None) and
    the env's oracle conversation (`conversation`); the teacher's template replaced per `teacher_template`."""
    if env is not None and max_context is None:
        from agentopd.config import load_config

        max_context = load_config(env).rollout.max_context
    student_tok, teacher_tok = AutoTokenizer.from_pretrained(student), AutoTokenizer.from_pretrained(teacher)
    override_template(teacher_tok, student_tok, teacher_template)
    return PairInputs(student_tok, teacher_tok, AutoConfig.from_pretrained(student), AutoConfig.from_pretrained(teacher),
                      max_context, *conversation(env))  # fmt: skip


STUDENT_TEMPLATE = "student"  # teacher.chat_template=student


def override_template(teacher_tok: PreTrainedTokenizerBase, student_tok: PreTrainedTokenizerBase, spec: str | None) -> None:
    """`teacher.chat_template`: None keeps the teacher's own; `student` takes the student's; else a .jinja file's text.
    For a pair whose templates differ only by artefacts of how they were written (the Qwen2.5-Coder GGUFs: `{{"name"`
    escaped in one, `{"name"` in the other), so that the teacher scores the conversation the student saw."""
    if spec is None:
        return
    if spec == STUDENT_TEMPLATE:
        teacher_tok.chat_template = chat_template_of(student_tok)
        return
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"teacher.chat_template={spec!r}: say student, or give a chat template file (.jinja) that exists")
    teacher_tok.chat_template = path.read_text()


def run_checks(report: PairReport, steps: Sequence[tuple[str, Callable[[], str]]], after_a_pass: Sequence[str]) -> None:
    """Run each named check into `report` (a `_Fail` is its failure); the checks named in `after_a_pass` are skipped
    once an earlier one failed (they load models or build on what the others checked)."""
    for name, run in steps:
        if report.failed and name in after_a_pass:
            report.checks.append(Check(name, Status.SKIP, "skipped: an earlier check failed"))
            continue
        try:
            report.checks.append(Check(name, Status.PASS, run()))
        except _Fail as e:
            report.checks.append(Check(name, Status.FAIL, str(e)))


# what `agentopd run` refuses to start with: ids that mean other tokens, a teacher shown a chat format it was not
# trained on, episodes longer than a model holds. Special-token roles and stop ids may differ (a base teacher and
# an instruct student of one family): scoring works on ids, and stopping is the student engine's business.
RUN_CHECKS = ("vocabulary", "chat_template", "max_context")


def require_pair(student: str | Path, teacher: str | Path, env: str | None = None, *, max_context: int | None = None,
                 checks: Sequence[str] = RUN_CHECKS, template_kwargs: dict[str, Any] | None = None,
                 teacher_template: str | None = None) -> int | None:  # fmt: skip
    """The cheap checks before a run (no model weights loaded; RUN_CHECKS by default): ValueError naming
    each failure; returns the shared vocabulary size (as `check_compatible` does) when `checks` has "vocabulary"
    (a cross-tokenizer loss leaves it and chat_template out: agentopd.crosstok reads across both)."""
    report = check_pair(student, teacher, env, max_context=max_context, self_score=False, only=checks, template_kwargs=template_kwargs,
                        teacher_template=teacher_template)
    if not report.ok:
        failures = "; ".join(f"{c.name}: {c.detail}" for c in report.failed)
        raise ValueError(f"teacher {teacher} does not fit student {student}: {failures} (agentopd check-pair --student ... --teacher ...)")
    assert report.shared_vocab is not None or "vocabulary" not in checks
    return report.shared_vocab
