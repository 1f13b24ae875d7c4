"""check-pair on real vocabularies (tiny random-weight models with the real embedding rows, the families' own
templates from trl): pairs of one vocabulary and template pass, each in its family's tool-call format; a Qwen3
student with a Qwen3.5 teacher is refused naming the first differing token and cross-tokenizer distillation; a pair
whose templates differ only in the reasoning block is refused with that explanation, not accepted silently (before,
Qwen3.5's thinking and non-thinking templates passed: their histories render alike, only the generation prompt
differs). Skipped without the real-vocab and chat-templates extras."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from _tiny import real_vocab_model
from agentopd.pair import check_pair, require_pair

ROWS = {"qwen3": 151_936, "qwen3.5": 248_320}


@pytest.fixture(scope="module")
def make(tmp_path_factory, qwen3_dir, qwen35_dir):
    """make(name, family, template=None): a model folder (tiny model, the family's tokenizer, `template` from trl)."""
    from agentopd.vocab import trl_template

    folders = {"qwen3": qwen3_dir, "qwen3.5": qwen35_dir}
    root = tmp_path_factory.mktemp("pairs")

    built: dict[str, tuple] = {}

    def build(name: str, family: str, template: str | None = None, seed: int = 0):
        out = root / name
        if name in built:  # asked again (the reasoning-block test names a pair three times): ~7 s a real-vocabulary folder
            assert built[name] == (family, template, seed), f"{name} was built as {built[name]}"
            return out
        built[name] = (family, template, seed)
        tok = AutoTokenizer.from_pretrained(folders[family])
        if template == "agentopd":
            from agentopd.chat import DEFAULT_CHAT_TEMPLATE

            tok.chat_template = DEFAULT_CHAT_TEMPLATE
        elif template is not None:
            tok.chat_template = trl_template(template)
        real_vocab_model(ROWS[family], seed=seed).save_pretrained(out)
        tok.save_pretrained(out)
        return out

    return build


def checks(report) -> dict:
    return {c.name: (c.status.value, c.detail) for c in report.checks}


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_a_pair_of_one_real_vocabulary_and_template_passes(make, family):
    """Qwen3 (hermes calls) and Qwen3.5 (XML calls): every cheap check passes, the played conversation included."""
    report = check_pair(make(f"s-{family}", family), make(f"t-{family}", family, seed=1), self_score=False)
    assert report.ok, report.failed
    detail = checks(report)["token_stream"][1]
    assert "no drift" in detail and "thinking off" in detail, detail


def template_pair(tmp_path, template: str) -> list:
    """Two random-weight Qwen3-vocabulary models (student, teacher) with another family's trl template on Qwen3's BPE."""
    from agentopd.vocab import write_tokenizer

    folder = write_tokenizer("qwen3", tmp_path / f"{template}_tok", template=template)
    pair = []
    for name, seed in (("s", 0), ("t", 1)):
        real_vocab_model(151_936, seed=seed).save_pretrained(tmp_path / name)
        AutoTokenizer.from_pretrained(folder).save_pretrained(tmp_path / name)
        pair.append(tmp_path / name)
    return pair


def test_a_llama_template_pair_on_the_qwen_bpe_passes(tmp_path):
    """Llama 3.1's template and JSON tool calls (on Qwen3's BPE with Llama's tokens added: no Meta BPE here)."""
    report = check_pair(*template_pair(tmp_path, "llama3_1"), self_score=False)
    assert report.ok, report.failed
    assert "template defaults: 2 turns" in checks(report)["token_stream"][1]


def test_a_gptoss_template_pair_on_the_qwen_bpe_passes(tmp_path):
    """gpt-oss's harmony template and calls (on Qwen3's BPE with harmony's tokens added: no o200k_harmony BPE here):
    the played conversation (a call, then an answer) has no drift, its history rewrites named."""
    report = check_pair(*template_pair(tmp_path, "gptoss"), self_score=False)
    assert report.ok, report.failed
    assert "no drift" in checks(report)["token_stream"][1], checks(report)["token_stream"]
    assert "['<|return|>', '<|call|>']" in checks(report)["stop_ids"][1]  # what the agent loop stops on


def test_a_qwen3_student_with_a_qwen35_teacher_is_refused_naming_the_first_differing_token(make):
    report = check_pair(make("s3", "qwen3"), make("t35", "qwen3.5"), self_score=False)
    status, detail = checks(report)["vocabulary"]
    assert status == "fail"
    assert "student 151,669 tokens, teacher 248,077" in detail and "first differing id" in detail, detail
    assert "cross-tokenizer distillation" in detail and "trainer.loss=xtok_k1" in detail, detail
    with pytest.raises(ValueError, match="first differing id"):
        require_pair(make("s3", "qwen3"), make("t35", "qwen3.5"))


def test_templates_that_differ_only_in_the_reasoning_block_are_explained(make):
    """Qwen3.5's thinking template against its non-thinking one: the histories render alike, the generation prompts
    differ (`<think>\\n` vs an empty block); refused with the reason and the key that makes them agree. Qwen3's own
    template against agentopd's (which keeps reasoning verbatim): refused, the reasoning block named."""
    report = check_pair(make("think", "qwen3.5", "qwen3_5_think"), make("nothink", "qwen3.5", "qwen3_5_nothink"), self_score=False)
    status, detail = checks(report)["chat_template"]
    assert status == "fail" and "differ only in the reasoning block" in detail and "the generation prompt" in detail, detail
    assert "rollout.enable_thinking=false" in detail, detail
    with pytest.raises(ValueError, match="reasoning block"):  # what `agentopd run` checks with the template defaults
        require_pair(make("think", "qwen3.5", "qwen3_5_think"), make("nothink", "qwen3.5", "qwen3_5_nothink"))
    # ... and with rollout.enable_thinking=false, as the run renders: the pair fits
    require_pair(make("think", "qwen3.5", "qwen3_5_think"), make("nothink", "qwen3.5", "qwen3_5_nothink"), template_kwargs={"enable_thinking": False})
    report = check_pair(make("own", "qwen3", "qwen3"), make("ours", "qwen3", "agentopd"), self_score=False)
    status, detail = checks(report)["chat_template"]
    assert status == "fail" and "differ only in the reasoning block" in detail and "same chat template" in detail, detail
    report = check_pair(make("own2", "qwen3", "qwen3"), make("llama", "qwen3", "llama3_1"), self_score=False)
    status, detail = checks(report)["chat_template"]  # a different template altogether: not called a reasoning difference
    assert status == "fail" and "reasoning" not in detail, detail
