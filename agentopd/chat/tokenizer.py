"""A small byte-level BPE tokenizer built locally (no hub), for the embedded default models.

    tok = build_tokenizer(texts, vocab_size=1000)   # PreTrainedTokenizerFast, < 1 s on MBs of text
    tok.save_pretrained(path)                       # tokenizer.json + chat_template.jinja
    tok = AutoTokenizer.from_pretrained(path)

- Pre-tokenization follows Qwen2/Qwen3: a regex split (letters, single digits, punctuation,
  newline runs, spaces) then byte-level; every digit is its own token, which helps tiny models
  with numbers. Any byte sequence encodes and decodes exactly.
- `SPECIAL_TOKENS` each encode to one id (ids 0..8 in that order): the chat markers
  `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` are special (dropped by
  `decode(skip_special_tokens=True)`); the tool and thinking tags are plain added tokens
  (kept when decoding), as in Qwen's tokenizer.
- eos = `<|im_end|>` (ends every assistant turn), pad = `<|endoftext|>`, no bos; the chat
  template is `agentopd.chat.template.DEFAULT_CHAT_TEMPLATE`.
- `vocab_size` is a maximum: a corpus with little variety stops short of it.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from agentopd.chat.template import DEFAULT_CHAT_TEMPLATE

CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAG_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
SPECIAL_TOKENS = CONTROL_TOKENS + TAG_TOKENS
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Qwen2-style split: contractions, letter runs (with one leading non-letter), single digits,
# punctuation runs, newline runs, other whitespace.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_tokenizer(texts: Iterable[str], vocab_size: int = 1000) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts` and wrap it for transformers."""
    min_size = len(SPECIAL_TOKENS) + 256
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be >= {min_size} (256 bytes + {len(SPECIAL_TOKENS)} special), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=t in CONTROL_TOKENS, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # The trainer registers every entry as special; the tags are ordinary added tokens (kept on decode).
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    wrapped.chat_template = DEFAULT_CHAT_TEMPLATE
    for i, t in enumerate(SPECIAL_TOKENS):
        assert wrapped.convert_tokens_to_ids(t) == i, (t, wrapped.convert_tokens_to_ids(t))
    return wrapped
