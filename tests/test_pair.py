"""Pair preflight (agentopd.pair, `agentopd check-pair`): the built-in tiny pair passes, a pair whose
teacher has padding rows passes and names them, a pair with another tokenizer fails naming the first
differing token, and a run's context that the models cannot hold fails."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from agentopd.chat import build_tokenizer
from agentopd.checker import Status
from agentopd.cli import app
from agentopd.pair import check_pair, require_pair


@pytest.fixture
def cli(tiny_home, monkeypatch):
    monkeypatch.setenv("AGENTOPD_HOME", str(tiny_home))
    monkeypatch.setenv("COLUMNS", "250")
    runner = CliRunner()
    return lambda *args: runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def pair(tiny_home):
    return tiny_home / "models" / "sql_db" / "student", tiny_home / "models" / "sql_db" / "teacher"


def statuses(report) -> dict[str, Status]:
    return {c.name: c.status for c in report.checks}


def test_builtin_pair_passes_every_check(cli, pair):
    student, teacher = pair
    report = check_pair(student, teacher, env="sql_db", selftest_oracle=False)  # the tiny_home teacher is random (conftest)
    assert report.ok and set(statuses(report).values()) == {Status.PASS}
    assert list(statuses(report)) == ["vocabulary", "special_tokens", "stop_ids", "chat_template", "token_stream", "max_context",
                                      "self_score", "selftest"]
    detail = {c.name: c.detail for c in report.checks}
    assert "sql_db oracle" in detail["chat_template"] and "identical" in detail["chat_template"]
    assert "played by the agent loop" in detail["token_stream"] and "no drift" in detail["token_stream"]
    assert "forward KL" in detail["self_score"]
    assert "repeat |difference| max 0.0e+00" in detail["selftest"] and "OPD signal" in detail["selftest"]
    result = cli("check-pair", "--student", student, "--teacher", teacher)
    assert result.exit_code == 0, result.output
    assert "all checks passed" in result.output and "self_score" in result.output and "selftest" in result.output


def test_selftest_fails_a_teacher_no_better_than_the_student_or_uniform(cli, pair, tmp_path):
    """check-pair reports the run's pre-flight self-test: the random tiny teacher is worse than its student on the
    sql_db oracle; a teacher with zeroed weights is uniform."""
    student, teacher = pair
    report = check_pair(student, teacher, env="sql_db")
    failed = {c.name: c.detail for c in report.failed}
    assert list(failed) == ["selftest"] and "no better than the student on the env's oracle episodes" in failed["selftest"]
    result = cli("check-pair", "--student", student, "--teacher", teacher, "--env", "sql_db", "--no-selftest-oracle")
    assert result.exit_code == 0, result.output
    zeroed = AutoModelForCausalLM.from_pretrained(teacher)
    with torch.no_grad():
        for p in zeroed.parameters():
            p.zero_()
    zeroed.save_pretrained(tmp_path / "zeroed")
    AutoTokenizer.from_pretrained(teacher).save_pretrained(tmp_path / "zeroed")
    uniform = {c.name: c.detail for c in check_pair(student, tmp_path / "zeroed").failed}
    assert "is uniform" in uniform["selftest"] and "100.0% of ln(vocabulary)" in uniform["selftest"]


def test_padded_vocabulary_passes_and_names_the_padding(cli, pair, tmp_path):
    student, src = pair
    teacher = AutoModelForCausalLM.from_pretrained(src)
    rows = teacher.config.vocab_size
    teacher.resize_token_embeddings(rows + 64, mean_resizing=False)  # 64 padding rows (as Qwen's 151,936 vs 152,064)
    with torch.no_grad():
        teacher.get_output_embeddings().weight[rows:].normal_()
    teacher.save_pretrained(tmp_path / "padded")
    AutoTokenizer.from_pretrained(src).save_pretrained(tmp_path / "padded")
    report = check_pair(student, tmp_path / "padded")
    assert report.ok, report.failed
    vocab = next(c for c in report.checks if c.name == "vocabulary")
    assert f"teacher rows {rows}-{rows + 63}: padding (64 rows" in vocab.detail
    assert report.shared_vocab == rows and require_pair(student, tmp_path / "padded") == rows
    result = cli("check-pair", "--student", student, "--teacher", tmp_path / "padded", "--no-self-score")
    assert result.exit_code == 0 and "padding" in result.output, result.output


def test_another_tokenizer_fails_naming_the_first_differing_token(cli, pair, tmp_path):
    student, src = pair
    tok = AutoTokenizer.from_pretrained(src)
    other = build_tokenizer(["zebra quartz " * 50, "jovial wyvern " * 50], vocab_size=300)  # other merges, same specials
    mine, theirs = tok.convert_ids_to_tokens(list(range(len(tok)))), other.convert_ids_to_tokens(list(range(len(other))))
    first = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
    teacher = AutoModelForCausalLM.from_pretrained(src)
    teacher.resize_token_embeddings(len(other), mean_resizing=False)
    teacher.save_pretrained(tmp_path / "other")
    other.save_pretrained(tmp_path / "other")
    report = check_pair(student, tmp_path / "other")
    assert not report.ok and statuses(report)["vocabulary"] == Status.FAIL
    assert statuses(report)["self_score"] == Status.SKIP
    vocab = next(c for c in report.checks if c.name == "vocabulary")
    assert f"first differing id {first}: student {mine[first]!r} vs teacher {theirs[first]!r}" in vocab.detail
    result = cli("check-pair", "--student", student, "--teacher", tmp_path / "other", "--no-self-score")
    assert result.exit_code == 1 and "first differing id" in result.output and "vocabulary" in result.output
    with pytest.raises(ValueError, match="vocabulary: tokenizers differ"):
        require_pair(student, tmp_path / "other")


def test_a_run_refuses_what_breaks_distillation_only(pair, tmp_path):
    """require_pair (what `agentopd run` calls): vocabulary, chat template and context; a teacher whose
    eos role differs (a base checkpoint beside an instruct one) is named by check-pair but may run."""
    student, src = pair
    tok = AutoTokenizer.from_pretrained(src)
    tok.eos_token = "<|endoftext|>"  # another role for an existing token: ids unchanged
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    report = check_pair(student, tmp_path / "base", self_score=False)
    assert statuses(report)["special_tokens"] == Status.FAIL and "eos token" in report.failed[0].detail
    assert require_pair(student, tmp_path / "base", max_context=1024) == len(tok)
    with pytest.raises(ValueError, match="max_context: episodes of up to 4,096 tokens"):
        require_pair(student, tmp_path / "base", max_context=4096)
    with pytest.raises(ValueError, match="unknown pair checks"):
        check_pair(student, src, only=["vocab"])


def test_a_context_the_models_cannot_hold_fails(pair):
    student, teacher = pair
    report = check_pair(student, teacher, max_context=4096, self_score=False)
    assert statuses(report)["max_context"] == Status.FAIL and "4,096" in report.failed[0].detail
    assert check_pair(student, teacher, max_context=1024, self_score=False).ok


def test_a_template_written_otherwise_fails_naming_the_override_which_fixes_it(cli, pair, tmp_path):
    """The Qwen2.5-Coder GGUFs' case: the 1.5B's template escapes a brace the 0.5B's does not. check-pair names
    teacher.chat_template; `student` (or a .jinja file) makes the teacher render the student's way; a run's config key
    reaches the same check."""
    student, src = pair
    tok = AutoTokenizer.from_pretrained(src)
    own = tok.chat_template
    tok.chat_template = own.replace("<tool_call>\\n", "<tool_call>\\n ")  # one more space in every rendered call
    assert tok.chat_template != own
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(tmp_path / "t")
    tok.save_pretrained(tmp_path / "t")
    report = check_pair(student, tmp_path / "t", env="sql_db", self_score=False)
    assert statuses(report)["chat_template"] == Status.FAIL
    assert "teacher.chat_template=student" in report.failed[0].detail
    assert check_pair(student, tmp_path / "t", env="sql_db", self_score=False, teacher_template="student").ok
    (tmp_path / "own.jinja").write_text(own)
    assert check_pair(student, tmp_path / "t", env="sql_db", self_score=False, teacher_template=str(tmp_path / "own.jinja")).ok
    with pytest.raises(ValueError, match="teacher.chat_template='nope.jinja': say student"):
        check_pair(student, tmp_path / "t", self_score=False, teacher_template="nope.jinja")
    result = cli("check-pair", "--student", student, "--teacher", tmp_path / "t", "--env", "sql_db", "--no-self-score",
                 "--teacher-template", "student")  # fmt: skip
    assert result.exit_code == 0, result.output
